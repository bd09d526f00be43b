"""The loss a chunk of tokens at a time (compute.loss_chunk): the unembedding's logits, the
cross-entropy and its gradient, or each target's log-probability, made `chunk` tokens at a time
so that no pass ever holds the logits of all the tokens.

    as_chunks, from_chunks     N rows ↔ (M, chunk) chunks, every M-th row (devices keep their rows)
    chunked_cross_entropy      L = (1/N) Σ_i m_i (log Σ_v exp z_i[v] − z_i[y_i]) and its custom gradient
    chunked_target_scores      (log p(y_i), [y_i is the argmax]) of each target, forward only
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxgpt.ops import target_logit, target_scores

# --- the loss a chunk of tokens at a time ----------------------------------------------------
# logits_fn(weights, h) → z: the logits (n, V), float32, of hidden states h (n, d) under the unembedding's
# weights (a pytree). Neither pass ever holds the (N, V) logits of all N tokens: only one chunk's.


def as_chunks(x, chunk: int, fill=0):
    """x (N, …) as (M, chunk, …), M = ⌈N/chunk⌉, padded with `fill` to M·chunk rows: chunk j
    holds the rows a·M + j (a = 0…chunk−1), every M-th row from the j-th. Rows split over
    devices in order stay so: each chunk takes chunk/devices rows of every device's share. A
    chunk of N rows or more is one chunk of the N, nothing padded (the whole logits at once)."""
    chunk = max(min(chunk, x.shape[0]), 1)
    M = -(-x.shape[0] // chunk)
    x = jnp.pad(x, [(0, M * chunk - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
    return x.reshape(chunk, M, *x.shape[1:]).swapaxes(0, 1)


def from_chunks(x, n: int):
    """The inverse of as_chunks: x (M, chunk, …) → its first n rows (n, …) in their order."""
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])[:n]


def chunked_target_scores(logits_fn, weights, hidden, targets, *, chunk: int):
    """target_scores of the logits z = logits_fn(weights, h) of hidden states (..., d), chunk
    tokens at a time: (log p(y_i), [y_i = argmax z_i]) of each target (...), forward only."""
    n, shape = targets.size, targets.shape
    h, y = as_chunks(hidden.reshape(n, -1), chunk), as_chunks(targets.reshape(n), chunk)
    scores = jax.lax.map(lambda c: target_scores(logits_fn(weights, c[0]), c[1]), (h, y))
    return tuple(from_chunks(s, n).reshape(shape) for s in scores)


def chunked_cross_entropy(logits_fn, weights, hidden, targets, mask=None, count=None, *, chunk: int):
    """cross_entropy(logits_fn(weights, hidden), targets, mask, count), the logits computed
    `chunk` tokens at a time (the tokens padded, unmasked, to a multiple of chunk), for K targets y_ik per token:

        L = (1/N) Σ_i Σ_k m_ik (log Σ_v exp z_i[v] − z_i[y_ik]),   z_i = logits_fn(weights, h_i)

    with the gradient ∂L/∂z_i = Σ_k (m_ik/N)(softmax(z_i) − e_{y_ik}) taken back to h_i and to the
    weights through logits_fn's own derivative, chunk by chunk (the weights' terms summed in
    float32). Under differentiation the gradient is computed in the forward pass, while each
    chunk's logits exist: the same matmuls as the whole logits' (no chunk's logits computed
    twice), and the backward pass only scales it by L's cotangent. hidden (..., d), targets and
    mask (...), or (..., K) with K targets per token (multi-token prediction; K = 1 without the axis)."""
    n = hidden.size // hidden.shape[-1]
    mask = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    count = mask.sum() if count is None else count
    return _chunked_loss(logits_fn, chunk, weights, hidden.reshape(n, -1), targets.reshape(n, -1),
                         mask.reshape(n, -1), jnp.maximum(count, 1.0).astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_loss(logits_fn, chunk, weights, hidden, targets, mask, count):
    """L of hidden (N, d), targets and mask (N, K) (chunked_cross_entropy), forward only."""
    def step(total, c):
        h, y, m = c
        z = logits_fn(weights, h)
        return total + (m * (jax.nn.logsumexp(z, axis=-1)[:, None] - target_logit(z[:, None], y))).sum(), None

    chunks = tuple(as_chunks(x, chunk) for x in (hidden, targets, mask))
    return jax.lax.scan(step, jnp.zeros((), jnp.float32), chunks)[0] / count


def _chunked_loss_forward(logits_fn, chunk, weights, hidden, targets, mask, count):
    """(L, (∂L/∂weights, ∂L/∂hidden)): each chunk's logits z, their gradient Σ_k (m_ik/N)(softmax(z_i) − e_{y_ik})
    and its pullback through logits_fn, in one pass."""
    def step(carry, c):
        total, grad_w = carry
        h, y, m = c
        z, pullback = jax.vjp(logits_fn, weights, h)
        lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
        hits = sum(jax.nn.one_hot(y[:, k], z.shape[-1], dtype=z.dtype) * m[:, k, None] for k in range(y.shape[1]))
        dz = jnp.exp(z - lse) * m.sum(axis=1, keepdims=True) - hits  # Σ_k m_ik (softmax(z_i) − e_{y_ik})
        dw, dh = pullback(dz)
        grad_w = jax.tree.map(lambda sum_w, part: sum_w + part.astype(jnp.float32), grad_w, dw)
        return (total + (m * (lse - target_logit(z[:, None], y))).sum(), grad_w), dh

    chunks = tuple(as_chunks(x, chunk) for x in (hidden, targets, mask / count))
    zeros = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), weights)
    (total, grad_w), grad_h = jax.lax.scan(step, (jnp.zeros((), jnp.float32), zeros), chunks)
    grad_w = jax.tree.map(lambda g, w: g.astype(w.dtype), grad_w, weights)
    return total, (grad_w, from_chunks(grad_h, hidden.shape[0]))


def _chunked_loss_backward(logits_fn, chunk, grads, cotangent):
    """The gradients of the forward pass times L's cotangent; none for the targets, mask and count."""
    scaled = jax.tree.map(lambda g: (cotangent * g).astype(g.dtype), grads)
    return *scaled, None, None, None


_chunked_loss.defvjp(_chunked_loss_forward, _chunked_loss_backward)
