"""What every attention form shares: Where (which key each query sees) and Form (the
interface a form implements, with its cache)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from jaxgpt import ops


class Where(NamedTuple):
    """Positions (B, T) of the queries and (B, S) of the keys, and segments (the example each
    token belongs to when several are packed in a row; None: one sequence). A query sees a
    key iff the key's position is not later, with segments it is of the same segment, and
    with a window w it is less than w positions earlier: causal within each packed example,
    never across, and local when windowed."""

    q_positions: jax.Array
    k_positions: jax.Array
    q_segments: jax.Array | None = None
    k_segments: jax.Array | None = None
    window: int | None = None

    def mask(self):
        """(B, 1, T, S): ops.position_mask, ops.segment_mask with segments, ops.window_mask with a window."""
        mask = ops.position_mask(self.q_positions, self.k_positions)
        if self.q_segments is not None:
            mask = mask & ops.segment_mask(self.q_segments, self.k_segments)
        if self.window is not None:
            mask = mask & ops.window_mask(self.q_positions, self.k_positions, self.window)
        return mask[:, None]

    def keys_are_queries(self) -> bool:
        """The keys are the queries' own tokens (no cache): key s sits where query s does."""
        return self.k_positions is self.q_positions

    def causal_by_index(self) -> bool:
        """The mask is M[t, s] = [s ≤ t], causal by index: the keys are the queries' own tokens, one
        example a row (no segments) and no window. A row's positions count up by one (0…T−1, or an
        example's as jaxgpt.data.packing gives them), so the mask by position is this one; a fused
        kernel told so skips the blocks above the diagonal instead of reading a (T, T) mask."""
        return self.keys_are_queries() and self.q_segments is None and self.window is None

    def queries(self, start: int, end: int, keys_end: int) -> Where:
        """Queries start…end−1 against keys 0…keys_end−1."""
        segments = (None, None) if self.q_segments is None else (
            self.q_segments[:, start:end], self.k_segments[:, :keys_end])
        return self._replace(q_positions=self.q_positions[:, start:end], k_positions=self.k_positions[:, :keys_end],
                             q_segments=segments[0], k_segments=segments[1])

    def paired(self) -> Where:
        """The Where of paired heads' one sequence (ops.pair_heads): place 2t+i at position 2p_t + i, of
        segment seg_t (ops.pair_positions, ops.pair_segments), so the query of head 2j+i at p sees the keys
        of head 2j+i' at p' iff 2p' + i' ≤ 2p + i (and p' is of its example). No window: the local form
        pairs no heads (registries.check_model refuses it)."""
        q_positions, same = ops.pair_positions(self.q_positions), self.keys_are_queries()
        k_positions = q_positions if same else ops.pair_positions(self.k_positions)
        if self.q_segments is None:
            return Where(q_positions, k_positions)
        q_segments = ops.pair_segments(self.q_segments)
        k_segments = q_segments if self.k_segments is self.q_segments else ops.pair_segments(self.k_segments)
        return Where(q_positions, k_positions, q_segments, k_segments)


EMPTY = jnp.iinfo(jnp.int32).min // 2  # the position of a slot, or a last token, never written


BEFORE = 2  # the tokens before the first new one a cache gives (jaxgpt.previous: the bigram's one, the trigram's two)


def last_kept(tokens, positions, limit, last: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(tokens, positions) (B, K), oldest first, of each row's last K tokens kept: of `last`, the K
    held so far (each (B, K)), then the new tokens (B, T) whose positions are < limit (B,) (a prefix of
    them). What a cache that keeps no token per slot (linear, local) gives as the tokens before
    (jaxgpt.previous)."""
    positions = jnp.broadcast_to(positions, tokens.shape)
    kept = (positions < limit[:, None]).sum(axis=1)
    at = kept[:, None] + jnp.arange(last[0].shape[1])[None, :]  # the last K of (held, kept new)
    return tuple(jnp.take_along_axis(jnp.concatenate([old, new.astype(old.dtype)], axis=1), at, axis=1)
                 for new, old in zip((tokens, positions), last, strict=True))


def tokens_before(last: tuple[jax.Array, jax.Array], positions) -> tuple[tuple[jax.Array, jax.Array], ...]:
    """((x_{−1}, held), (x_{−2}, held), …): for k = 1 … K, the k-th last token kept (B,) and whether it is
    at the position k before each row's first new one, of `last` (tokens, positions) (B, K) oldest first."""
    tokens, kept_at = last
    K = tokens.shape[1]
    return tuple((tokens[:, K - k], kept_at[:, K - k] == positions[:, 0] - k) for k in range(1, K + 1))


@flax.struct.dataclass
class OneSequenceRows:
    """What the caches that keep no token per slot (linear, local) share: each row decodes one
    sequence, and its last BEFORE tokens kept (last_tokens, last_positions (B, BEFORE), oldest first;
    EMPTY positions before any) are the tokens before the next. index (B,): tokens seen so far in
    each row; limit (B,): tokens at positions ≥ limit are read but not kept (a padded prefill's padding)."""

    index: jax.Array
    limit: jax.Array
    last_tokens: jax.Array
    last_positions: jax.Array
    form: ClassVar[str]  # the attention form, for the message that refuses segments

    def locate(self, tokens, positions=None, segments=None):
        """(positions, the Where of the blocks, the cache with the new tokens' last kept ones): the
        new tokens see each other causally, and what the cache holds."""
        if segments is not None:
            raise ValueError(f"attention={self.form!r} decodes one sequence per row: segments cannot be given with "
                             "its cache")
        if positions is None:
            positions = self.index[:, None] + jnp.arange(tokens.shape[-1])[None, :]
        last = last_kept(tokens, positions, self.limit, (self.last_tokens, self.last_positions))
        return positions, Where(positions, positions), self.replace(last_tokens=last[0], last_positions=last[1])

    def tokens_before(self, positions, segments=None) -> tuple[tuple[jax.Array, jax.Array], ...]:
        """The last tokens kept, each held iff it is at its place before the first new one (tokens_before)."""
        return tokens_before((self.last_tokens, self.last_positions), positions)


def no_tokens_before(batch_size: int) -> dict:
    """last_tokens and last_positions of a OneSequenceRows cache that has kept no token yet."""
    return {"last_tokens": jnp.zeros((batch_size, BEFORE), jnp.int32),
            "last_positions": jnp.full((batch_size, BEFORE), EMPTY, jnp.int32)}


class Form(NamedTuple):
    """An attention form (the model's identity: config.model.attention), one file each.

    attend(cfg, kernel, q, k, v, where, layer_cache, bias_of, on_weights) → (context
      (B,T,H,D), the layer's new cache or None): q (B,T,H,D), k and v (B,T,H_kv,D) of the new
      tokens; kernel one of kernels.KERNELS (a form that forms no softmax ignores it);
      layer_cache what the form's cache gives for the layer (None without a cache).
    init_cache(cfg, batch_size, max_length, dtype) → an empty cache for decoding. A cache is a
      pytree with `index` (B,) and the methods locate, layer, with_layers, resume_at, with_limit
      and tokens_before (softmax.KVCache says what each does).
    grows_past_context: the cache carries the whole sequence, so decoding never crops it and
      a new token costs one position at any length.
    check(cfg): a one-line ValueError for a GPTConfig this form cannot compute (called by
      GPTConfig when it is made).
    keys: the GPTConfig fields only this form reads; one that defaults to None must stay None
      under the other forms.
    has_weights: it forms attention weights softmax(QKᵀ/√D + bias + M) by the kernel, so the
      kernel matters, pictures can draw the weights and W_QK describes the scores; False: it
      forms no softmax (the kernel is never called, and a positional bias has nothing to bias).
    asks: what it asks of a kernel (the names of kernels.Kernel's abilities: 'window').
    slots_by_position: its cache holds each token in the slot of its position, so a read may
      start at any position of a row, a token read again rewrites its own slot, and a slot
      past what a row has read is attended by no query before it is written (softmax's KV
      cache; jaxgpt.score.likelihood reads contexts and continuations in windows through it).
    offsets_keys: it computes model.key_offset (ops.offset_keys on every key it reads, the
      cache's included: its cache keeps the keys as they are made, and each read offsets them).
    pairs_heads: it computes model.paired_heads' layers, whose kernel is kernels.paired's (the
      heads interleaved into one sequence); its cache keeps each token's heads as they are.
    narrows: it reads the window of a Where it is given (a training window, train.window_schedule:
      GPT's `window`); the local form sets its own, the linear form masks no scores.
    """

    attend: Callable[..., tuple[jax.Array, Any]]
    init_cache: Callable[..., Any]
    grows_past_context: bool = False
    check: Callable[[Any], None] = lambda cfg: None
    keys: tuple[str, ...] = ()
    has_weights: bool = True
    asks: tuple[str, ...] = ()
    slots_by_position: bool = False
    offsets_keys: bool = False
    pairs_heads: bool = False
    narrows: bool = False


def offset_in_row(k, positions, segments=None):
    """ops.offset_keys with the token before each key's at the entry before it in its row, where it
    follows it (ops.follows: the position before, the same segment): k (B,S,H,D), positions (B,S)."""
    return ops.offset_keys(k, jnp.concatenate([k[:, :1], k[:, :-1]], axis=1), ops.follows(positions, segments))
