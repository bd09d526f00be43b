"""Attention: the forms (the model's identity, config.model.attention), each in its own file
with its cache, and the softmax kernels (a compute setting, config.compute.kernel).

    FORMS[cfg.attention].attend(cfg, kernel, q, k, v, where, layer_cache, bias_of, on_weights)
    KERNELS[compute.kernel](q, k, v, where, bias_of, on_weights)
    kernels.paired(kernel)                            a kernel over paired heads (model.paired_heads)
    check_window(cfg, window, cache)                  a training window (GPT's `window`), if it can apply
    init_cache(cfg, batch_size, max_length, dtype)    the form's empty cache, for decoding

A new form is a file with a Form (base.py says what it implements) and a line in FORMS; a
new kernel is a function in kernels.py and its Kernel record in KERNELS. Forms, positional
schemes and kernels declare what they ask and what they can do (Form.asks, Scheme.asks,
Kernel's abilities): callers ask the records, never the names
(jaxgpt.registries.check_kernel: whether a kernel can compute a model here).
"""

from __future__ import annotations

from jaxgpt.attention import linear, local, softmax
from jaxgpt.attention.base import Form, Where
from jaxgpt.attention.kernels import KERNELS, Kernel
from jaxgpt.attention.linear import LinearCache
from jaxgpt.attention.local import RingCache
from jaxgpt.attention.softmax import KVCache

FORMS: dict[str, Form] = {"softmax": softmax.FORM, "linear": linear.FORM, "local": local.FORM}

__all__ = ["FORMS", "KERNELS", "Form", "KVCache", "Kernel", "LinearCache", "RingCache", "Where", "check_window",
           "init_cache", "window_conflict"]


def init_cache(cfg, batch_size: int, max_length: int | None = None, dtype=None):
    """An empty cache of cfg's attention form for `batch_size` rows of up to `max_length`
    (default block_size) positions, keys and values in `dtype` (default float32)."""
    return FORMS[cfg.attention].init_cache(cfg, batch_size, max_length, "float32" if dtype is None else dtype)


def window_conflict(cfg) -> str | None:
    """Why a training window cannot apply to this model (None: it can): a form that does not narrow
    (the local form has its own window, the linear form no scores to mask), or paired heads, whose
    places are not positions."""
    if not FORMS[cfg.attention].narrows:
        able = " or ".join(repr(name) for name, form in FORMS.items() if form.narrows)
        return f"model.attention={cfg.attention!r} takes no training window (the forms that do: {able})"
    if cfg.paired_heads:
        return f"model.paired_heads={cfg.paired_heads!r} interleaves two heads' places, which no window counts"
    return None


def check_window(cfg, window, cache) -> int:
    """`window` if a training window can apply (a positive integer, no cache, window_conflict None)."""
    conflict = window_conflict(cfg) or (None if cache is None else "a cache reads past tokens whole")
    if conflict or not (isinstance(window, int) and window > 0):
        raise ValueError(f"window={window!r}: {conflict or 'must be a positive integer'}")
    return window
