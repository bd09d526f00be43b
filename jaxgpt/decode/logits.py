"""Decoding: what sampling (`jaxgpt.decode.sampling`) and beam search (`jaxgpt.decode.beam`) both need,
the model's next-token logits for a batch of growing sequences and the prompts as a padded
batch.

The model reads crop(x), the last block_size tokens of x, at positions 0 … block_size−1:
it never sees more, and a sequence longer than the context continues exactly as
recomputing the cropped context for every token would (nanoGPT's sample.py).

What a new token costs:

- While the sequence fits in the context (n ≤ block_size): one position through the model.
  The prompts are prefilled in one parallel pass, then each step feeds only the newest
  token, whose keys and values join the cache; attention reads the cached ones.
- Past the context (n > block_size): one parallel pass over the block_size tokens of the
  window, for every `positions` option, because cropping changes every hidden state of the
  window. With learned or sinusoidal positions every token moves to a new position, so even
  the first layer's keys change. With rope the first layer's keys could be re-rotated and
  with alibi or none they do not change at all (scores depend on distances only), but from
  the second layer on every key and value is a function of all the tokens before it in the
  window, and the window has just lost its first token. A rolling cache that keeps the old
  keys would be cheaper, but it is a different model (its keys still carry the dropped
  token), so it is not used. The pass costs about block_size cached steps of arithmetic,
  done as one batch of matrix products. It also refills the cache, so that once the rows
  past the context have stopped, the others go on from the cache.
- When generation can go past the context at all (prompt bucket + max_new_tokens >
  block_size), that window pass is also the prefill: one compiled pass fewer, for a first
  token that costs what each token past the context costs.

With attention='linear' the cache is the recurrent state (S, z) of every layer, the same
size at any length, and nothing is cropped: the model reads the whole sequence, and every
new token costs one position, before the context's end and past it. Past it needs
positions that exist there: 'rope' or 'none' (learned and sinusoidal tables end at
block_size; that is refused). The padded prompts are prefilled in one parallel pass that
absorbs each row's tokens before its last (LinearCache.limit); each step then absorbs the
newest token.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.attention import FORMS, init_cache
from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT
from jaxgpt.positions import SCHEMES

# --- the model's next-token logits: from the cache, or by recomputing the cropped context ----
# `model` is a GPT(cfg, compute): what it computes and how it runs here.


def _last_tokens(tokens, lengths):
    """Each row's newest token, (B, 1)."""
    return jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)


def _recomputed_logits(params, model: GPT, tokens, lengths, width: int, cache_length: int, keep_last: bool):
    """Next-token logits (B, V) by one pass over each row's last `width` tokens (its whole
    sequence, left-aligned, when shorter: the causal mask hides what follows it), and a
    fresh cache holding those tokens (valid to go on from for the rows that fit in it; the
    others were cropped), never the padding after them. As the prefill (keep_last False) it
    holds all but each row's last, which the first step feeds; as the step past the context
    (keep_last True) each row's last too, since the next step feeds the token drawn after it."""
    starts = jnp.maximum(lengths - width, 0)
    windows = jax.vmap(lambda row, start: jax.lax.dynamic_slice(row, (start,), (width,)))(tokens, starts)
    last = lengths - starts - 1  # each row's newest token in its window
    cache = init_cache(model.cfg, tokens.shape[0], cache_length, model.compute.compute_dtype)
    logits, cache = model.apply({"params": params}, windows, cache.with_limit(last + keep_last))
    return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0], cache.with_limit(None)


def _cached_logits(params, model: GPT, cache, tokens, lengths):
    """Next-token logits (B, V) by feeding each row's newest token at its position: the cache
    holds the ones before it (and perhaps it too: writing it again changes nothing). Rows
    that stopped growing are clamped inside the cache (their output is not used)."""
    logits, cache = model.apply({"params": params}, _last_tokens(tokens, lengths), cache.resume_at(lengths - 1))
    return logits[:, 0], cache


def start_cache(params, model: GPT, tokens, lengths, prompt_width: int):
    """The cache to start decoding from, for a (B, W) buffer of sequences `tokens` whose
    prompts (`lengths` long) lie in the first prompt_width columns. When every sequence fits
    in the context (W ≤ block_size), or the form's cache carries any length (linear), the
    prompts are prefilled now, all but each row's last token (the first step feeds it);
    otherwise it starts empty and the first `next_logits`, a pass over the context windows,
    fills it (one compiled pass fewer; that first step costs one window pass, as does every
    step past the context)."""
    cfg, width = model.cfg, tokens.shape[1]
    if width > cfg.block_size and not FORMS[cfg.attention].grows_past_context:
        return init_cache(cfg, tokens.shape[0], cfg.block_size, model.compute.compute_dtype)
    return _recomputed_logits(params, model, tokens, lengths, prompt_width, min(width, cfg.block_size),
                              keep_last=False)[1]


def next_logits(params, model: GPT, cache, tokens, lengths, active, step):
    """Every row's next-token logits (B, V) and the cache, after `step` tokens were added to
    the buffer from `start_cache`: from the cache (one position per row) when every active
    row fits in the context and the cache is filled, else by one pass over each row's
    cropped context, which refills the cache."""
    cfg = model.cfg
    from_cache = lambda: _cached_logits(params, model, cache, tokens, lengths)  # noqa: E731
    # a form whose cache carries any length goes on from it; otherwise every sequence fits,
    # and start_cache prefilled the prompts
    if FORMS[cfg.attention].grows_past_context or tokens.shape[1] <= cfg.block_size:
        return from_cache()
    fits = (step > 0) & jnp.all(~active | (lengths <= cfg.block_size))
    window = cfg.block_size
    return jax.lax.cond(fits, from_cache,
                        lambda: _recomputed_logits(params, model, tokens, lengths, window, window, keep_last=True))


# --- prompts -------------------------------------------------------------------------------------

MIN_BUCKET = 8


def prompt_bucket(length: int) -> int:
    """The padded prompt width for prompts up to `length` tokens: the next power of two
    (at least MIN_BUCKET), so that a few compiled programs serve every prompt length."""
    return max(MIN_BUCKET, 1 << (length - 1).bit_length())


def prompt_batch(config: GPTConfig, prompts, prompt_lengths, pad_id):
    """(prompts (B, P) int32, lengths (B,) int32, longest prompt or None for array input)
    from a list of token-id sequences (padded with pad_id up to their `prompt_bucket`) or a
    (B, P) integer array with optional prompt_lengths; ValueError for anything else."""
    if isinstance(prompts, (jax.Array, np.ndarray)):
        return _array_batch(config, prompts, prompt_lengths)
    if prompt_lengths is not None:
        raise ValueError("prompt_lengths is for a padded (B, P) array of prompts; a list of prompts has its lengths")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id sequences (or a (B, P) array)")
    rows = []
    for b, prompt in enumerate(prompts):
        if isinstance(prompt, (int, np.integer)):
            raise ValueError("prompts must be a list of token-id sequences, one per row: for one prompt pass [prompt]")
        row = np.asarray(prompt)
        if row.ndim != 1 or row.size == 0 or not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"prompt {b} must be a non-empty sequence of token ids, got {prompt!r:.80}")
        rows.append(row)
    longest = max(len(row) for row in rows)
    _check_ids(config, np.concatenate(rows))
    padded = np.full((len(rows), prompt_bucket(longest)), pad_id, np.int32)
    for b, row in enumerate(rows):
        padded[b, :len(row)] = row
    lengths = np.array([len(row) for row in rows], np.int32)
    return jax.device_put(padded), jax.device_put(lengths), longest  # copies, no conversion programs


def _array_batch(config: GPTConfig, prompts, prompt_lengths):
    """`prompt_batch` of a (B, P) array: its ids and lengths are checked unless traced."""
    if prompts.ndim != 2 or not jnp.issubdtype(prompts.dtype, jnp.integer):
        raise ValueError(f"prompts as an array must be (batch, length) integers, got shape {prompts.shape} "
                         f"{prompts.dtype}")
    batch, width = prompts.shape
    lengths = jnp.full((batch,), width, jnp.int32) if prompt_lengths is None else jnp.asarray(prompt_lengths)
    if lengths.shape != (batch,):
        raise ValueError(f"prompt_lengths must have shape ({batch},), one length per prompt, got {lengths.shape}")
    if batch == 0 or width == 0:
        raise ValueError("prompts is empty: give at least one prompt of at least one token")
    if is_concrete(prompts) and is_concrete(lengths):
        _check_ids(config, np.asarray(prompts)[np.arange(width)[None, :] < np.asarray(lengths)[:, None]])
        if not np.all((1 <= np.asarray(lengths)) & (np.asarray(lengths) <= width)):
            raise ValueError(f"prompt_lengths must be in 1…{width} (the prompts' width), got {lengths}")
    return jnp.asarray(prompts, jnp.int32), lengths.astype(jnp.int32), None


def check_reach(config: GPTConfig, prompts, longest: int | None, max_new_tokens: int) -> None:
    """ValueError when a form whose cache carries any length (linear) would go past the
    context with positions that end there (learned, sinusoidal): the state could, the
    position table cannot. (The other forms crop the context.)"""
    if not FORMS[config.attention].grows_past_context or not SCHEMES[config.positions].ends_at_block_size:
        return
    reach = (prompts.shape[1] if longest is None else longest) + max_new_tokens
    if reach > config.block_size:
        raise ValueError(f"attention={config.attention!r} with positions={config.positions!r} has positions only up to "
                         f"block_size={config.block_size}, but this generation reaches {reach} tokens: shorten "
                         f"the prompt or max_new_tokens, or train with positions='rope' or 'none'")


def _check_ids(config: GPTConfig, ids: np.ndarray) -> None:
    outside = (ids < 0) | (ids >= config.vocab_size)
    if outside.any():
        bad = ids[outside][0]
        raise ValueError(f"prompt token {bad} is not an id of this model's vocabulary 0…{config.vocab_size - 1}")


# --- small type checks ------------------------------------------------------------------


def is_concrete(x) -> bool:
    """Not a value traced under jit (whose contents cannot be checked)."""
    return not isinstance(x, jax.core.Tracer)
