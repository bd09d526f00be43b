"""The softmax attention kernels: one function each, all computing the same
softmax(QKᵀ/√D + bias + M) V (a compute setting, config.compute.kernel; never the model's
identity). A kernel takes q (B,T,H,D), k and v (B,S,H_kv,D), the Where that makes the mask M,
bias_of(where) → the bias on the scores (ALiBi) or None, and on_weights(weights, whole) →
the weights to use (attention dropout, and a record of the whole map for pictures; only the
kernels that form the weights call it). It returns the context (B,T,H,D).

KERNELS maps each name to a Kernel: the function and what it can do (the backend it needs,
attention dropout, a bias, a window, segments, its dtypes). jaxgpt.registries.check_kernel asks
the record whether a kernel can compute a model; 'auto' picks one that can (for_platform)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxgpt import axes, ops
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
        """jax.nn.dot_product_attention (grouped heads as they are; it never forms the weights, so
        no attention dropout). A mask causal by index is asked for as such (is_causal), which
        cuDNN's kernel computes without the blocks above the diagonal and without reading a mask:
        GPT-2 small's step on an H100 took 1,111 ms instead of 1,263 (docs/SCALE.md, "Measured on GPUs").
        Any other mask (a cache, segments, a window) is given whole."""
        bias = bias_of(where)
        bias = None if bias is None else bias.astype(q.dtype)
        if where.causal_by_index():
            return jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True, implementation=implementation)
        return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=where.mask(), implementation=implementation)

    library.__name__ = implementation
    return library


xla = _library("xla")
cudnn = _library("cudnn")  # a CUDA GPU only (the run says so on another backend)


def flash(q, k, v, where: Where, bias_of: Callable, on_weights: Callable):
    """Flash attention on a TPU (Pallas's kernel, jax.experimental.pallas.ops.tpu): blocks of
    queries against blocks of keys with a running softmax, so the (T, S) weights never reach
    HBM, and the blocks above the causal diagonal are skipped. When the keys are the
    queries' own tokens (training, evaluation, a prompt); otherwise (a cache, a window) xla.

    Its mask is causal by index within each segment: the same mask as Where's, since a row's
    positions count up by one within each example (jaxgpt.data.packing). A TPU only (the run
    says so on another backend); no attention dropout. Under a mesh (jax.set_mesh) each
    device runs it on its rows and heads (jax.shard_map): XLA cannot split a kernel call."""
    if not where.keys_are_queries() or where.window is not None:
        return xla(q, k, v, where, bias_of, on_weights)
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas

    B, T, H, D = q.shape
    k, v = ops.share_kv_heads(k, H), ops.share_kv_heads(v, H)
    bias = bias_of(where)
    bias = None if bias is None else jnp.broadcast_to(bias, (B, H, T, T)).astype(jnp.float32)
    segments = where.q_segments

    def attend(q, k, v, bias, segments):  # q, k, v (B, H, T, D) on one device
        ids = None if segments is None else pallas.SegmentIds(segments, segments)
        if bias is None:  # the kernel scales the scores: no pass over q
            return pallas.flash_attention(q, k, v, None, ids, causal=True, sm_scale=D ** -0.5)
        # it adds the bias before it scales the scores: the queries come scaled instead
        return pallas.flash_attention(q * D ** -0.5, k, v, bias, ids, causal=True, sm_scale=1.0)

    heads = lambda x: x.swapaxes(1, 2)  # noqa: E731 - (B, T, H, D) ↔ (B, H, T, D)
    mesh = axes.current_mesh()
    if mesh is not None:
        rows = axes.BATCH_AXES if B % axes.batch_ways(mesh) == 0 else None
        split = "tensor" if H % mesh.shape["tensor"] == 0 else None
        four, two = P(rows, split, None, None), P(rows, None)
        attend = jax.shard_map(attend, mesh=mesh, in_specs=(four, four, four, None if bias is None else four,
                                                            None if segments is None else two),
                               out_specs=four, check_vma=False)
    return heads(attend(heads(q), heads(k), heads(v), bias, segments))


def paired(kernel: Callable) -> Callable:
    """`kernel` over paired heads (model.paired_heads): heads 2j and 2j+1 interleaved into one sequence of
    2T places (ops.pair_heads; Where.paired: place 2t+i at position 2p_t + i), attended causally as any
    sequence, and the context de-interleaved, C = unpair(kernel(pair(Q), pair(K), pair(V))) (B,T,H,D). The
    weights on_weights sees are the pairs' (B, H/2, 2T, 2S)."""
    def attend(q, k, v, where: Where, bias_of: Callable, on_weights: Callable):
        pair = ops.pair_heads
        return ops.unpair_heads(kernel(pair(q), pair(k), pair(v), where.paired(), bias_of, on_weights))

    return attend


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A softmax kernel and what it can do: callers ask the record, never the name.

    fn(q, k, v, where, bias_of, on_weights) → context (the module docstring says how).
    backend: the platform it needs (jax.Device.platform: 'gpu', 'tpu'); None: any.
    dropout: it forms the weights and calls on_weights, so attention dropout applies.
    bias: it adds bias_of's bias to the scores (ALiBi's). window: it keeps to a Where's
    sliding window (attention='local'). segments: it keeps packed examples apart (a Where's
    segments). dtypes: the compute dtypes it computes in; None: any. fused: the (T, S) weights
    never reach memory (a fused kernel), so a train step keeps none of them per layer
    (jaxgpt.train.micro_batch.row_bytes)."""

    fn: Callable
    backend: str | None
    dropout: bool
    bias: bool
    window: bool
    segments: bool
    dtypes: tuple[str, ...] | None = None
    fused: bool = False

    def __call__(self, q, k, v, where: Where, bias_of: Callable, on_weights: Callable):
        return self.fn(q, k, v, where, bias_of, on_weights)

    def runs(self, platform: str, dtype) -> bool:
        """It runs on devices of `platform`, computing in `dtype`."""
        return self.backend in (None, platform) and (self.dtypes is None or jnp.dtype(dtype).name in self.dtypes)

    def can(self, needs) -> bool:
        """It does each of `needs` (names of its abilities: 'dropout', 'bias', 'window', 'segments')."""
        return all(getattr(self, need) for need in needs)


HALF = ("bfloat16", "float16")
KERNELS = {
    "explicit": Kernel(explicit, backend=None, dropout=True, bias=True, window=True, segments=True),
    "blocked": Kernel(blocked, backend=None, dropout=True, bias=True, window=True, segments=True),
    "xla": Kernel(xla, backend=None, dropout=False, bias=True, window=True, segments=True),
    "cudnn": Kernel(cudnn, backend="gpu", dropout=False, bias=True, window=True, segments=True, dtypes=HALF,
                    fused=True),
    "flash": Kernel(flash, backend="tpu", dropout=False, bias=True, window=True, segments=True, fused=True),
}
AUTO = "auto"  # a compute setting too: the kernel of the platform the program is compiled for (for_platform)
# the kernels 'auto' prefers on each platform, best first; explicit, which does everything, last
PREFERENCE = {"tpu": ("flash", "blocked"), "gpu": ("cudnn", "xla", "blocked")}
DEVICES = {"cpu": "a CPU", "gpu": "a CUDA GPU", "tpu": "a TPU"}  # how a message names a platform


def for_platform(platform: str, dtype, needs=()) -> str:
    """The kernel 'auto' stands for on a platform (jax.Device.platform) computing in `dtype`:
    the first of PREFERENCE that runs there and does every one of `needs` (registries.needs):
    flash on a TPU; cuDNN's on a GPU computing in 16 bits, else XLA's; with attention dropout
    in training, blocked on either (the fused kernels never form the weights); explicit on a
    CPU (the fastest there)."""
    for name in (*PREFERENCE.get(platform, ()), "explicit"):
        if KERNELS[name].runs(platform, dtype) and KERNELS[name].can(needs):
            return name
    raise AssertionError("the explicit kernel runs anywhere and does everything")
