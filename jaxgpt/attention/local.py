"""attention='local': softmax attention over a sliding window, a query seeing itself and the
window − 1 positions before it (M_ts = 1 iff 0 ≤ t − s < w), by any softmax kernel; its cache
holds only the last `window` keys and values of each layer, in a ring of slots."""

from __future__ import annotations

from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from jaxgpt import ops
from jaxgpt.attention.base import EMPTY, Form, OneSequenceRows, Where, no_tokens_before, offset_in_row

NO_LIMIT = jnp.iinfo(jnp.int32).max


@flax.struct.dataclass
class RingCache(OneSequenceRows):
    """keys[l], values[l]: (B, W, H_kv, D) with W = min(window, the longest sequence); the
    token number n of a row lives in slot n mod W. positions[l] (B, W): the position of each
    slot's token (EMPTY before it is written). index (B,): tokens seen so far in each row.
    limit (B,): tokens at positions ≥ limit are read but not kept (a padded prefill's padding).
    last_tokens, last_positions (B, 2): the last two tokens kept and their positions (EMPTY before
    any), what jaxgpt.previous reads as the tokens before the next one."""

    keys: tuple
    values: tuple
    positions: tuple
    form: ClassVar[str] = "local"

    def layer(self, layer: int, positions):
        """What layer `layer` reads and extends: (keys, values, their positions, index)."""
        del positions
        return self.keys[layer], self.values[layer], self.positions[layer], self.index, self.limit

    def with_layers(self, layers: list, length: int) -> RingCache:
        keys, values, positions = zip(*layers, strict=True)
        return self.replace(keys=keys, values=values, positions=positions, index=self.index + length)

    def resume_at(self, last) -> RingCache:
        return self.replace(index=last)

    def with_limit(self, limit=None) -> RingCache:
        """Keep only the tokens at positions < limit (B,) from now on; None: every token."""
        return self.replace(limit=jnp.full_like(self.limit, NO_LIMIT) if limit is None else limit)


def attend(cfg, kernel, q, k, v, where: Where, layer_cache, bias_of, on_weights):
    """The kernel with the window in the mask. With a cache, the new tokens read the ring's
    keys of earlier tokens (slots of tokens at or past the first new one are stale: hidden)
    and their own, then the last W of them are written into the ring. With key_offset the keys
    it reads are offset (the ring keeps them as made: _offset_in_ring)."""
    where = where._replace(window=cfg.window)
    if layer_cache is None:
        keys = offset_in_row(k, where.k_positions, where.k_segments) if cfg.key_offset else k
        return kernel(q, keys, v, where, bias_of, on_weights), None
    ring_k, ring_v, ring_positions, index, limit = layer_cache
    first = where.q_positions[:, :1]
    seen = jnp.where(ring_positions < first, ring_positions, EMPTY)
    k_positions = jnp.concatenate([seen, where.q_positions], axis=1)
    keys = jnp.concatenate([ring_k, k.astype(ring_k.dtype)], axis=1)
    if cfg.key_offset:
        keys = _offset_in_ring(keys, seen, where.q_positions)
    context = kernel(q, keys, jnp.concatenate([ring_v, v.astype(ring_v.dtype)], axis=1),
                     Where(where.q_positions, k_positions, window=cfg.window), bias_of, on_weights)
    return context, _write(ring_k, ring_v, ring_positions, k, v, where.q_positions, index, limit)


def _offset_in_ring(keys, seen, positions):
    """ops.offset_keys of the ring's W keys and the new ones after them (keys (B, W+T, H, D)), the ring's
    positions `seen` (B, W), the new ones' (B, T). Token n sits in slot n mod W, so the token before a
    slot's is the slot before's, cyclically, where it is at the position before; the first new token's
    is the ring's at the position before its own, and each later one's the new one before it. (The one
    slot whose token before is gone, the oldest, is outside every new query's window.)"""
    W = seen.shape[1]
    ring, new = keys[:, :W], keys[:, W:]
    found = seen == positions[:, :1] - 1  # (B, W): the slot of the first new token's token before
    first = jnp.take_along_axis(ring, jnp.argmax(found, axis=1)[:, None, None, None], axis=1)
    before = jnp.concatenate([jnp.roll(ring, 1, axis=1), first, new[:, :-1]], axis=1)
    has = jnp.concatenate([jnp.roll(seen, 1, axis=1) == seen - 1,
                           ops.follows(positions).at[:, 0].set(found.any(axis=1))], axis=1)
    return ops.offset_keys(keys, before, has)


def _write(ring_k, ring_v, ring_positions, k, v, positions, index, limit):
    """The ring after the new tokens: of those before `limit`, the last W, token n in slot
    n mod W (W consecutive tokens: distinct slots); the others are dropped."""
    W, T = ring_k.shape[1], k.shape[1]
    below = positions < limit[:, None]  # a prefix of the new tokens
    t = jnp.arange(T)[None, :]
    kept = below & (t >= below.sum(axis=1, keepdims=True) - W)
    slots = jnp.where(kept, (index[:, None] + t) % W, W)  # W: out of range, dropped

    def write(ring, new, slot):
        return ring.at[slot].set(new.astype(ring.dtype), mode="drop")

    return (jax.vmap(write)(ring_k, k, slots), jax.vmap(write)(ring_v, v, slots),
            jax.vmap(write)(ring_positions, positions.astype(jnp.int32), slots))


def init_cache(cfg, batch_size: int, max_length: int | None = None, dtype=jnp.float32) -> RingCache:
    """An empty ring of min(window, max_length) slots (max_length default block_size)."""
    max_length = cfg.block_size if max_length is None else max_length
    if not 0 < max_length <= cfg.block_size:
        raise ValueError(f"init_cache: max_length={max_length} must be in 1…block_size={cfg.block_size}")
    slots = min(cfg.window, max_length)
    shape = (batch_size, slots, cfg.n_kv_head, cfg.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layer))
    empty = tuple(jnp.full((batch_size, slots), EMPTY, jnp.int32) for _ in range(cfg.n_layer))
    return RingCache(keys=zeros, values=zeros, positions=empty, index=jnp.zeros((batch_size,), jnp.int32),
                     limit=jnp.full((batch_size,), NO_LIMIT, jnp.int32), **no_tokens_before(batch_size))


def check(cfg) -> None:
    window = cfg.window
    if window is None:
        raise ValueError("GPTConfig.window=None with attention='local': a sliding window needs its length "
                         "(e.g. attention='local', window=64)")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"GPTConfig.window={window!r}: must be a positive integer")


FORM = Form(attend=attend, init_cache=init_cache, check=check, keys=("window",), asks=("window",),
            offsets_keys=True)
