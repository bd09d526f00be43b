"""Which of JAX's platforms a jaxgpt process starts: an accelerator's backend only where the
accelerator is.

TPU. With libtpu installed (the `tpu` extra, which compiles for TPU topologies ahead of time on
any machine: jaxgpt.compile), JAX tries to start a TPU backend in every process, TPU or not:
on a machine without one, libtpu prints its initialisation errors, takes its lock file (a
second process then cannot describe a topology) and slows the start. skip_absent_tpu leaves
the TPU out of JAX's platforms there.

CUDA. With JAX's CUDA plugin installed (the `gpu` extra, which compiles for GPU targets ahead of
time: jaxgpt.compile), `import jax` loads the plugin's kernels and JAX initialises the plugin in
every process: on a machine without an NVIDIA GPU, CUDA's driver stub prints "Could not find
cuda drivers" three times and the plugin a traceback (no CUDA runtime). skip_absent_gpu keeps the
plugin out of the process there, so that JAX finds none, as without the extra; jaxgpt.compile
lets it in (let_cuda_plugin_in) to describe a GPU topology.

Both run when jaxgpt is imported (before JAX, so that the CUDA plugin's kernels are never
loaded), and change nothing where the accelerator is, where its library is not installed, or
where the user chose (JAX_PLATFORMS).

jaxgpt.platforms.forms holds the equations' platform forms (compute.matmul, compute.rope); it
imports JAX, so this module never imports it.
"""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import os
import platform
import sys
import types
from pathlib import Path

# The environment XLA and JAX read as they start, as it was when jaxgpt was imported (before JAX,
# in every command): what the programs this process compiles depend on (jaxgpt.programs).
STARTED_WITH = {name: value for name, value in os.environ.items()
                if name.startswith(("XLA_", "JAX_", "TPU_", "LIBTPU", "CUDA_", "NVIDIA_", "TF_"))}
GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips are PCI devices of Google's vendor id (as JAX finds them)
NVIDIA_DEVICE_FILES = ("nvidia0", "nvidiactl", "dxg")  # an NVIDIA GPU's, as JAX looks for one (dxg: WSL2's)
GPU_PLUGINS = {"cuda": ("jax_cuda12_plugin", "jax_cuda13_plugin"), "rocm": ("jax_rocm60_plugin", "jax_rocm7_plugin")}
CUDA_PJRT = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")  # the CUDA plugins JAX discovers and initialises


def tpu_present(pci: str = "/sys/bus/pci/devices", dev: str = "/dev") -> bool:
    """Whether this machine has a TPU chip: a PCI device of Google's, or a TPU device file."""
    for vendor in glob.glob(os.path.join(pci, "*", "vendor")):
        try:
            if Path(vendor).read_text().strip() == GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return bool(glob.glob(os.path.join(dev, "accel*")) or glob.glob(os.path.join(dev, "vfio", "[0-9]*")))


def nvidia_gpu_present(dev: str = "/dev") -> bool:
    """Whether this machine shows an NVIDIA GPU: its driver's device files, JAX's own test."""
    return any(os.path.exists(os.path.join(dev, name)) for name in NVIDIA_DEVICE_FILES)


def platforms_without_tpu() -> str:
    """JAX's platforms but the TPU: the GPU ones whose plugin is installed (CUDA only where an
    NVIDIA GPU is: elsewhere skip_absent_gpu keeps its plugin out), then the CPU."""
    gpus = [name for name, plugins in GPU_PLUGINS.items() if (name != "cuda" or nvidia_gpu_present())
            and any(importlib.util.find_spec(p) for p in plugins)]
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


class LeftOut(types.ModuleType):
    """Stands in for JAX's CUDA plugin where skip_absent_gpu keeps it out: JAX's plugin discovery
    imports it and calls initialize(), which registers nothing."""

    def initialize(self) -> None:
        return None


def _cuda_requested(environ) -> bool:
    return any(p.strip() in ("cuda", "gpu") for p in environ.get("JAX_PLATFORMS", "").split(","))


def skip_absent_gpu(environ=os.environ, modules=sys.modules) -> bool:
    """Keep JAX's CUDA plugin out of this process when it is installed, no NVIDIA GPU is here,
    the user's JAX_PLATFORMS asks for no CUDA, and JAX has not loaded it yet: its kernel modules
    cannot be imported (JAX then runs as without them) and its PJRT plugin is a LeftOut.
    Returns whether it did."""
    cuda_modules = (*GPU_PLUGINS["cuda"], *CUDA_PJRT)
    if _cuda_requested(environ) or nvidia_gpu_present() or any(name in modules for name in cuda_modules):
        return False
    if not any(importlib.machinery.PathFinder.find_spec(name) for name in GPU_PLUGINS["cuda"]):  # on sys.path
        return False
    for name in GPU_PLUGINS["cuda"]:
        modules[name] = None  # `import name` raises ImportError, which JAX takes for "not installed"
    for name in CUDA_PJRT:
        modules[name] = LeftOut(name, LeftOut.__doc__)
    return True


def let_cuda_plugin_in(modules=sys.modules) -> bool:
    """Undo skip_absent_gpu, so that JAX loads its CUDA plugin (jaxgpt.compile, for a GPU
    topology). False when it cannot: JAX was imported while the plugin was kept out."""
    kept = [name for name in (*GPU_PLUGINS["cuda"], *CUDA_PJRT)
            if name in modules and isinstance(modules[name], (types.NoneType, LeftOut))]
    if kept and "jax" in modules:
        return False
    for name in kept:
        del modules[name]
    return True


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's), else what the platform module says."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    except OSError:
        pass
    return model
