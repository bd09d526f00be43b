"""The stack of blocks, and the paths around them a GPTConfig may add (docs/MATH.md §15).

Block ℓ (ℓ = 0 … L−1) maps its input X_ℓ to its output Z_ℓ, and X_{ℓ+1} = Z_ℓ:

    value embeddings  (value_embeds)  V_ℓ ← V_ℓ + λ_ℓ · VE_{k(ℓ)}[x]   in the attention of each chosen layer
    U-net skips       (unet_skips)    X_{L−1−i} ← X_{L−1−i} + w_i · Z_i   for i = 0 … ⌊L/2⌋ − 1
    dense skips       (dense_skips)   X_ℓ ← X_ℓ + Σ_{j<ℓ} a_ℓj(t) · h_j   for ℓ ≥ 1, h_0 = X_0, h_j = Z_{j−1},
                                      a_ℓ(t) = W2_ℓᵀ GELU(W1_ℓᵀ RMSNorm(h_ℓ(t))) + b_ℓ

VE_k (V, n_kv_head, head_dim) is a table of token rows (group "embed"), shared by the layers
that config.value_embeds lists for it; λ_ℓ and w_i are learned scalars (group "scalar"), λ
starting at ½ and w at 1. The dense skips' small MLP (W1_ℓ (d, w) a matrix, W2_ℓ and b_ℓ
scalars at zero, so the model starts as without them) weighs the earlier hidden states h_j(t)
of the same token t. All three read only the current token or the current position, so
decoding with a cache and packed rows need nothing more.

VE_k[x] depends on the tokens and the tables alone, so it may be looked up before the blocks run
(looked_up, from a GPT's params) and given to the model (GPT's value_rows): the train step looks up
a whole step's rows once, outside its loop of micro-batches, and returns their gradient to the
tables once after it (jaxgpt.train.step).

The blocks run in a loop (params h_0 … h_{L−1}) or, with compute.scan_layers, as one nn.scan
(params h, stacked): there a layer's table, gate and skip are picked by index from what the
scan carries (the first half's outputs; with dense skips every earlier hidden state) and
broadcasts (the tables' rows), a weight of 0 where a layer has none, so the params' tree is the
loop's stacked and blocks.layers_as converts it.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt import axes, layout, ops
from jaxgpt.axes import rows_split
from jaxgpt.blocks import STACKED, block_name
from jaxgpt.model_config import ComputeConfig, GPTConfig, paired_layers, value_embed_layers

GATE_INIT = 0.5  # λ at first: the speedrun mixed ½·V + ½·VE[x]
VALUE_EMBEDS = "value_embeds"  # the module of the tables and gates, among GPT's params
SKIP_INIT = 1.0  # w at first: the speedrun's skip weights start at one


# --- which layers: the config read ------------------------------------------------------------


def skip_sources(n_layer: int) -> dict[int, int]:
    """{layer L−1−i: i} for i < ⌊L/2⌋: the layer whose input receives the output of layer i
    (with L odd, the middle layer receives none)."""
    return {n_layer - 1 - i: i for i in range(n_layer // 2)}


# --- the math ---------------------------------------------------------------------------------


def add_value_embedding(v, gate, rows):
    """V ← V + λ·VE[x]: v (B, T, H_kv, D) the layer's values, rows VE[x] (B, T, H_kv, D) the
    table's rows of the same tokens, gate λ a scalar."""
    return v + (gate * rows).astype(v.dtype)


def add_skip(x, weight, output):
    """X_{L−1−i} ← X_{L−1−i} + w_i·Z_i: x (B, T, d) the layer's input, output Z_i (B, T, d)."""
    return x + (weight * output).astype(x.dtype)


def dense_skip_weights(last, w1, w2, b, eps):
    """a(t) = W₂ᵀ GELU(W₁ᵀ RMSNorm(h(t))) + b: a layer's weights of its earlier hidden states, for each
    token read from its last hidden state `last` (B, T, d) by a small MLP, W₁ (d, w), W₂ (w, n), b (n,):
    (B, T, n). RMSNorm has no gain of its own (W₁ would absorb it); GELU is the exact x·Φ(x)."""
    hidden = ops.gelu_exact(ops.linear(ops.rms_norm(last, 1.0, eps), w1.astype(last.dtype)))
    return ops.linear(hidden, w2.astype(last.dtype)) + b.astype(last.dtype)


def add_dense_skips(x, weights, earlier):
    """X ← X + Σ_j a_j(t)·h_j(t): x (B, T, d) the layer's input, weights a (B, T, n) and earlier the n
    hidden states h_j (B, T, d) before its last (a list, or stacked on a leading axis), summed in float32
    one state at a time: no stacked copy of the states is made, nor kept for the backward pass."""
    mixed = sum(weights[..., j, None].astype(jnp.float32) * h.astype(jnp.float32) for j, h in enumerate(earlier))
    return x + mixed.astype(x.dtype)


# --- the params -------------------------------------------------------------------------------


def value_rows(tables, tokens, dtype) -> tuple:
    """VE_k[x] for every table k, each (*tokens.shape, H_kv, D) in `dtype`: each table gathered
    whole where it is read (axes.whole), its rows kept with their tokens' rows. A row is looked up
    as one vector of H_kv·D values: XLA's TPU lookup of (H_kv, D) blocks, and the scatter-add of
    its gradient, moved 1.7 times the bytes (docs/SCALE.md)."""
    def rows(table):
        vocab, *row = table.shape
        found = jnp.take(axes.whole(table).reshape(vocab, -1), tokens, axis=0).reshape(*tokens.shape, *row)
        return rows_split(found).astype(dtype)

    return tuple(rows(table) for table in tables)


def looked_up(cfg: GPTConfig, compute: ComputeConfig, params, tokens):
    """value_rows of the value tables among a GPT's `params` (theirs are ValueEmbeds'), in the compute
    dtype: what GPT(…, value_rows=…) reads in place of the tables."""
    tables = params[VALUE_EMBEDS]
    return value_rows([tables[f"table_{k}"] for k in range(len(cfg.value_embeds))], tokens, compute.compute_dtype)


def scalar(module: nn.Module, name: str, value: float, dtype):
    """A learned scalar (shape (), group "scalar") starting at `value`."""
    return module.param(name, layout.declare(nn.initializers.constant(value), ()), (), dtype)


class ValueEmbeds(nn.Module):
    """The tables VE_k (V, n_kv_head, head_dim), drawn by `table_init`, and the gates λ_ℓ of
    the layers that add them: params table_k and gate_ℓ."""

    cfg: GPTConfig
    compute: ComputeConfig
    table_init: Any

    @nn.compact
    def __call__(self, tokens, rows=None):
        """(VE_k[x] for every table k, stacked (K, B, T, H_kv, D), {layer ℓ: λ_ℓ}); `rows`: those
        VE_k[x] (value_rows), looked up before (looked_up), the tables then not read."""
        cfg, dtype = self.cfg, self.compute.params_dtype
        if rows is None:
            init = layout.declare(self.table_init, ("vocab", "kv_heads", "value_dim"), group="embed")
            shape = (cfg.vocab_size, cfg.n_kv_head, cfg.head_dim)
            tables = [self.param(f"table_{k}", init, shape, dtype) for k in range(len(cfg.value_embeds))]
            rows = value_rows(tables, tokens, self.compute.compute_dtype)
        gates = {layer: scalar(self, f"gate_{layer}", GATE_INIT, dtype)
                 for layer in sorted(value_embed_layers(cfg.value_embeds, cfg.n_layer))}
        return jnp.stack(rows), gates


class UNet(nn.Module):
    """The skip weights w_i: params w_i, i < ⌊L/2⌋."""

    n_layer: int
    dtype: Any

    @nn.compact
    def __call__(self) -> dict:
        """{layer L−1−i: w_i}."""
        return {target: scalar(self, f"w_{source}", SKIP_INIT, self.dtype)
                for target, source in skip_sources(self.n_layer).items()}


class DenseSkips(nn.Module):
    """The dense skips' small MLPs: params w1_ℓ (d, w), w2_ℓ (w, ℓ) and b_ℓ (ℓ,) of each layer ℓ ≥ 1,
    w = cfg.dense_skips. W1 is a matrix (Muon's, decayed) drawn N(0, 1/d), so that each hidden unit
    reads a unit-RMS state at unit scale; W2 and b are scalars (AdamW, no decay) at zero: every
    weight a starts at 0, and the model as without the skips."""

    cfg: GPTConfig
    dtype: Any

    @nn.compact
    def __call__(self) -> dict:
        """{layer ℓ: (W1_ℓ, W2_ℓ, b_ℓ)}."""
        d, width = self.cfg.d_model, self.cfg.dense_skips
        reads = layout.declare(nn.initializers.normal(d ** -0.5), ("embed", "skip_width"), inputs=1, group="matrix")
        writes = layout.declare(nn.initializers.zeros, ("skip_width", "skip_sources"))
        bias = layout.declare(nn.initializers.zeros, ("skip_sources",))
        return {layer: (self.param(f"w1_{layer}", reads, (d, width), self.dtype),
                        self.param(f"w2_{layer}", writes, (width, layer), self.dtype),
                        self.param(f"b_{layer}", bias, (layer,), self.dtype)) for layer in range(1, self.cfg.n_layer)}


# --- the stack --------------------------------------------------------------------------------


def blocks(block, cfg, compute, x, tokens, where, layer_caches: list, deterministic: bool, table_init,
           value_rows=None):
    """The n_layer blocks of class `block` (model.Block, or its remat), each with its layer of
    the cache (None without one), with the value embeddings, U-net and dense skips cfg asks for:
    (x, the layers' new caches). Made inside GPT's call, so their params are GPT's. value_rows:
    the value tables' rows of `tokens`, looked up before (looked_up); None: looked up here."""
    rows, gates = ValueEmbeds(cfg, compute, table_init, name=VALUE_EMBEDS)(tokens, value_rows) \
        if cfg.value_embeds else (None, {})
    weights = UNet(cfg.n_layer, compute.params_dtype, name="unet")() if cfg.unet_skips else {}
    mlps = DenseSkips(cfg, compute.params_dtype, name="dense_skips")() if cfg.dense_skips else {}
    if compute.scan_layers:
        plan = _plan(cfg, gates, weights, mlps)
        return _scanned(block, cfg, compute, x, where, layer_caches, deterministic, rows, plan)
    tables, sources = value_embed_layers(cfg.value_embeds, cfg.n_layer), skip_sources(cfg.n_layer)
    paired = paired_layers(cfg.paired_heads, cfg.n_layer)
    embedded, outputs, new_layers = x, [], []
    for layer in range(cfg.n_layer):
        if layer in weights:
            x = add_skip(x, weights[layer], outputs[sources[layer]])
        if layer in mlps:  # the weights of h_0 … h_{ℓ−1}, read from the last block's output h_ℓ
            a = dense_skip_weights(outputs[-1], *mlps[layer], cfg.norm_eps)
            x = add_dense_skips(x, a, [embedded, *outputs[:-1]])
        value_embed = (gates[layer], rows[tables[layer]]) if layer in gates else None
        x, layer_cache = block(cfg, compute, name=block_name(layer))(x, where, layer_caches[layer], deterministic,
                                                                 value_embed, layer in paired)
        outputs.append(x)
        new_layers.append(layer_cache)
    return x, new_layers


def _plan(cfg, gates: dict, weights: dict, mlps: dict) -> dict:
    """What each layer of the scan reads, stacked on a leading axis of L: its gate and table
    (gate 0 where it adds none), its skip's weight and source (weight 0 where it has none),
    whether its output is kept for the second half, in which slot, its dense skips' MLP
    (_dense_plan), and whether it pairs its heads (model.paired_heads)."""
    layers, plan = range(cfg.n_layer), {}
    if gates:
        tables, zero = value_embed_layers(cfg.value_embeds, cfg.n_layer), jnp.zeros_like(next(iter(gates.values())))
        plan["gate"] = jnp.stack([gates.get(layer, zero) for layer in layers])
        plan["table"] = jnp.array([tables.get(layer, 0) for layer in layers])
    if weights:
        sources, half, zero = skip_sources(cfg.n_layer), cfg.n_layer // 2, jnp.zeros_like(weights[cfg.n_layer - 1])
        plan["weight"] = jnp.stack([weights.get(layer, zero) for layer in layers])
        plan["source"] = jnp.array([sources.get(layer, 0) for layer in layers])
        plan["keep"] = jnp.array([layer < half for layer in layers])
        plan["slot"] = jnp.array([min(layer, half - 1) for layer in layers])
    if mlps:
        plan.update(_dense_plan(cfg.n_layer, mlps))
    if cfg.paired_heads:  # which layers pair their heads (model.CausalSelfAttention: nn.cond on it)
        plan["paired"] = jnp.array([layer in paired_layers(cfg.paired_heads, cfg.n_layer) for layer in layers])
    return plan


def _dense_plan(n_layer: int, mlps: dict) -> dict:
    """Each layer's dense-skip MLP padded to the L − 1 states the scan carries: W2_ℓ (w, ℓ) and
    b_ℓ (ℓ,) with zeros for the states h_ℓ … h_{L−2} it does not weigh, layer 0 all zeros (its
    weights a are exactly 0), and the slot its last state h_ℓ is kept in (slot L − 1: none)."""
    w1, w2, b = mlps[1]
    zero = (jnp.zeros_like(w1), jnp.zeros((w2.shape[0], 0), w2.dtype), jnp.zeros((0,), b.dtype))

    def padded(layer):
        reads, writes, bias = mlps.get(layer, zero)
        unread = n_layer - 1 - layer
        return reads, jnp.pad(writes, ((0, 0), (0, unread))), jnp.pad(bias, (0, unread))

    stacked = (jnp.stack(values) for values in zip(*map(padded, range(n_layer)), strict=True))
    return {**dict(zip(("w1", "w2", "b"), stacked, strict=True)), "state": jnp.arange(n_layer)}


def _scanned(block, cfg, compute, x, where, layer_caches: list, deterministic: bool, rows, plan: dict):
    """The blocks as one nn.scan over their params stacked on a leading axis (params h), the
    first half's outputs carried for the U-net's second half, and with dense skips the hidden
    states h_0 … h_{L−2}, L − 1 arrays of B × T × d (autodiff keeps the carry at every layer, of
    the order of L² states for the backward pass: L = 16, d = 128, 8 × 128 tokens on the CPU, the
    gradient's scratch memory grows by 165 MiB here, by 16 MiB in the loop)."""
    cache = None if layer_caches[0] is None else jax.tree.map(lambda *layers: jnp.stack(layers), *layer_caches)
    kept = jnp.zeros((cfg.n_layer // 2, *x.shape), x.dtype) if "weight" in plan else None
    states = jnp.zeros((cfg.n_layer - 1, *x.shape), x.dtype) if "w1" in plan else None
    layers = nn.scan(Layer, variable_axes={"params": 0, "intermediates": 0},
                     split_rngs={"params": True, "dropout": True},
                     in_axes=(nn.broadcast, 0, nn.broadcast, nn.broadcast, 0), length=cfg.n_layer,
                     metadata_params={nn.PARTITION_NAME: layout.LAYERS})
    (x, *_), cache = layers(block, cfg, compute, name=STACKED)((x, kept, states), where, cache, deterministic, rows,
                                                               plan)
    return x, [None if cache is None else jax.tree.map(lambda a, i=i: a[i], cache) for i in range(cfg.n_layer)]


class Layer(nn.Module):
    """One layer of the scan: the U-net and dense skips into its input, its last state kept for
    the dense skips of the layers after, the block, its output kept in its slot for the U-net.
    The block shares this module's scope, so its params keep the block's own names."""

    block: Any  # model.Block or its remat
    cfg: GPTConfig
    compute: ComputeConfig

    def setup(self):
        self.inner = self.block(self.cfg, self.compute)
        nn.share_scope(self, self.inner)

    def __call__(self, carry, where, layer_cache, deterministic: bool, rows, plan: dict):
        x, kept, states = carry
        last = x  # h_ℓ, the block before's output
        if kept is not None:
            x = add_skip(x, plan["weight"], kept[plan["source"]])
        if states is not None:
            x = add_dense_skips(x, dense_skip_weights(last, plan["w1"], plan["w2"], plan["b"], self.cfg.norm_eps),
                                states)
            states = states.at[plan["state"]].set(last, mode="drop")
        value_embed = None if rows is None else (plan["gate"], rows[plan["table"]])
        x, layer_cache = self.inner(x, where, layer_cache, deterministic, value_embed, plan.get("paired", False))
        if kept is not None:
            kept = kept.at[plan["slot"]].set(jnp.where(plan["keep"], x, kept[plan["slot"]]))
        return (x, kept, states), layer_cache
