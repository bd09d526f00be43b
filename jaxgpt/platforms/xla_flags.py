"""Named sets of XLA's flags (the run setting `xla_flags`): what a run adds to XLA_FLAGS before
JAX's backend starts, where XLA reads them once a process.

    PRESETS                      name → the flags it sets; 'default' sets none
    flags_for(name)              a preset's flags, or a one-line ConfigError naming the presets
    use_xla_flags(name)          add them to XLA_FLAGS (those the user's own XLA_FLAGS name stay the user's)

Each preset is a choice from NVIDIA JAX-Toolbox's GPU performance guide, measured on one H100 80GB
with GPT-2 small (docs/SCALE.md, "XLA's flags"). None made it train or sample faster, so every
preset config runs with 'default' (XLA's own choices); the others are there for what they trade:
cuDNN's LayerNorm keeps 1.1 GiB less of the step's memory for 0.5% of its speed. XLA only knows
its GPU flags by name (a CPU or TPU process ignores them); a flag an installed XLA does not know
ends the process, so tests/test_xla_flags.py starts JAX with every preset's flags.
"""

from __future__ import annotations

import os

from jaxgpt.errors import ConfigError

PRESETS: dict[str, tuple[str, ...]] = {
    "default": (),
    # cuBLAS's GEMMs instead of XLA's Triton ones: the train step 0.5–1.2% slower, sampling at batch 1 19% slower
    "cublas": ("--xla_gpu_enable_triton_gemm=false",),
    # cuBLASLt's GEMMs (their epilogues fuse bias and GELU): the train step 2.2% slower
    "cublaslt": ("--xla_gpu_enable_cublaslt=true",),
    # cuDNN's LayerNorm kernels: the train step 0.5% slower, 1.1 GiB less memory (25.99 GiB against 27.12)
    "cudnn_norms": ("--xla_gpu_enable_cudnn_layer_norm=true",),
}


def flags_for(name: str) -> tuple[str, ...]:
    """The flags of preset `name`; an unknown name is a one-line ConfigError."""
    if name not in PRESETS:
        raise ConfigError(f"xla_flags={name!r} is no flag preset: use one of {', '.join(PRESETS)} "
                          "(jaxgpt/platforms/xla_flags.py), or set XLA_FLAGS yourself")
    return PRESETS[name]


def flag_name(flag: str) -> str:
    """--xla_gpu_x=value → --xla_gpu_x."""
    return flag.split("=", 1)[0]


def use_xla_flags(name: str, environ=os.environ) -> str:
    """Add preset `name`'s flags to environ's XLA_FLAGS, before JAX's backend starts (after, they
    would not take effect: start_jax calls this first). A flag the user's XLA_FLAGS already names
    keeps the user's value. Returns XLA_FLAGS as set; the programs this process keeps are told
    (jaxgpt.platforms.STARTED_WITH), since the flags change what XLA compiles."""
    from jaxgpt import platforms

    own = environ.get("XLA_FLAGS", "").split()
    added = [flag for flag in flags_for(name) if flag_name(flag) not in {flag_name(f) for f in own}]
    if added:
        environ["XLA_FLAGS"] = " ".join([*own, *added])
        if environ is os.environ:
            platforms.STARTED_WITH["XLA_FLAGS"] = environ["XLA_FLAGS"]
    return environ.get("XLA_FLAGS", "")
