"""The caches that decoding passes through the model, explicit pytrees in and out: the KV cache
of softmax attention and the recurrent state of linear attention (jaxgpt.model reads them)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxgpt.config import GPTConfig


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for positions already seen, and where each row is.

    keys[l], values[l]: (B, L, H_kv, D), H_kv = n_kv_head. positions, segments: (B, L) the position and segment
    (example) of the token in each slot; unless a call says otherwise, slot s holds position
    s of segment 0. index: (B,) the number of slots written so far in each row: the next
    tokens are written at index, index+1, … Setting index lower (e.g. to each prompt's true
    length after a padded prefill) is allowed: slots at or past index are never attended to
    before they are written again.
    """

    keys: tuple
    values: tuple
    index: jax.Array
    positions: jax.Array
    segments: jax.Array

    @property
    def max_length(self) -> int:
        return self.keys[0].shape[1]

    def layer(self, layer: int, positions):
        """What layer `layer`'s attention reads and extends: (keys, values, index)."""
        del positions  # the slots say where each key is
        return self.keys[layer], self.values[layer], self.index

    def with_layers(self, layers: list, length: int) -> KVCache:
        """The cache after the layers wrote `length` new slots per row."""
        return self.replace(keys=tuple(k for k, _ in layers), values=tuple(v for _, v in layers),
                            index=self.index + length)


@flax.struct.dataclass
class LinearCache:
    """attention='linear': the recurrent state of every layer, whose size does not grow with
    the sequence. S[l] (B, H_kv, D, D) = Σ_s φ(k_s) v_sᵀ and z[l] (B, H_kv, D) = Σ_s φ(k_s) over
    the tokens absorbed so far, in float32. index (B,): the position of the next token.
    limit (B,): tokens at positions ≥ limit are read but not absorbed, which is what a padded
    prefill needs (decoding sets it to each prompt's length − 1, then lifts it)."""

    S: tuple
    z: tuple
    index: jax.Array
    limit: jax.Array

    def layer(self, layer: int, positions):
        """What layer `layer`'s attention reads and extends: (S, z, which new tokens to absorb)."""
        return self.S[layer], self.z[layer], positions < self.limit[:, None]

    def with_layers(self, layers: list, length: int) -> LinearCache:
        return self.replace(S=tuple(S for S, _ in layers), z=tuple(z for _, z in layers), index=self.index + length)


NO_LIMIT = jnp.iinfo(jnp.int32).max


def init_cache(cfg: GPTConfig, batch_size: int, max_length: int | None = None, dtype=None) -> KVCache | LinearCache:
    """An empty cache for `batch_size` rows of up to `max_length` (default block_size) positions;
    with attention='linear', the zero state (any length: max_length and dtype are not used)."""
    if cfg.attention == "linear":
        S = tuple(jnp.zeros((batch_size, cfg.n_kv_head, cfg.head_dim, cfg.head_dim), jnp.float32)
                  for _ in range(cfg.n_layer))
        z = tuple(jnp.zeros((batch_size, cfg.n_kv_head, cfg.head_dim), jnp.float32) for _ in range(cfg.n_layer))
        return LinearCache(S=S, z=z, index=jnp.zeros((batch_size,), jnp.int32),
                           limit=jnp.full((batch_size,), NO_LIMIT, jnp.int32))
    max_length = cfg.block_size if max_length is None else max_length
    if not 0 < max_length <= cfg.block_size:
        raise ValueError(f"init_cache: max_length={max_length} must be in 1…block_size={cfg.block_size}")
    dtype = cfg.compute_dtype if dtype is None else dtype
    shape = (batch_size, max_length, cfg.n_kv_head, cfg.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layer))
    slots = jnp.broadcast_to(jnp.arange(max_length, dtype=jnp.int32), (batch_size, max_length))
    return KVCache(keys=zeros, values=zeros, index=jnp.zeros((batch_size,), jnp.int32), positions=slots,
                   segments=jnp.zeros((batch_size, max_length), jnp.int32))


def write_rows(cache_rows, new_rows, index):
    """Write new_rows (B, T, …) into the slots index[b] … index[b]+T−1 of each row of cache_rows (B, L, …)."""
    def write_row(cache_row, new_row, start):
        start_at = (start,) + (0,) * (cache_row.ndim - 1)
        return jax.lax.dynamic_update_slice(cache_row, new_row.astype(cache_row.dtype), start_at)

    return jax.vmap(write_row)(cache_rows, new_rows, index)
