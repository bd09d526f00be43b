"""The names a config may take, read from the registries where their entries are defined, and
each config checked against them where it is opened.

The schema (jaxgpt.model_config, jaxgpt.config) names no implementation: it checks types, ranges
and how settings combine. A name is valid when the registry of its entries holds it, so a new
entry there is valid everywhere at once:

    model.positions        jaxgpt.positions.SCHEMES        (each Scheme checks the shapes it serves)
    model.attention        jaxgpt.attention.FORMS          (each Form checks its keys: local's window)
    model.activation       jaxgpt.ops.ACTIVATIONS          (GATED_ACTIVATIONS halve their input)
    model.linear_feature   jaxgpt.ops.FEATURE_MAPS
    compute.kernel         jaxgpt.attention.KERNELS        (and 'auto': kernels.for_platform)
    compute.matmul, .rope  jaxgpt.platforms.forms.MATMULS, ROPES   (and 'auto': chosen when lowered)

Opened here: check_model (GPT checks its own config when it is made, and a run's opening before
that), check_compute, and a kernel against the devices and the model (check_kernel, compute_on),
before anything compiles. The train section's names (train.optimizer, train.schedule,
train.muon_coeffs) are the optimizer's registries, checked where they are defined: jaxgpt.optim.open_train.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from jaxgpt import ops
from jaxgpt.attention import FORMS, KERNELS
from jaxgpt.attention.kernels import AUTO, DEVICES, for_platform
from jaxgpt.model_config import ComputeConfig, GPTConfig, check_choice
from jaxgpt.platforms import forms
from jaxgpt.positions import SCHEMES

# what each ability of a kernel (jaxgpt.attention.kernels.Kernel) lets it do, as a refusal says it is missing
ABILITIES = {"dropout": "apply attention dropout", "bias": "add a bias to the scores",
             "window": "keep to a sliding window", "segments": "keep packed examples apart (segments)"}


@functools.lru_cache(maxsize=256)
def check_model(cfg: GPTConfig) -> GPTConfig:
    """cfg, when every name in it is in its registry and each scheme and form can serve its shapes;
    a one-line ValueError otherwise."""
    if cfg.attention in KERNELS:
        raise ValueError(f"GPTConfig.attention={cfg.attention!r} is a kernel, how softmax attention runs: set "
                         f"compute.kernel={cfg.attention!r} (and attention='softmax', the default)")
    for name, valid in (("positions", SCHEMES), ("activation", ops.ACTIVATIONS), ("attention", FORMS),
                        ("linear_feature", ops.FEATURE_MAPS)):
        check_choice("GPTConfig", name, getattr(cfg, name), valid)
    scheme, form = SCHEMES[cfg.positions], FORMS[cfg.attention]
    scheme.check(cfg)
    form.check(cfg)
    if scheme.asks and not form.has_weights:
        plain = " or ".join(repr(name) for name, other in SCHEMES.items() if not other.asks)
        raise ValueError(f"GPTConfig.attention={cfg.attention!r} with positions={cfg.positions!r}: the scheme "
                         f"asks softmax scores for a {' and a '.join(scheme.asks)}, and this form forms none; use "
                         f"positions={plain}")
    check_key_offset_and_pairs(cfg)
    defaults = {field.name: field.default for field in dataclasses.fields(cfg)}
    for name, other in FORMS.items():
        for key in other.keys:
            if name != cfg.attention and defaults[key] is None and getattr(cfg, key) is not None:
                raise ValueError(f"GPTConfig.{key}={getattr(cfg, key)!r} with attention={cfg.attention!r}: "
                                 f"only attention={name!r} reads it; leave it None or set attention={name!r}")
    if cfg.ffn_layers > 1 and cfg.activation in ops.GATED_ACTIVATIONS:
        raise ValueError(f"GPTConfig.ffn_layers={cfg.ffn_layers} with the gated activation "
                         f"{cfg.activation!r}: a deep FFN needs an ungated activation (gelu, relu, silu, …)")
    return cfg


def check_key_offset_and_pairs(cfg: GPTConfig) -> None:
    """The key offset and paired heads on a form that computes them (Form.offsets_keys, Form.pairs_heads),
    paired heads on a scheme that asks no bias of the scores; a one-line ValueError otherwise."""
    form, scheme = FORMS[cfg.attention], SCHEMES[cfg.positions]
    able = lambda ability: " or ".join(repr(n) for n, f in FORMS.items() if getattr(f, ability))  # noqa: E731
    if cfg.key_offset and not form.offsets_keys:
        raise ValueError(f"GPTConfig.key_offset=True with attention={cfg.attention!r}: its keys are not kept one by "
                         f"one to take a half from the one before; use attention={able('offsets_keys')}")
    if cfg.paired_heads and not form.pairs_heads:
        raise ValueError(f"GPTConfig.paired_heads={cfg.paired_heads!r} with attention={cfg.attention!r}: paired heads "
                         f"are one causal softmax over 2T places, no window; use attention={able('pairs_heads')} (or "
                         "paired_heads=())")
    if cfg.paired_heads and scheme.asks:
        raise ValueError(f"GPTConfig.paired_heads={cfg.paired_heads!r} with positions={cfg.positions!r}: its bias is "
                         "each head's by distance, and paired heads share one sequence of 2T places; use "
                         "positions='rope' (or learned, sinusoidal, none)")


def open_model(values: Mapping[str, Any]) -> GPTConfig:
    """The GPTConfig of a model section (a config's, or a saved run's), checked (check_model)."""
    return check_model(GPTConfig.from_dict(dict(values)))


def check_compute(compute: ComputeConfig) -> ComputeConfig:
    """compute, when its kernel is one of KERNELS or 'auto' and its matmul and rope name a form of
    jaxgpt.platforms.forms (MATMULS, ROPES) or 'auto'; a one-line ValueError otherwise."""
    check_choice("ComputeConfig", "kernel", compute.kernel, (*KERNELS, AUTO))
    check_choice("ComputeConfig", "matmul", compute.matmul, (*forms.MATMULS, forms.AUTO))
    check_choice("ComputeConfig", "rope", compute.rope, (*forms.ROPES, forms.AUTO))
    return compute


def open_compute(values: Mapping[str, Any]) -> ComputeConfig:
    """The ComputeConfig of a compute section, checked (check_compute)."""
    return check_compute(ComputeConfig.from_dict(dict(values)))


# --- a kernel on the devices -------------------------------------------------------------------


def needs(cfg: GPTConfig, *, training: bool = False, packed: bool = False) -> dict[str, str]:
    """What computing `cfg` asks of a softmax kernel: {ability of a Kernel: the setting that
    asks it}. Attention dropout in training (model.dropout > 0), the form's and the positional
    scheme's asks (a window, a bias), segments for packed rows; nothing of a form that forms
    no softmax (it never calls the kernel)."""
    form = FORMS[check_model(cfg).attention]
    if not form.has_weights:
        return {}
    asked = {need: f"model.attention={cfg.attention!r}" for need in form.asks}
    asked.update({need: f"model.positions={cfg.positions!r}" for need in SCHEMES[cfg.positions].asks})
    if training and cfg.dropout > 0:
        asked["dropout"] = f"model.dropout={cfg.dropout}"
    if packed:
        asked["segments"] = "packed records (data.format='records')"
    return asked


def compute_on(compute: ComputeConfig, platform: str, cfg: GPTConfig | None = None, *, training: bool = False,
               packed: bool = False) -> ComputeConfig:
    """compute for devices of `platform` ('cpu', 'gpu', 'tpu'): kernel 'auto' becomes that
    platform's kernel (kernels.for_platform) among those that can compute `cfg` as asked
    (needs: in training, attention dropout; packed rows' segments); otherwise compute itself."""
    if check_compute(compute).kernel != AUTO:
        return compute
    asked = () if cfg is None else needs(cfg, training=training, packed=packed)
    return compute.replace(kernel=for_platform(platform, compute.dtype, asked))


def check_kernel(kernel: str, cfg: GPTConfig | None, platform: str, *, dtype="float32", training: bool = False,
                 packed: bool = False, flag: str = "--config.compute.kernel") -> str:
    """The kernel that computes `cfg` on devices of `platform` in `dtype` (`kernel`, or for
    'auto' the one for_platform picks); a one-line ValueError naming `flag` and the kernels
    that can when `kernel` is unknown, needs another backend or dtype, or cannot do what cfg asks
    (`needs`; cfg None: the model is not known yet, only the devices are checked). Every
    command checks a kernel here, before anything compiles."""
    if kernel != AUTO and kernel not in KERNELS:
        raise ValueError(f"{flag}={kernel!r}: must be one of {', '.join((*KERNELS, AUTO))}")
    asked = {} if cfg is None else needs(cfg, training=training, packed=packed)
    if kernel == AUTO:
        return for_platform(platform, dtype, asked)
    record = KERNELS[kernel]
    able = " or ".join(name for name, other in KERNELS.items() if other.runs(platform, dtype) and other.can(asked))
    if record.backend not in (None, platform):
        raise ValueError(f"{flag}={kernel} needs {DEVICES.get(record.backend, record.backend)}, but the devices are "
                         f"{platform}: use {able} (the model computes the same)")
    if not record.runs(platform, dtype):
        dtypes = " or ".join(record.dtypes)
        raise ValueError(f"{flag}={kernel} computes in {dtypes} only, not {jnp.dtype(dtype).name}: use {able} (the "
                         f"model computes the same), or compute in {dtypes}")
    for need, setting in asked.items():
        if not getattr(record, need):
            also = ", or model.dropout=0" if need == "dropout" else ""
            raise ValueError(f"{flag}={kernel} does not {ABILITIES[need]} ({setting}): use {able}{also}")
    return kernel
