"""The softmax attention kernels: one function each, all computing the same
softmax(QKᵀ/√D + bias + M) V (a compute setting, config.compute.kernel; never the model's
identity). A kernel takes q (B,T,H,D), k and v (B,S,H_kv,D), the Where that makes the mask M,
bias_of(where) → the bias on the scores (ALiBi) or None, and on_weights(weights, whole) →
the weights to use (attention dropout, and a record of the whole map for pictures; only the
kernels that form the weights call it). It returns the context (B,T,H,D)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxgpt import ops
from jaxgpt.attention.base import Where

BLOCK = 64  # query positions per block of the blocked kernel


def explicit(q, k, v, where: Where, bias_of: Callable, on_weights: Callable, whole: bool = True):
    """ops.attention, the weights (B,H,T,S) formed in full: A = softmax(QKᵀ/√D + bias + M); C = A V."""
    k, v = ops.share_kv_heads(k, q.shape[2]), ops.share_kv_heads(v, q.shape[2])
    weights = ops.attention_weights(q, k, where.mask(), bias_of(where))
    return ops.attend(on_weights(weights, whole), v)


def blocked(q, k, v, where: Where, bias_of: Callable, on_weights: Callable):
    """`explicit` in blocks of BLOCK queries when the keys are the queries' own tokens: the
    queries of block i see no key past the end of block i (the mask hides them), so each
    block's QKᵀ and AV skip those keys. Otherwise (a cache, or one block) explicit itself."""
    T = q.shape[1]
    if not where.keys_are_queries() or T <= BLOCK:
        return explicit(q, k, v, where, bias_of, on_weights)
    return jnp.concatenate([
        explicit(q[:, start:end], k[:, :end], v[:, :end], where.queries(start, end, end), bias_of, on_weights, False)
        for start in range(0, T, BLOCK) for end in [min(start + BLOCK, T)]
    ], axis=1)


def _library(implementation: str):
    def library(q, k, v, where: Where, bias_of: Callable, on_weights: Callable):
        """jax.nn.dot_product_attention (grouped heads as they are; no attention dropout)."""
        bias = bias_of(where)
        return jax.nn.dot_product_attention(q, k, v, bias=None if bias is None else bias.astype(q.dtype),
                                            mask=where.mask(), implementation=implementation)

    library.__name__ = implementation
    return library


xla = _library("xla")
cudnn = _library("cudnn")  # a CUDA GPU only (the run says so on another backend)

KERNELS = {"explicit": explicit, "blocked": blocked, "xla": xla, "cudnn": cudnn}
