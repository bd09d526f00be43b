"""Multi-token prediction, an auxiliary loss (train.mtp_tokens = K > 1): each position's logits
also predict the tokens 2 … K ahead, from the same softmax (modded-nanogpt's form), with
weights that decay to 0 over a fraction of the run:

    L = (1/N) Σ_i Σ_{k=1..K} w_k(s) · m_{i,k} · (−log softmax(z_i)[y_{i+k−1}])

y_j is input j's next token, so y_{i+k−1} is the token k ahead of input i; m_{i,k} = m_{i+k−1}
(its mask) where i + k − 1 < T and s_{i+k−1} = s_i (the same example of a packed row), else 0:
nothing is predicted past the row or across an example's end. N is the count of next-token
targets (Σ_i m_i), w_1 = 1, so k = 1 is the plain next-token loss, which evaluation reports.

    targets_ahead(targets, mask, segments, weights)   (Y, M) (B, T, K) for ops.cross_entropy
    weights_at(step, K, weight, until)                (w_1 … w_K) at a step
"""

from __future__ import annotations

import jax.numpy as jnp


def targets_ahead(targets, mask, segments, weights):
    """(Y (B, T, K), M (B, T, K)): Y_ik = y_{i+k−1} (0 past the row), M_ik = w_k·m_{i+k−1}·[i+k−1 < T]·
    [s_{i+k−1} = s_i], for targets (B, T), mask (B, T) or None (all), segments (B, T) or None (one
    sequence a row) and weights (K,) the w_k."""
    K, (B, T) = weights.shape[0], targets.shape

    def ahead(rows, fill):  # (B, T) → (B, T, K): column k−1 holds rows[:, i + k − 1], fill past T
        padded = jnp.pad(rows, ((0, 0), (0, K - 1)), constant_values=fill)
        return jnp.stack([padded[:, k:k + T] for k in range(K)], axis=-1)

    mask = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)
    valid = ahead(mask, False)
    if segments is not None:
        valid = valid & (ahead(segments, -1) == segments[..., None])
    return ahead(targets, 0), valid * weights.astype(jnp.float32)


def weights_at(step, tokens: int, weight: float, until: float):
    """(w_1 … w_K) at `step`: w_1 = 1 and w_k = weight^(k−1)·max(0, 1 − step/until) for k ≥ 2, so the
    auxiliary targets fade linearly to nothing at step `until` (K = tokens)."""
    fade = jnp.maximum(0.0, 1.0 - jnp.asarray(step, jnp.float32) / until)
    k = jnp.arange(tokens, dtype=jnp.float32)
    return jnp.where(k == 0, 1.0, weight ** k * fade)
