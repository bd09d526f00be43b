"""Circuits: each attention head as a bilinear form that scores and a map that writes.

Row vectors, as the code computes them (x W): for head h of layer l, with W_Q^h, W_K^h, W_V^h
(d × d_head) the head's slices of the (embed, qkv, heads, head_dim) projection and W_O^h
(d_head × d) its slice of the (heads, head_dim, embed) one (found by their declared axes),

    W_QK^h = W_Q^h W_K^hᵀ   (d × d)   score(x_t, x_s) = x_t W_QK^h x_sᵀ / √d_head  (+ biases)
    W_OV^h = W_V^h W_O^h    (d × d)   what the head writes: Σ_s A[t, s] x_s W_OV^h

Both have rank ≤ d_head. Composition of head a (earlier layer) into head b, each a score
‖M‖_F / (‖first‖_F ‖second‖_F) ∈ [0, 1] of how much b reads what a writes (the layer norms
between them are left out, as is usual):

    Q-composition   M = W_OV^a W_QK^b     a's output on the query side of b
    K-composition   M = W_QK^b W_OV^aᵀ    a's output on the key side of b
    V-composition   M = W_OV^a W_OV^b     a's output in b's values

Token-level circuits (small vocabularies), with the token embedding W_E (V × d) and the
unembedding W_U (d × V): OV = W_E W_OV^h W_U (row i: the logits token i pushes up when
attended to), QK = W_E W_QK^h W_Eᵀ (how much token i as query attends to token j as key).
All in float64 NumPy.
"""

from __future__ import annotations

import numpy as np

from jaxgpt import layout
from jaxgpt.attention import FORMS
from jaxgpt.blocks import block_name, unstack_layers
from jaxgpt.config import GPTConfig
from jaxgpt.model import param_layout

KINDS = ("q", "k", "v")
MAX_TOKEN_VOCAB = 4096  # token-level circuits are V × V


def head_matrices(params, cfg: GPTConfig, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(W_QK, W_OV) of every head of `layer`, each (H, d, d)."""
    block, declared = unstack_layers(params)[block_name(layer)], param_layout(cfg)[block_name(layer)]
    if not FORMS[cfg.attention].has_weights:
        raise ValueError("circuits read softmax attention's bilinear score qᵀk; attention='linear' scores "
                         "φ(q)ᵀφ(k), which W_QK does not describe: analyse a model with softmax attention")
    if cfg.qk_norm:
        raise ValueError("circuits read the bilinear score qᵀk = x W_QK yᵀ; with qk_norm=True q and k are "
                         "normalised first, so W_QK does not describe the score: analyse a model without qk_norm")
    qkv = layout.find(block, declared, ("embed", "qkv", "heads", "head_dim"), "matrix")
    if not qkv:
        raise ValueError("circuits read per-head W_Q, W_K, W_V from one (d, 3, H, D) projection: a model with "
                         "n_kv_head < n_head (grouped-query attention) has none; analyse a model with "
                         "n_kv_head == n_head")
    qkv = np.asarray(qkv[0], np.float64)  # (d, 3, H, D)
    w_o = np.asarray(layout.find(block, declared, ("heads", "head_dim", "embed"), "matrix")[0], np.float64)  # (H, D, d)
    w_q, w_k, w_v = (np.moveaxis(qkv[:, i], 1, 0) for i in range(3))  # each (H, d, D)
    return w_q @ np.swapaxes(w_k, 1, 2), w_v @ w_o


def spectra(params, cfg: GPTConfig) -> dict[str, np.ndarray]:
    """Singular values of every head's W_QK and W_OV: {'qk', 'ov'} each (L, H, d_head), largest first."""
    out = {"qk": [], "ov": []}
    for layer in range(cfg.n_layer):
        qk, ov = head_matrices(params, cfg, layer)
        out["qk"].append(np.linalg.svd(qk, compute_uv=False)[:, : cfg.head_dim])
        out["ov"].append(np.linalg.svd(ov, compute_uv=False)[:, : cfg.head_dim])
    return {name: np.stack(values) for name, values in out.items()}


def rank(singular_values: np.ndarray, relative_tolerance: float = 1e-6) -> np.ndarray:
    """Numerical rank: singular values above relative_tolerance × the largest."""
    return (singular_values > relative_tolerance * singular_values[..., :1]).sum(axis=-1)


def top_k_fraction(singular_values: np.ndarray, k: int) -> np.ndarray:
    """The fraction of each matrix's energy Σσ² (its squared Frobenius norm) in its top k directions."""
    energy = singular_values**2
    return energy[..., :k].sum(axis=-1) / np.maximum(energy.sum(axis=-1), 1e-300)


def composition_score(first: np.ndarray, second: np.ndarray) -> float:
    """‖first · second‖_F / (‖first‖_F ‖second‖_F)."""
    return float(np.linalg.norm(first @ second) / max(np.linalg.norm(first) * np.linalg.norm(second), 1e-300))


def composition(params, cfg: GPTConfig) -> dict[str, np.ndarray]:
    """{'q', 'k', 'v'}: (L·H, L·H) arrays, entry [a, b] the composition of head a into head b
    (heads numbered layer·H + h; only earlier layers into later ones, NaN elsewhere)."""
    heads = [head_matrices(params, cfg, layer) for layer in range(cfg.n_layer)]
    n = cfg.n_layer * cfg.n_head
    scores = {kind: np.full((n, n), np.nan) for kind in KINDS}
    for la in range(cfg.n_layer):
        for lb in range(la + 1, cfg.n_layer):
            for ha in range(cfg.n_head):
                for hb in range(cfg.n_head):
                    ov_a, (qk_b, ov_b) = heads[la][1][ha], (heads[lb][0][hb], heads[lb][1][hb])
                    a, b = la * cfg.n_head + ha, lb * cfg.n_head + hb
                    scores["q"][a, b] = composition_score(ov_a, qk_b)
                    scores["k"][a, b] = composition_score(qk_b, ov_a.T)
                    scores["v"][a, b] = composition_score(ov_a, ov_b)
    return scores


def token_circuits(params, cfg: GPTConfig, layer: int, head: int) -> dict[str, np.ndarray]:
    """{'ov': W_E W_OV W_U, 'qk': W_E W_QK W_Eᵀ}, each (V, V), for one head."""
    if cfg.vocab_size > MAX_TOKEN_VOCAB:
        raise ValueError(f"token-level circuits are vocab_size² = {cfg.vocab_size}² large: they are for vocabularies "
                         f"of at most {MAX_TOKEN_VOCAB} tokens")
    qk, ov = head_matrices(params, cfg, layer)
    params, declared = unstack_layers(params), param_layout(cfg)
    w_e = np.asarray(layout.find(params, declared, ("vocab", "embed"), "embed")[0], np.float64)
    unembedding = layout.find(params, declared, ("embed", "vocab"), "head")  # none when tied: W_U = W_Eᵀ
    w_u = np.asarray(unembedding[0], np.float64) if unembedding else w_e.T
    return {"ov": w_e @ ov[head] @ w_u, "qk": w_e @ qk[head] @ w_e.T}


def top_copies(ov_circuit: np.ndarray, k: int = 5) -> np.ndarray:
    """For each token (row), the k tokens its OV circuit pushes up most: (V, k) ids."""
    return np.argsort(-ov_circuit, axis=1, kind="stable")[:, :k]
