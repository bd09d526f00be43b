"""What a token takes from the tokens before it: the smear and the bigram and trigram hash
embeddings (GPTConfig.smear, GPTConfig.bigram_table, GPTConfig.trigram_table), all added to the
token embedding e_t = E[x_t].

    previous_tokens(tokens, positions, segments, before)   (x_{t−1}, whether there is one) of each token
    two_before(previous, has, before)   (x_{t−2}, whether there are two) from previous_tokens' answer
    smear(e, e_before, has, w, λ)    e_t + λ·σ(w·e_t[:g])·e_{t−1}: a gated share of the token before
    bigram_hash(before, tokens, has, M)   h(x_{t−1}, x_t) ∈ 0…M−2, or M−1 with no token before
    trigram_hash(before2, before, tokens, has2, M)   h(x_{t−2}, x_{t−1}, x_t) ∈ 0…M−2, or M−1 with fewer than two
    PreviousToken                    the module: E[x] with each added, as cfg asks

The token before x_t is the one at position p_t − 1 of the same segment (the same example of a
packed row): the first token of a sequence or of a packed example has none, its second token
none two before. In a call with a cache (decoding), the first new tokens' predecessors come from
the cache (its `tokens_before`: the two tokens before the first new one), so decoding one token
at a time computes what one pass over the whole sequence does.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt import layout

SMEAR_INPUTS = 12  # g: the smear's gate reads the first g channels of e_t (modded-nanogpt's 12)
HASH_MULTIPLIERS = (36313, 27191)  # a, b of bigram_hash: odd, spread products over 32 bits
# a, b, c of trigram_hash: xxHash32's primes, odd (x ↦ a·x mod 2³² is one-to-one) and near 2³² with bits all
# over (a small id's product fills all 32 bits), one per place (so a permutation of the three hashes apart)
TRIGRAM_MULTIPLIERS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D)


def previous_tokens(tokens, positions, segments=None, before=None):
    """(x_{t−1} (B, T), has (B, T)) for tokens (B, T) at positions (B, T) (or (1, T)) of segments
    (B, T) or None: has_t = [p_{t−1} = p_t − 1 and s_{t−1} = s_t] inside the call; for t = 0,
    `before` = (token (B,), exists (B,)) from a cache, else no token before (x_{t−1} = 0)."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(positions, (B, T))
    first, exists = before if before is not None else (jnp.zeros((B,), tokens.dtype), jnp.zeros((B,), bool))
    inside = positions[:, :-1] == positions[:, 1:] - 1
    if segments is not None:
        inside = inside & (segments[:, :-1] == segments[:, 1:])
    return shifted(first, tokens), jnp.concatenate([exists[:, None], inside], axis=1)


def two_before(previous, has, before=None):
    """(x_{t−2} (B, T), has2 (B, T)) from previous_tokens' (x_{t−1}, has_t): has2_t = has_t ∧ has_{t−1}
    (x_{t−2} is the token before the token before); for t = 0, `before` = (token (B,), exists (B,)) is
    the one two before the first from a cache (exists: at position p_0 − 2 of its segment), else none."""
    B = previous.shape[0]
    first, exists = before if before is not None else (jnp.zeros((B,), previous.dtype), jnp.zeros((B,), bool))
    return shifted(first, previous), has & shifted(exists, has)


def shifted(first, rows):
    """(first, rows_0, …, rows_{T−2}) of each row: rows (B, T) one place later, first (B,) in front."""
    return jnp.concatenate([first[:, None].astype(rows.dtype), rows[:, :-1]], axis=1)


def smear(e, e_before, has, w, lam):
    """x_t = e_t + λ·σ(w·e_t[:g])·e_{t−1}·has_t: e, e_before (B, T, d), has (B, T), w (g,), λ ()."""
    gate = lam * jax.nn.sigmoid(e[..., :w.shape[0]] @ w)
    return e + (gate * has)[..., None] * e_before


def bigram_hash(before, tokens, has, table_size: int):
    """h_t = ((a·x_t) ⊕ (b·x_{t−1}) mod 2³²) mod (M − 1) where has_t, else M − 1 (a row of its own for
    a token with none before); products and ⊕ in uint32, (a, b) = HASH_MULTIPLIERS, M = table_size."""
    a, b = (jnp.uint32(m) for m in HASH_MULTIPLIERS)
    mixed = (tokens.astype(jnp.uint32) * a) ^ (before.astype(jnp.uint32) * b)
    return jnp.where(has, (mixed % jnp.uint32(table_size - 1)).astype(jnp.int32), table_size - 1)


def trigram_hash(before2, before, tokens, has2, table_size: int):
    """h_t = (m ⊕ (m ≫ 16)) mod (M − 1), m = (a·x_t) ⊕ (b·x_{t−1}) ⊕ (c·x_{t−2}) mod 2³², where has2_t, else
    M − 1 (a row of its own for a token with fewer than two before); in uint32, (a, b, c) = TRIGRAM_MULTIPLIERS.
    The fold m ≫ 16 brings the high bits, which every bit of each token moves, down to the low ones: the
    low k bits of a·x are those of x's low k bits alone, so without it M − 1 = 2^k would read only those."""
    a, b, c = (jnp.uint32(m) for m in TRIGRAM_MULTIPLIERS)
    mixed = (tokens.astype(jnp.uint32) * a) ^ (before.astype(jnp.uint32) * b) ^ (before2.astype(jnp.uint32) * c)
    mixed = mixed ^ (mixed >> jnp.uint32(16))
    return jnp.where(has2, (mixed % jnp.uint32(table_size - 1)).astype(jnp.int32), table_size - 1)


class PreviousToken(nn.Module):
    """e_t = E[x_t], then with cfg.smear the smear (params smear_gate (g,), smear_lambda (): zero at
    first, so the model starts without it), then with cfg.bigram_table = M the row B[h_t] of the
    bigram table (M, d) (zero at first) added, then with cfg.trigram_table = M' the row C[h'_t] of the
    trigram table (M', d) (zero at first). `token_table` gives E[x] of token ids."""

    cfg: object
    compute: object

    @nn.compact
    def __call__(self, token_table, tokens, positions, segments=None, cache=None):
        cfg, dtype = self.cfg, self.compute.params_dtype
        e = token_table(tokens)
        if not (cfg.smear or cfg.bigram_table or cfg.trigram_table):
            return e
        before = None if cache is None else cache.tokens_before(positions, segments)
        previous, has = previous_tokens(tokens, positions, segments, None if before is None else before[0])
        if cfg.smear:
            g = min(SMEAR_INPUTS, cfg.d_model)
            w = self.param("smear_gate", layout.declare(nn.initializers.zeros, ("gate",)), (g,), dtype)
            lam = self.param("smear_lambda", layout.declare(nn.initializers.zeros, ()), (), dtype)
            e = smear(e, token_table(previous), has, w.astype(e.dtype), lam.astype(e.dtype))
        if cfg.bigram_table:
            table = self.param("bigram", layout.declare(nn.initializers.zeros, ("bigrams", "embed"), group="embed"),
                               (cfg.bigram_table, cfg.d_model), dtype)
            e = e + jnp.take(table, bigram_hash(previous, tokens, has, cfg.bigram_table), axis=0).astype(e.dtype)
        if cfg.trigram_table:
            previous2, has2 = two_before(previous, has, None if before is None else before[1])
            table = self.param("trigram", layout.declare(nn.initializers.zeros, ("trigrams", "embed"), group="embed"),
                               (cfg.trigram_table, cfg.d_model), dtype)
            rows = trigram_hash(previous2, previous, tokens, has2, cfg.trigram_table)
            e = e + jnp.take(table, rows, axis=0).astype(e.dtype)
        return e
