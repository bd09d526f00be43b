"""Weight-only int8 quantisation: the numbers and the layers that read them (compute.weights="int8").

    q, s = quantize(W)      W (*out, *in) → int8 q (*out, *in) and a float32 scale s (*out) per
                            output channel: W ≈ dequantize(q, s) = q·s
    int8_linear(x, q, s)    y = x Wᵀ with W = q·s, the product reading the int8 bytes
    Dense                   y = x W + b as one 2-D product: the frame model.Linear and Int8Linear share
    Int8Linear              model.Linear's y = x W + b, W read as kernel_q and kernel_scale
    Int8Embed               the token embedding E ≈ q·s row by row, and the tied unembedding x Eᵀ

A matrix is kept outputs first, W (*out, *in), as the token embedding E (V, d) already is for
the unembedding: each output channel o is one contiguous row W_o. The layers take the model's
arguments, so the model picks one or the other by compute.weights alone; their params come from
jaxgpt.quantize.params_for, not from their init (zeros, and scales of 1).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxgpt import layout
from jaxgpt.axes import rows_split
from jaxgpt.model_config import ComputeConfig, GPTConfig
from jaxgpt.platforms import forms

INT8_MAX = 127


def quantize(w, n_in: int = 1):
    """Symmetric per-output-channel int8 quantisation of W (*out, *in), its last n_in axes the
    inputs: s_o = max_i |W_oi| / 127 (1 for an all-zero channel), q_oi = round(W_oi / s_o) ∈
    [−127, 127]. Returns (q int8 (*out, *in), s float32 (*out)): |q_oi·s_o − W_oi| ≤ s_o/2."""
    w32 = w.astype(jnp.float32)
    inputs = tuple(range(w.ndim - n_in, w.ndim))
    peak = jnp.max(jnp.abs(w32), axis=inputs)
    scale = jnp.where(peak > 0, peak / INT8_MAX, 1.0)
    q = jnp.round(w32 / scale.reshape(*scale.shape, *(1,) * n_in))
    return jnp.clip(q, -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def dequantize(q, scale):
    """W_oi ≈ q_oi · s_o for q (*out, *in) and s (*out), in float32."""
    return q.astype(jnp.float32) * scale.reshape(*scale.shape, *(1,) * (q.ndim - scale.ndim)).astype(jnp.float32)


def int8_linear(x, q, scale, form: str = forms.AUTO):
    """y = x Wᵀ with W = dequantize(q, s), for x (N, n), q (m, n), s (m,): y_o = s_o Σ_i x_i q_oi,
    'Nn,mn->Nm', accumulated in float32 and returned in x's dtype. The product x qᵀ reads the
    int8 bytes in compute.matmul's `form` (forms.int8_product: a chunk of rows at a time on a CPU)."""
    y = forms.int8_product(x, q, form)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


class Dense(nn.Module):
    """y = x W + b for x (..., *in) and W (*in, *features), the input dims the last `n_in` axes of
    x, computed as one 2-D product: the frame that model.Linear (float W) and Int8Linear (int8 W)
    share. A subclass makes `weights` (W as its `product` takes it, and b) and gives `product`.
    `axes` names W's dimensions (jaxgpt.layout: inputs first, then outputs); b is named by the
    output ones, and by `norm` for a vector of width d_model."""

    features: tuple
    axes: tuple  # logical names of W's dimensions: n_in inputs, then one per feature
    cfg: GPTConfig
    compute: ComputeConfig
    group: str = "matrix"  # jaxgpt.layout.GROUPS: 'head' for the unembedding
    n_in: int = 1
    use_bias: bool = True
    residual: bool = False  # writes into the residual stream
    zero_init: bool = False  # W starts at zero

    def bias(self, out_shape: tuple):
        """b (out_shape), in param_dtype, zero at first."""
        out_axes = self.axes[self.n_in:]
        bias_axes = ("norm",) if out_axes == ("embed",) else out_axes
        declared = layout.declare(nn.initializers.zeros, bias_axes)
        return self.param("bias", declared, out_shape, self.compute.params_dtype)

    def __call__(self, x):
        in_shape, batch = x.shape[x.ndim - self.n_in:], x.shape[: x.ndim - self.n_in]
        x2 = x.reshape(*batch, math.prod(in_shape)).astype(self.compute.compute_dtype)
        w = self.weights(in_shape)
        y = self.product(w, x2, self.compute).reshape(*batch, *self.features)
        if self.use_bias:
            y = y + w["bias"].astype(y.dtype)
        return rows_split(y)


class Int8Linear(Dense):
    """y = x W + b as model.Linear computes it, with W read as kernel_q (output dims…, input
    dims…) int8 and kernel_scale (output dims…): W ≈ dequantize(kernel_q, kernel_scale)ᵀ
    (int8_linear). b stays in param_dtype. Its fields are Dense's (residual and zero_init only
    say how a float W is drawn): the model makes either with the same arguments."""

    @staticmethod
    def product(w: dict, x, compute: ComputeConfig):
        """y = x W for x (..., n) in x's dtype, W int8 with a scale per output channel as `weights`
        give it ({'kernel_q'} (m, n), {'kernel_scale'} (m,)): int8_linear in compute.matmul's form."""
        rows = int8_linear(x.reshape(-1, x.shape[-1]), w["kernel_q"], w["kernel_scale"], compute.matmul)
        return rows.reshape(*x.shape[:-1], -1)

    @nn.compact
    def weights(self, in_shape: tuple) -> dict:
        """W as `product` takes it (q (m, n) and s (m,)) and b ('bias'), made here the first time."""
        out_shape = tuple(self.features)
        in_axes, out_axes = self.axes[:self.n_in], self.axes[self.n_in:]
        q = self.param("kernel_q", layout.declare(nn.initializers.zeros, (*out_axes, *in_axes), group=self.group),
                       (*out_shape, *in_shape), jnp.int8)
        scale = self.param("kernel_scale", layout.declare(nn.initializers.ones, out_axes), out_shape, jnp.float32)
        w = {"kernel_q": q.reshape(scale.size, -1), "kernel_scale": scale.reshape(-1)}
        if self.use_bias:
            w["bias"] = self.bias(out_shape)
        return w


class Int8Embed(nn.Module):
    """The token embedding with compute.weights="int8": E ≈ q·s row by row (quantize, q (V, d)
    int8, s (V,)), so E[x] = q[x]·s[x], and the tied unembedding x Eᵀ is int8_linear(x, q, s)
    (E's rows are W_U's output channels). Params embedding_q and embedding_scale."""

    num_embeddings: int
    features: int
    dtype: Any

    def setup(self):
        shape = (self.num_embeddings, self.features)
        self.embedding_q = self.param("embedding_q", layout.declare(nn.initializers.zeros, ("vocab", "embed"),
                                                                    group="embed"), shape, jnp.int8)
        self.embedding_scale = self.param("embedding_scale", layout.declare(nn.initializers.ones, ("vocab",)),
                                          shape[:1], jnp.float32)

    def __call__(self, tokens):
        rows = dequantize(jnp.take(self.embedding_q, tokens, axis=0), jnp.take(self.embedding_scale, tokens))
        return rows.astype(self.dtype)

    def unembedding(self) -> dict:
        """The tied unembedding's weights W_U = Eᵀ as `product` takes them."""
        return {"kernel_q": self.embedding_q, "kernel_scale": self.embedding_scale}
