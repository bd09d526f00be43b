"""Which of JAX's platforms a jaxgpt process starts: a TPU backend only where a TPU is.

With libtpu installed (the `tpu` extra, which compiles for TPU topologies ahead of time on any
machine: jaxgpt.compile), JAX tries to start a TPU backend in every process, TPU or not:
on a machine without one, libtpu prints its initialisation errors, takes its lock file (a
second process then cannot describe a topology) and slows the start. skip_absent_tpu, run
when jaxgpt is imported, leaves the TPU out of JAX's platforms there; it changes nothing
where a TPU is, where libtpu is not installed, or where the user chose (JAX_PLATFORMS).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from pathlib import Path

GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips are PCI devices of Google's vendor id (as JAX finds them)
GPU_PLUGINS = {"cuda": ("jax_cuda12_plugin", "jax_cuda13_plugin"), "rocm": ("jax_rocm60_plugin", "jax_rocm7_plugin")}


def tpu_present(pci: str = "/sys/bus/pci/devices", dev: str = "/dev") -> bool:
    """Whether this machine has a TPU chip: a PCI device of Google's, or a TPU device file."""
    for vendor in glob.glob(os.path.join(pci, "*", "vendor")):
        try:
            if Path(vendor).read_text().strip() == GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return bool(glob.glob(os.path.join(dev, "accel*")) or glob.glob(os.path.join(dev, "vfio", "[0-9]*")))


def platforms_without_tpu() -> str:
    """JAX's platforms but the TPU: the GPU ones whose plugin is installed (JAX itself skips
    CUDA without a visible GPU), then the CPU."""
    gpus = [name for name, plugins in GPU_PLUGINS.items() if any(importlib.util.find_spec(p) for p in plugins)]
    return ",".join([*gpus, "cpu"])


def skip_absent_tpu(environ=os.environ) -> str | None:
    """Leave the TPU out of JAX's platforms when libtpu is installed but no TPU is here and
    the user set no JAX_PLATFORMS: through the environment when JAX is not imported yet (so
    that this process's children inherit it), else JAX's config. Returns the platforms set,
    or None when it changed nothing."""
    if environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None or tpu_present():
        return None
    platforms = platforms_without_tpu()
    environ["JAX_PLATFORMS"] = platforms
    if "jax" in sys.modules:
        import jax

        if not jax.config.jax_platforms:
            jax.config.update("jax_platforms", platforms)
    return platforms
