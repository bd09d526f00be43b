"""The stack of blocks, and the two paths around them a GPTConfig may add (docs/MATH.md §15).

Block ℓ (ℓ = 0 … L−1) maps its input X_ℓ to its output Z_ℓ, and X_{ℓ+1} = Z_ℓ:

    value embeddings  (value_embeds)  V_ℓ ← V_ℓ + λ_ℓ · VE_{k(ℓ)}[x]   in the attention of each chosen layer
    U-net skips       (unet_skips)    X_{L−1−i} ← X_{L−1−i} + w_i · Z_i   for i = 0 … ⌊L/2⌋ − 1

VE_k (V, n_kv_head, head_dim) is a table of token rows (group "embed"), shared by the layers
that config.value_embeds lists for it; λ_ℓ and w_i are learned scalars (group "scalar"), λ
starting at ½ and w at 1. Both read only the current token or the current position, so
decoding with a cache and packed rows need nothing more.

VE_k[x] depends on the tokens and the tables alone, so it may be looked up before the blocks run
(looked_up, from a GPT's params) and given to the model (GPT's value_rows): the train step looks up
a whole step's rows once, outside its loop of micro-batches, and returns their gradient to the
tables once after it (jaxgpt.train.step).

The blocks run in a loop (params h_0 … h_{L−1}) or, with compute.scan_layers, as one nn.scan
(params h, stacked): there a layer's table, gate and skip are picked by index from what the
scan carries (the first half's outputs) and broadcasts (the tables' rows), a weight of 0 where
a layer has none, so the params' tree is the loop's stacked and blocks.layers_as converts it.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt import axes, layout
from jaxgpt.axes import rows_split
from jaxgpt.blocks import STACKED, block_name
from jaxgpt.model_config import ComputeConfig, GPTConfig, value_embed_layers

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


# --- the stack --------------------------------------------------------------------------------


def blocks(block, cfg, compute, x, tokens, where, layer_caches: list, deterministic: bool, table_init,
           value_rows=None):
    """The n_layer blocks of class `block` (model.Block, or its remat), each with its layer of
    the cache (None without one), with the value embeddings and U-net skips cfg asks for:
    (x, the layers' new caches). Made inside GPT's call, so their params are GPT's. value_rows:
    the value tables' rows of `tokens`, looked up before (looked_up); None: looked up here."""
    rows, gates = ValueEmbeds(cfg, compute, table_init, name=VALUE_EMBEDS)(tokens, value_rows) \
        if cfg.value_embeds else (None, {})
    weights = UNet(cfg.n_layer, compute.params_dtype, name="unet")() if cfg.unet_skips else {}
    if compute.scan_layers:
        return _scanned(block, cfg, compute, x, where, layer_caches, deterministic, rows, _plan(cfg, gates, weights))
    tables, sources = value_embed_layers(cfg.value_embeds, cfg.n_layer), skip_sources(cfg.n_layer)
    outputs, new_layers = [], []
    for layer in range(cfg.n_layer):
        if layer in weights:
            x = add_skip(x, weights[layer], outputs[sources[layer]])
        value_embed = (gates[layer], rows[tables[layer]]) if layer in gates else None
        x, layer_cache = block(cfg, compute, name=block_name(layer))(x, where, layer_caches[layer], deterministic,
                                                                 value_embed)
        outputs.append(x)
        new_layers.append(layer_cache)
    return x, new_layers


def _plan(cfg, gates: dict, weights: dict) -> dict:
    """What each layer of the scan reads, stacked on a leading axis of L: its gate and table
    (gate 0 where it adds none), its skip's weight and source (weight 0 where it has none), and
    whether its output is kept for the second half, in which slot."""
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
    return plan


def _scanned(block, cfg, compute, x, where, layer_caches: list, deterministic: bool, rows, plan: dict):
    """The blocks as one nn.scan over their params stacked on a leading axis (params h), the
    first half's outputs carried for the U-net's second half."""
    cache = None if layer_caches[0] is None else jax.tree.map(lambda *layers: jnp.stack(layers), *layer_caches)
    kept = jnp.zeros((cfg.n_layer // 2, *x.shape), x.dtype) if "weight" in plan else None
    layers = nn.scan(Layer, variable_axes={"params": 0, "intermediates": 0},
                     split_rngs={"params": True, "dropout": True},
                     in_axes=(nn.broadcast, 0, nn.broadcast, nn.broadcast, 0), length=cfg.n_layer,
                     metadata_params={nn.PARTITION_NAME: layout.LAYERS})
    (x, _), cache = layers(block, cfg, compute, name=STACKED)((x, kept), where, cache, deterministic, rows, plan)
    return x, [None if cache is None else jax.tree.map(lambda a, i=i: a[i], cache) for i in range(cfg.n_layer)]


class Layer(nn.Module):
    """One layer of the scan: the U-net skip into its input, the block, its output kept in its
    slot. The block shares this module's scope, so its params keep the block's own names."""

    block: Any  # model.Block or its remat
    cfg: GPTConfig
    compute: ComputeConfig

    def setup(self):
        self.inner = self.block(self.cfg, self.compute)
        nn.share_scope(self, self.inner)

    def __call__(self, carry, where, layer_cache, deterministic: bool, rows, plan: dict):
        x, kept = carry
        if kept is not None:
            x = add_skip(x, plan["weight"], kept[plan["source"]])
        value_embed = None if rows is None else (plan["gate"], rows[plan["table"]])
        x, layer_cache = self.inner(x, where, layer_cache, deterministic, value_embed)
        if kept is not None:
            kept = kept.at[plan["slot"]].set(jnp.where(plan["keep"], x, kept[plan["slot"]]))
        return (x, kept), layer_cache
