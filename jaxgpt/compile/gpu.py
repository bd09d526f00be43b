"""jaxgpt.compile's GPU targets: the devices of a GPU topology such as 'h100:8', described by JAX's
CUDA plugin from jaxgpt.compile.gpus' target description (no GPU needed: XLA compiles for it and ptxas
assembles its kernels), and the attention kernel the programs can compile with here.

On a machine without an NVIDIA GPU, jaxgpt keeps the CUDA plugin out of its processes
(jaxgpt.platforms); open_plugin lets it in before JAX is imported, runs JAX itself on the CPU
(the plugin only describes the target, so it checks for no CUDA runtime), and keeps the CUDA
driver stub's "Could not find cuda drivers" lines out of sight (they are shown with any error).
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import re
import shutil
import sys

from jaxgpt import platforms
from jaxgpt.compile import gpus
from jaxgpt.errors import ConfigError, one_line, stderr_kept

# what compiling for a GPU needs: module → the package that brings it (all three: the gpu extra; ptxas may
# also be a CUDA toolkit's, on the PATH)
NEEDED = {"jax_cuda12_plugin": "jax-cuda12-plugin", "jax_plugins.xla_cuda12": "jax-cuda12-pjrt",
          "nvidia.cuda_nvcc": "nvidia-cuda-nvcc-cu12 (ptxas)"}
CUDNN_INSTALL = "pip install 'nvidia-cudnn-cu12>=9.8,<10'"
_ABSL_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] ")  # absl's prefix: level, time, thread, file:line
_STUB_NOISE = ("All log messages before absl::InitializeLog()", "Could not find cuda drivers")


def open_plugin(name: str) -> None:
    """Ready this process to describe the GPU topology `name`: the name checked (ValueError
    listing the known ones), the CUDA plugin let in and found installed (ValueError with the
    install line), JAX on the CPU where no GPU is, and JAX imported quietly. Where no GPU is,
    call it before anything imports JAX."""
    gpus.parse(name)
    if not platforms.let_cuda_plugin_in():
        raise ValueError(f"compiling for the GPU topology {name} needs JAX's CUDA plugin, which this process "
                         "kept out (no NVIDIA GPU here) before JAX was imported: describe the topology first, "
                         f"in a process that has not imported JAX (python -m jaxgpt.compile --topology={name})")
    missing = [package for module, package in NEEDED.items()
               if not _findable(module) and not (module == "nvidia.cuda_nvcc" and shutil.which("ptxas"))]
    if missing:
        raise ValueError(f"compiling for the GPU topology {name} needs the gpu extra ({', '.join(missing)} "
                         f"not installed): {gpus.INSTALL}")
    if not platforms.nvidia_gpu_present() and "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices need no backend of their own
    with stderr_kept() as noise:
        try:
            import jax  # noqa: F401  (loads the plugin's kernels, whose driver stub complains without a GPU)
        except ImportError as error:
            raise ValueError(f"JAX cannot load its CUDA plugin: {one_line(error)} {noise.text()[-300:]}") from None


def _findable(module: str) -> bool:
    """Whether `module` can be imported (a package of the submodule's missing: no)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def topology_devices(name: str) -> list:
    """The devices of the GPU topology `name`, all of its hosts', compile-only (open_plugin
    first: in a process without a GPU, before anything imports JAX)."""
    gpu, hosts, per_host = gpus.parse(name)
    open_plugin(name)
    import jax
    from jax.experimental import topologies

    with stderr_kept() as noise:
        try:
            topology = topologies.get_topology_desc(platform="cuda", target_config=gpus.target_config(gpu),
                                                    topology=f"1x{hosts}x{per_host}")
        except (jax.errors.JaxRuntimeError, NotImplementedError, RuntimeError, ValueError) as error:
            raise ValueError(f"JAX's CUDA plugin cannot describe the GPU topology {name!r}: "
                             f"{one_line(error, limit=300)} {noise.text()[-300:]}") from None
    return list(topology.devices)


def cudnn_present() -> bool:
    """Whether cuDNN's library is here (its pip package, or one the system's loader finds)."""
    return _findable("nvidia.cudnn") or ctypes.util.find_library("cudnn") is not None


def attention_without_cudnn(config, name: str) -> str | None:
    """Without cuDNN's library here, a config whose kernel needs a GPU's own library (cuDNN's,
    which 'auto' picks on a GPU computing in 16 bits) cannot compile: for 'auto', the config's
    kernel becomes the first the GPU prefers that compiles anywhere (XLA's) and the note that says
    so is returned; a kernel asked for by name is a ConfigError. None where nothing changes."""
    from jaxgpt.attention.kernels import AUTO, KERNELS, PREFERENCE
    from jaxgpt.train.opening import compute_config

    if cudnn_present() or KERNELS[compute_config(config, "gpu").kernel].backend is None:
        return None
    if config.compute.kernel != AUTO:
        raise ConfigError(f"compute.kernel={config.compute.kernel} compiles for {name} only with cuDNN's library "
                          f"here: {CUDNN_INSTALL} (716 MB), or let compute.kernel=auto pick XLA's")
    for kernel in (k for k in PREFERENCE["gpu"] if KERNELS[k].backend is None):
        config.compute.kernel = kernel
        try:
            compute_config(config, "gpu")
        except ConfigError:
            continue
        return (f"attention: {kernel}, not the cuDNN kernel a GPU runs, which needs cuDNN's library to compile "
                f"({CUDNN_INSTALL}); {kernel} holds each layer's (T, T) scores, so its memory is likely above cuDNN's")
    raise AssertionError("XLA's and the blocked kernel compile anywhere")


def compiler_notes(lines: list[str]) -> list[str]:
    """The report's notes from what the GPU compiler wrote to standard error (kept out of sight
    while compiling): each message once, its continuation lines joined to it, as 'XLA: …' (e.g.
    a sort compiled without the device's CUB data, slower on the GPU than what it would compile
    there). The CUDA driver stub's complaints of no GPU are left out."""
    messages: list[str] = []
    for line in lines:
        if _ABSL_LINE.match(line) or any(noise in line for noise in _STUB_NOISE) or not messages:
            messages.append(_ABSL_LINE.sub("", line))
        else:  # a message's next line
            messages[-1] += " " + line
    notes = []
    for message in (" ".join(m.split()) for m in messages):
        if message and not any(noise in message for noise in _STUB_NOISE) and f"XLA: {message}" not in notes:
            notes.append(f"XLA: {message}")
    return notes
