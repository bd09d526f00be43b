"""attention='softmax': softmax(QKᵀ/√D + bias + M) V by the chosen kernel, and its KV cache."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxgpt.attention.base import BEFORE, Form, Where, offset_in_row


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for positions already seen, and where each row is.

    keys[l], values[l]: (B, L, H_kv, D), H_kv = n_kv_head. positions, segments: (B, L) the position and segment
    (example) of the token in each slot; unless a call says otherwise, slot s holds position
    s of segment 0. index: (B,) the number of slots written so far in each row: the next
    tokens are written at index, index+1, … tokens (B, L): the token id in each slot (what a
    token takes from the one before it reads: jaxgpt.previous). Setting index lower (e.g. to each prompt's true
    length after a padded prefill) is allowed: slots at or past index are never attended to
    before they are written again.
    """

    keys: tuple
    values: tuple
    index: jax.Array
    positions: jax.Array
    segments: jax.Array
    tokens: jax.Array

    @property
    def max_length(self) -> int:
        return self.keys[0].shape[1]

    def locate(self, tokens, positions=None, segments=None) -> tuple[jax.Array, Where, KVCache]:
        """(the new tokens' positions (B, T), the Where of their attention, the cache with
        their positions and segments written in their slots): positions default to
        index … index+T−1."""
        if positions is None:
            positions = self.index[:, None] + jnp.arange(tokens.shape[-1])[None, :]
        segments = jnp.zeros(tokens.shape, jnp.int32) if segments is None else segments
        cache = self.replace(positions=write_rows(self.positions, jnp.broadcast_to(positions, tokens.shape),
                                                  self.index),
                             segments=write_rows(self.segments, segments, self.index),
                             tokens=write_rows(self.tokens, tokens, self.index))
        return positions, Where(positions, cache.positions, segments, cache.segments), cache

    def tokens_before(self, positions, segments=None) -> tuple[tuple[jax.Array, jax.Array], ...]:
        """((x_{−1}, held), (x_{−2}, held)): for k = 1 … BEFORE the token (B,) in slot index − k of each row, held
        when the row has it and it is at position k before the row's first new one, of the same segment."""
        segment = 0 if segments is None else segments[:, 0]

        def before(k):
            slot = jnp.maximum(self.index - k, 0)[:, None]
            at = lambda rows: jnp.take_along_axis(rows, slot, axis=1)[:, 0]  # noqa: E731
            held = (self.index >= k) & (at(self.positions) == positions[:, 0] - k) & (at(self.segments) == segment)
            return at(self.tokens), held

        return tuple(before(k) for k in range(1, BEFORE + 1))

    def layer(self, layer: int, positions):
        """What layer `layer`'s attention reads and extends: (keys, values, index)."""
        del positions  # the slots say where each key is
        return self.keys[layer], self.values[layer], self.index

    def with_layers(self, layers: list, length: int) -> KVCache:
        """The cache after the layers wrote `length` new slots per row."""
        return self.replace(keys=tuple(k for k, _ in layers), values=tuple(v for _, v in layers),
                            index=self.index + length)

    def resume_at(self, last) -> KVCache:
        """The cache set to take each row's token number `last` (B,) next (rows past its slots
        are clamped into them: decoding does not use their output)."""
        return self.replace(index=jnp.minimum(last, self.max_length - 1))

    def with_limit(self, limit=None) -> KVCache:
        """Every token is kept: a slot written past a row's end is hidden by its position
        until it is written again."""
        del limit
        return self


def write_rows(cache_rows, new_rows, index):
    """Write new_rows (B, T, …) into the slots index[b] … index[b]+T−1 of each row of cache_rows (B, L, …)."""
    def write_row(cache_row, new_row, start):
        start_at = (start,) + (0,) * (cache_row.ndim - 1)
        return jax.lax.dynamic_update_slice(cache_row, new_row.astype(cache_row.dtype), start_at)

    return jax.vmap(write_row)(cache_rows, new_rows, index)


def attend(cfg, kernel, q, k, v, where: Where, layer_cache, bias_of, on_weights):
    """The kernel over the new tokens' keys, or with a cache over every slot after the new
    keys and values are written into it. With key_offset the keys it reads are offset, slot by
    slot as a row's tokens are (offset_in_row: the slots' positions and segments say which holds
    the token before), so the cache keeps the keys as made and decoding offsets what one pass does."""
    if layer_cache is not None:
        cache_keys, cache_values, index = layer_cache
        k, v = write_rows(cache_keys, k, index), write_rows(cache_values, v, index)
        layer_cache = (k, v)
    if cfg.key_offset:
        k = offset_in_row(k, where.k_positions, where.k_segments)
    return kernel(q, k, v, where, bias_of, on_weights), layer_cache


def init_cache(cfg, batch_size: int, max_length: int | None = None, dtype=jnp.float32) -> KVCache:
    """Empty slots for `batch_size` rows of up to `max_length` (default block_size) positions."""
    max_length = cfg.block_size if max_length is None else max_length
    if not 0 < max_length <= cfg.block_size:
        raise ValueError(f"init_cache: max_length={max_length} must be in 1…block_size={cfg.block_size}")
    shape = (batch_size, max_length, cfg.n_kv_head, cfg.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layer))
    slots = jnp.broadcast_to(jnp.arange(max_length, dtype=jnp.int32), (batch_size, max_length))
    return KVCache(keys=zeros, values=zeros, index=jnp.zeros((batch_size,), jnp.int32), positions=slots,
                   segments=jnp.zeros((batch_size, max_length), jnp.int32),
                   tokens=jnp.zeros((batch_size, max_length), jnp.int32))


FORM = Form(attend=attend, init_cache=init_cache, slots_by_position=True, offsets_keys=True, pairs_heads=True,
            narrows=True)
