"""The GPT as Flax Linen modules: each owns its parameters and composes the math in `ops`.

    X = E[x] + P            (Embed)
    Y = X + MHA(LN₁(X))     (Block, pre-norm; post-norm and parallel forms are options)
    Z = Y + FFN(LN₂(Y))
    logits = LN_f(Z) W_U    (W_U = Eᵀ when tied)

`GPT(cfg).apply({'params': params}, tokens)` is a pure function of a plain params pytree.
Generation passes an explicit `KVCache` in and gets the updated one back.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt import ops
from jaxgpt.caches import KVCache, LinearCache, write_rows
from jaxgpt.config import GPTConfig

INIT_STD = 0.02
ATTENTION_BLOCK = 64  # query positions per block of attention="blocked"


def normal(std):
    return nn.initializers.normal(stddev=std)


def residual_std(cfg: GPTConfig) -> float:
    """GPT-2 scales the projections that write into the residual stream by 1/√(2·n_layer)."""
    return INIT_STD / math.sqrt(2 * cfg.n_layer)


def kernel_std(cfg: GPTConfig, fan_in: int, residual: bool = False) -> float:
    """The std σ of a weight matrix's N(0, σ²) entries under cfg.init:
    gpt2: σ = 0.02, and 0.02/√(2·n_layer) for the projections into the residual stream;
    he: σ = √(2/fan_in) for every matrix; small: σ = √(2/(5·d_model)), divided by √(2·n_layer)
    for the residual projections. fan_in is the matrix's input width."""
    if cfg.init == "he":
        return math.sqrt(2 / fan_in)
    std = INIT_STD if cfg.init == "gpt2" else math.sqrt(2 / (5 * cfg.d_model))
    return std / math.sqrt(2 * cfg.n_layer) if residual else std


def embedding_std(cfg: GPTConfig) -> float:
    """The token and position tables: N(0, 0.02²) under gpt2 and he, N(0, 2/(5·d_model)) under small."""
    return math.sqrt(2 / (5 * cfg.d_model)) if cfg.init == "small" else INIT_STD


# --- modules ------------------------------------------------------------------------------


class Linear(nn.Module):
    """y = x W + b, with W of shape (input dims…, output dims…) as Flax's DenseGeneral has it;
    the input dims are the last `n_in` axes of x. Computed as one 2-D matmul (ops.linear).
    W is drawn from N(0, σ²), σ = kernel_std(cfg, fan_in, residual)."""

    features: tuple
    cfg: GPTConfig
    n_in: int = 1
    use_bias: bool = True
    residual: bool = False  # writes into the residual stream

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        in_shape, out_shape = x.shape[x.ndim - self.n_in:], tuple(self.features)
        std = kernel_std(cfg, math.prod(in_shape), self.residual)
        kernel = self.param("kernel", normal(std), (*in_shape, *out_shape), cfg.params_dtype)
        batch = x.shape[: x.ndim - self.n_in]
        x2 = x.reshape(*batch, math.prod(in_shape)).astype(cfg.compute_dtype)
        w2 = kernel.reshape(math.prod(in_shape), math.prod(out_shape)).astype(cfg.compute_dtype)
        y = ops.linear(x2, w2).reshape(*batch, *out_shape)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, out_shape, cfg.params_dtype).astype(cfg.compute_dtype)
        return y


class LayerNorm(nn.Module):
    """γ ⊙ (x − μ)/√(σ² + ε) + β."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x):
        d, dtype = x.shape[-1], self.cfg.params_dtype
        scale = self.param("scale", nn.initializers.ones, (d,), dtype)
        bias = self.param("bias", nn.initializers.zeros, (d,), dtype) if self.cfg.bias else None
        return ops.layer_norm(x, scale, bias, self.cfg.norm_eps)


class RMSNorm(nn.Module):
    """γ ⊙ x/√(mean(x²) + ε)."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.cfg.params_dtype)
        return ops.rms_norm(x, scale, self.cfg.norm_eps)


class Dropout(nn.Module):
    """ops.dropout with a key from the 'dropout' RNG stream; the identity when deterministic."""

    rate: float

    @nn.compact
    def __call__(self, x, deterministic: bool):
        if deterministic or self.rate == 0.0:
            return x
        return ops.dropout(x, self.rate, self.make_rng("dropout"))


def make_norm(cfg: GPTConfig, name: str) -> nn.Module:
    return {"layernorm": LayerNorm, "rmsnorm": RMSNorm}[cfg.norm](cfg, name=name)


class Where(NamedTuple):
    """Where the queries and keys of a block sit: positions (B, T) and (B, S), and segments
    (the example each token belongs to when several are packed in a row; None: one sequence).
    A query sees a key iff the key's position is not later and, with segments, it is of the
    same segment: causal within each packed example, never across."""

    q_positions: jax.Array
    k_positions: jax.Array
    q_segments: jax.Array | None = None
    k_segments: jax.Array | None = None

    def mask(self):
        """(B, 1, T, S): ops.position_mask, and ops.segment_mask with segments."""
        mask = ops.position_mask(self.q_positions, self.k_positions)
        if self.q_segments is not None:
            mask = mask & ops.segment_mask(self.q_segments, self.k_segments)
        return mask[:, None]

    def queries(self, start: int, end: int, keys_end: int) -> Where:
        """Queries start…end−1 against keys 0…keys_end−1."""
        segments = (None, None) if self.q_segments is None else (
            self.q_segments[:, start:end], self.k_segments[:, :keys_end])
        return Where(self.q_positions[:, start:end], self.k_positions[:, :keys_end], *segments)


class CausalSelfAttention(nn.Module):
    """MHA(X) = concat_h(softmax(Q_h K_{g(h)}ᵀ/√d_k + M) V_{g(h)}) W_O, with Q, K, V = X W_Q, X W_K, X W_V.

    Q has n_head heads of size D = head_dim, K and V n_kv_head, each shared by n_head/n_kv_head
    query heads: g(h) = ⌊h·n_kv_head/n_head⌋ (g(h) = h for multi-head attention). Params:
    with n_kv_head = n_head, c_attn/kernel (d, 3, H, D) (GPT-2's layout); otherwise
    q_proj/kernel (d, H, D) and kv_proj/kernel (d, 2, H_kv, D). c_proj/kernel (H, D, d) is W_O.
    """

    cfg: GPTConfig

    def project(self, x):
        """Q (B, T, H, D), K and V (B, T, H_kv, D)."""
        cfg = self.cfg
        if cfg.n_kv_head == cfg.n_head:
            qkv = Linear((3, cfg.n_head, cfg.head_dim), cfg, use_bias=cfg.bias, name="c_attn")(x)
            return qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
        q = Linear((cfg.n_head, cfg.head_dim), cfg, use_bias=cfg.bias, name="q_proj")(x)
        kv = Linear((2, cfg.n_kv_head, cfg.head_dim), cfg, use_bias=cfg.bias, name="kv_proj")(x)
        return q, kv[..., 0, :, :], kv[..., 1, :, :]

    @nn.compact
    def __call__(self, x, where: Where, layer_cache=None, *, deterministic=True):
        cfg = self.cfg
        q, k, v = self.project(x)
        if cfg.positions == "rope":
            q, k = ops.rope(q, where.q_positions, cfg.rope_base), ops.rope(k, where.q_positions, cfg.rope_base)
        if cfg.attention == "linear":
            context, layer_cache = linear_context(cfg, q, k, v, where, layer_cache)
            out = Linear((cfg.d_model,), cfg, n_in=2, use_bias=cfg.bias, residual=True, name="c_proj")(context)
            return out, layer_cache
        if layer_cache is not None:  # the new keys join those of the earlier positions
            cache_keys, cache_values, index = layer_cache
            k, v = write_rows(cache_keys, k, index), write_rows(cache_values, v, index)
            layer_cache = (k, v)

        def alibi(where: Where):
            return ops.alibi_bias_at(cfg.n_head, where.q_positions, where.k_positions) \
                if cfg.positions == "alibi" else None

        def explicit(q, k, v, where: Where, whole=True):
            k, v = ops.share_kv_heads(k, cfg.n_head), ops.share_kv_heads(v, cfg.n_head)
            weights = ops.attention_weights(q, k, where.mask(), alibi(where))
            if whole:  # the (T, S) map of all the queries, for pictures
                self.sow("intermediates", "attention_weights", weights)
            return ops.attend(Dropout(cfg.dropout)(weights, deterministic), v)

        T = q.shape[1]
        if cfg.attention == "blocked" and layer_cache is None and T > ATTENTION_BLOCK:
            # positions 0…T−1: the queries of block i see only the keys up to the end of block i
            # (the rest are masked), so each block's QKᵀ and AV skip those keys.
            context = jnp.concatenate([
                explicit(q[:, start:end], k[:, :end], v[:, :end], where.queries(start, end, end), False)
                for start in range(0, T, ATTENTION_BLOCK) for end in [min(start + ATTENTION_BLOCK, T)]
            ], axis=1)
        elif cfg.attention in ("explicit", "blocked"):
            context = explicit(q, k, v, where)
        else:
            bias = alibi(where)
            context = jax.nn.dot_product_attention(
                q, k, v, bias=None if bias is None else bias.astype(q.dtype), mask=where.mask(),
                implementation=cfg.attention
            )
        out = Linear((cfg.d_model,), cfg, n_in=2, use_bias=cfg.bias, residual=True, name="c_proj")(context)
        return out, layer_cache


def linear_context(cfg: GPTConfig, q, k, v, where: Where, layer_cache=None):
    """attention='linear': ops.linear_attention of φ(Q), φ(K), V (φ = cfg.linear_feature). With
    a layer cache (S, z, absorb) the tokens also read the state of the earlier ones, and the
    ones marked absorb join it: one token at a time, this is the recurrent form
    S_t = S_{t−1} + φ(k_t) v_tᵀ, z_t = z_{t−1} + φ(k_t), out_t = φ(q_t)ᵀS_t / (φ(q_t)ᵀz_t + ε).
    Returns the context (B, T, H, D) and the new (S, z) or None."""
    phi = ops.FEATURE_MAPS[cfg.linear_feature]
    fq, fk = phi(q), phi(k)
    if layer_cache is None:
        return ops.linear_attention(fq, fk, v, where.mask()), None
    S, z, absorb = layer_cache
    mask = where.mask() & absorb[:, None, None, :]
    context = ops.linear_attention(fq, fk, v, mask, (S, z))
    return context, ops.linear_attention_state(fk, v, absorb, (S, z))


class MLP(nn.Module):
    """FFN(X) = act(X W₁ + b₁) W₂ + b₂; for gated activations X W₁ is [XW, XV] and act halves it.

    With ffn_layers = n: H₁ = act(X W₁ + b₁), H_i = act(H_{i−1} W_i + b_i) for i = 2…n (each
    d_ff → d_ff: params c_fc_2 … c_fc_n), FFN(X) = H_n W_out + b_out (c_proj); ffn_dropout
    applies to each H_i. Gated activations are refused for n > 1 (GPTConfig)."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x, deterministic=True):
        cfg = self.cfg
        act, drop = ops.ACTIVATIONS[cfg.activation], Dropout(cfg.ffn_dropout)
        width = cfg.d_ff * (2 if cfg.activation in ops.GATED_ACTIVATIONS else 1)
        h = drop(act(Linear((width,), cfg, use_bias=cfg.bias, name="c_fc")(x)), deterministic)
        for i in range(2, cfg.ffn_layers + 1):
            h = drop(act(Linear((cfg.d_ff,), cfg, use_bias=cfg.bias, name=f"c_fc_{i}")(h)), deterministic)
        return Linear((cfg.d_model,), cfg, use_bias=cfg.bias, residual=True, name="c_proj")(h)


class Block(nn.Module):
    """Pre-norm:  Y = X + MHA(LN₁(X)),  Z = Y + FFN(LN₂(Y))
    Post-norm: Y = LN₁(X + MHA(X)),  Z = LN₂(Y + FFN(Y))
    Parallel:  Z = X + MHA(LN₁(X)) + FFN(LN₁(X))"""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x, where: Where, layer_cache=None, deterministic=True):
        cfg = self.cfg
        ln_1, attn, mlp = make_norm(cfg, "ln_1"), CausalSelfAttention(cfg, name="attn"), MLP(cfg, name="mlp")
        drop = lambda h: Dropout(cfg.dropout)(h, deterministic)  # noqa: E731
        mha = lambda h: attn(h, where, layer_cache, deterministic=deterministic)  # noqa: E731
        ffn = lambda h: mlp(h, deterministic)  # noqa: E731

        if cfg.parallel_block:
            h = ln_1(x)
            a, layer_cache = mha(h)
            return x + drop(a) + drop(ffn(h)), layer_cache
        ln_2 = make_norm(cfg, "ln_2")
        if cfg.norm_position == "pre":
            a, layer_cache = mha(ln_1(x))
            y = x + drop(a)
            return y + drop(ffn(ln_2(y))), layer_cache
        a, layer_cache = mha(x)
        y = ln_1(x + drop(a))
        return ln_2(y + drop(ffn(y))), layer_cache


def locate(tokens, cache, positions=None, segments=None):
    """(positions (B, T), the Where of the blocks, the cache with the new tokens' positions and
    segments written) for tokens (B, T): positions default to 0…T−1, after a cache cache.index…"""
    T = tokens.shape[-1]
    if positions is None:
        positions = jnp.arange(T)[None, :] if cache is None else cache.index[:, None] + jnp.arange(T)[None, :]
    if cache is None:
        return positions, Where(positions, positions, segments, segments), cache
    if isinstance(cache, LinearCache):  # the new tokens see each other causally, and the state
        if segments is not None:
            raise ValueError("attention='linear' decodes one sequence per row: segments cannot be given with its cache")
        return positions, Where(positions, positions), cache
    segments = jnp.zeros(tokens.shape, jnp.int32) if segments is None else segments
    cache = cache.replace(positions=write_rows(cache.positions, jnp.broadcast_to(positions, tokens.shape), cache.index),
                          segments=write_rows(cache.segments, segments, cache.index))
    return positions, Where(positions, cache.positions, segments, cache.segments), cache


class GPT(nn.Module):
    """tokens (B, T) → logits (B, T, V) = LN_f(Blocks(E[x] + P)) W_U (+ b_U with logits_bias).

    positions (B, T): each token's position, default 0…T−1 (with a cache: cache.index …
    cache.index+T−1). segments (B, T): with several examples packed in a row, the example
    each token belongs to (their positions restart at 0): attention is causal within an
    example and never crosses into another. None: the row is one sequence.

    With `cache`, the tokens are written into the slots cache.index … cache.index+T−1 of
    each row with their keys, values, positions and segments, and `(logits, new_cache)` is
    returned; a LinearCache (attention='linear') absorbs them into its state instead. With
    cfg.scan_layers the blocks are one nn.scan over params["h"] (see layers_as). Dropout is
    applied only when deterministic=False and a 'dropout' RNG is given.
    """

    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens, cache: KVCache | LinearCache | None = None, *, positions=None, segments=None,
                 deterministic: bool = True):
        cfg = self.cfg
        deterministic = deterministic or not self.has_rng("dropout")
        T = tokens.shape[-1]
        positions, where, cache = locate(tokens, cache, positions, segments)

        wte = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=normal(embedding_std(cfg)),
                       dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype, name="wte")
        x = wte(tokens)
        if cfg.positions == "learned":
            wpe = nn.Embed(cfg.block_size, cfg.d_model, embedding_init=normal(embedding_std(cfg)),
                           dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype, name="wpe")
            x = x + wpe(positions)
        elif cfg.positions == "sinusoidal":
            table = ops.sinusoidal_positions(cfg.block_size, cfg.d_model)
            x = x + table[positions].astype(x.dtype)
        x = self.perturb("embeddings", x)  # a zero 'perturbations' entry: its gradient is ∂/∂X
        x = Dropout(cfg.dropout)(x, deterministic)

        # With remat, a block keeps only its weight-matmul outputs for the backward pass and
        # recomputes attention and the elementwise ops from them.
        block = nn.remat(Block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                         static_argnums=(4,)) if cfg.remat else Block
        layer_caches = None if cache is None else [cache.layer(layer, positions) for layer in range(cfg.n_layer)]
        if cfg.scan_layers:  # one block's program run n_layer times, its params stacked on a leading axis
            scanned = None if cache is None else jax.tree.map(lambda *layers: jnp.stack(layers), *layer_caches)
            blocks = nn.scan(block, variable_axes={"params": 0, "intermediates": 0},
                             split_rngs={"params": True, "dropout": True},
                             in_axes=(nn.broadcast, 0, nn.broadcast), length=cfg.n_layer)
            x, scanned = blocks(cfg, name="h")(x, where, scanned, deterministic)
            new_layers = [None if cache is None else jax.tree.map(lambda a, i=i: a[i], scanned)
                          for i in range(cfg.n_layer)]
        else:
            new_layers = []
            for layer in range(cfg.n_layer):
                layer_cache = None if cache is None else layer_caches[layer]
                x, layer_cache = block(cfg, name=f"h_{layer}")(x, where, layer_cache, deterministic)
                new_layers.append(layer_cache)

        x = make_norm(cfg, "ln_f")(x)
        if cfg.tie_embeddings:  # W_U = Eᵀ
            logits = ops.linear(x.astype(cfg.compute_dtype), wte.embedding.T.astype(cfg.compute_dtype))
        else:
            logits = Linear((cfg.vocab_size,), cfg, use_bias=False, name="lm_head")(x)
        if cfg.logits_bias:  # b_U
            logits = logits + self.param("logits_bias", nn.initializers.zeros, (cfg.vocab_size,), cfg.params_dtype)
        logits = logits.astype(jnp.float32)
        if cache is None:
            return logits
        return logits, cache.with_layers(new_layers, T)


# --- the blocks' parameter layouts ------------------------------------------------------------

BLOCK_NAME = re.compile(r"h_(\d+)")


def _per_layer(node) -> bool:
    return isinstance(node, dict) and "h_0" in node


def _stacked(node) -> bool:
    return isinstance(node, dict) and isinstance(node.get("h"), dict)


def stack_layers(tree):
    """The loop's layout → scan_layers': in every dict holding blocks h_0 … h_{L−1} (params, and
    the optimizer state's moments, which mirror them), they become one 'h' whose leaves are
    the L layers' leaves stacked on a new leading axis."""
    def stack(node):
        if not _per_layer(node):
            return node
        layers = sorted((int(m[1]), key) for key in node if (m := BLOCK_NAME.fullmatch(key)))
        rest = {key: value for key, value in node.items() if not BLOCK_NAME.fullmatch(key)}
        return {**rest, "h": jax.tree.map(lambda *leaves: jnp.stack(leaves), *(node[key] for _, key in layers))}

    return jax.tree.map(stack, tree, is_leaf=_per_layer)


def unstack_layers(tree):
    """scan_layers' layout → the loop's: each stacked 'h' becomes h_0 … h_{L−1}."""
    def unstack(node):
        if not _stacked(node):
            return node
        n_layer = jax.tree.leaves(node["h"])[0].shape[0]
        rest = {key: value for key, value in node.items() if key != "h"}
        return {**rest, **{f"h_{i}": jax.tree.map(lambda a, i=i: a[i], node["h"]) for i in range(n_layer)}}

    return jax.tree.map(unstack, tree, is_leaf=_stacked)


def layers_as(tree, cfg: GPTConfig):
    """`tree` (params or anything mirroring them) in the layout cfg.scan_layers asks for,
    whichever layout it is in."""
    if cfg.scan_layers:
        return stack_layers(tree)
    return unstack_layers(tree)


# --- sizes ----------------------------------------------------------------------------------


def param_count(cfg: GPTConfig) -> int:
    """The number of parameters, in closed form from the shapes."""
    d, f, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
    b = 1 if cfg.bias else 0
    norm = d * (1 + (b if cfg.norm == "layernorm" else 0))
    hidden = f * (2 if cfg.activation in ops.GATED_ACTIVATIONS else 1)
    q, kv = cfg.n_head * cfg.head_dim, 2 * cfg.n_kv_head * cfg.head_dim  # widths of Q and of [K, V]
    attn = (d + b) * (q + kv) + q * d + b * d
    mlp = (d + b) * hidden + (cfg.ffn_layers - 1) * (f + b) * f + f * d + b * d
    norms_per_block = 1 if cfg.parallel_block else 2
    block = attn + mlp + norms_per_block * norm
    embeddings = V * d + (cfg.block_size * d if cfg.positions == "learned" else 0)
    head = 0 if cfg.tie_embeddings else V * d
    return embeddings + cfg.n_layer * block + norm + head + (V if cfg.logits_bias else 0)


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weight matmuls (forward 2N, backward 4N) plus
    12·n_layer·n_head·head_dim·seq_len for QKᵀ and AV. N counts parameters used in matmuls: all but
    the position table and, when untied, the input embedding (lookups cost no FLOPs)."""
    n = param_count(cfg)
    if cfg.positions == "learned":
        n -= cfg.block_size * cfg.d_model
    if not cfg.tie_embeddings:
        n -= cfg.vocab_size * cfg.d_model
    return 6 * n + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len
