"""attention='linear': φ(q)ᵀS/(φ(q)ᵀz) (ops.linear_attention), and its cache, the recurrent
state (S, z), whose size does not grow with the sequence: decoding goes on at any length."""

from __future__ import annotations

from typing import ClassVar

import flax.struct
import jax.numpy as jnp

from jaxgpt import ops
from jaxgpt.attention.base import Form, OneSequenceRows, Where, no_tokens_before

NO_LIMIT = jnp.iinfo(jnp.int32).max


@flax.struct.dataclass
class LinearCache(OneSequenceRows):
    """The recurrent state of every layer. S[l] (B, H_kv, D, D) = Σ_s φ(k_s) v_sᵀ and z[l]
    (B, H_kv, D) = Σ_s φ(k_s) over the tokens absorbed so far, in float32. index (B,): the
    position of the next token. limit (B,): tokens at positions ≥ limit are read but not
    absorbed, which is what a padded prefill needs (decoding sets it to each prompt's
    length − 1, then lifts it). last_tokens, last_positions (B, 2): the last two tokens absorbed and
    their positions (EMPTY before any), what jaxgpt.previous reads as the tokens before the next one."""

    S: tuple
    z: tuple
    form: ClassVar[str] = "linear"

    def layer(self, layer: int, positions):
        """What layer `layer`'s attention reads and extends: (S, z, which new tokens to absorb)."""
        return self.S[layer], self.z[layer], positions < self.limit[:, None]

    def with_layers(self, layers: list, length: int) -> LinearCache:
        return self.replace(S=tuple(S for S, _ in layers), z=tuple(z for _, z in layers), index=self.index + length)

    def resume_at(self, last) -> LinearCache:
        return self.replace(index=last)

    def with_limit(self, limit=None) -> LinearCache:
        """Absorb only the tokens at positions < limit (B,) from now on; None: every token."""
        return self.replace(limit=jnp.full_like(self.limit, NO_LIMIT) if limit is None else limit)


def attend(cfg, kernel, q, k, v, where: Where, layer_cache, bias_of, on_weights):
    """ops.linear_attention of φ(Q), φ(K), V (φ = cfg.linear_feature; no kernel: it forms no
    softmax). With a layer cache (S, z, absorb) the tokens also read the state of the earlier
    ones, and the ones marked absorb join it: one token at a time, this is the recurrent form
    S_t = S_{t−1} + φ(k_t) v_tᵀ, z_t = z_{t−1} + φ(k_t), out_t = φ(q_t)ᵀS_t / (φ(q_t)ᵀz_t + ε)."""
    phi = ops.FEATURE_MAPS[cfg.linear_feature]
    fq, fk = phi(q), phi(k)
    if layer_cache is None:
        return ops.linear_attention(fq, fk, v, where.mask()), None
    S, z, absorb = layer_cache
    mask = where.mask() & absorb[:, None, None, :]
    context = ops.linear_attention(fq, fk, v, mask, (S, z))
    return context, ops.linear_attention_state(fk, v, absorb, (S, z))


def init_cache(cfg, batch_size: int, max_length: int | None = None, dtype=None) -> LinearCache:
    """The zero state (any length: max_length and dtype are not used)."""
    del max_length, dtype
    S = tuple(jnp.zeros((batch_size, cfg.n_kv_head, cfg.head_dim, cfg.head_dim), jnp.float32)
              for _ in range(cfg.n_layer))
    z = tuple(jnp.zeros((batch_size, cfg.n_kv_head, cfg.head_dim), jnp.float32) for _ in range(cfg.n_layer))
    return LinearCache(S=S, z=z, index=jnp.zeros((batch_size,), jnp.int32),
                       limit=jnp.full((batch_size,), NO_LIMIT, jnp.int32), **no_tokens_before(batch_size))


FORM = Form(attend=attend, init_cache=init_cache, grows_past_context=True, keys=("linear_feature",), has_weights=False)
