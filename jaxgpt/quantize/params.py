"""Params in the form a compute config reads them, int8 weights included (ComputeConfig.weights).

    params = params_for(float_params, cfg, compute)    # what GPT(cfg, compute) reads

With weights="int8" every weight matrix W becomes int8 q, outputs first, and a float32 scale
per output channel (layers.quantize): a Linear's kernel (input dims…, output dims…) becomes
kernel_q (output dims…, input dims…) and kernel_scale (output dims…); the token embedding E
(V, d), outputs first already for the tied unembedding, becomes embedding_q (V, d) and
embedding_scale (V,). Biases, norms and the position table stay floats, in param_dtype. Which
params are matrices and what shapes they take come from the int8 model's own declaration
(GPT(cfg, compute) traced by jax.eval_shape), not from a table of paths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxgpt.blocks import layers_as, unstack_layers
from jaxgpt.config import ComputeConfig, GPTConfig
from jaxgpt.model import GPT, param_layout
from jaxgpt.quantize.layers import quantize

Q, SCALE = "_q", "_scale"


def params_for(params, cfg: GPTConfig, compute: ComputeConfig) -> dict:
    """Float params (any float dtype, either layer layout) as GPT(cfg, compute) reads them: in
    compute.param_dtype, their weight matrices int8 when compute.weights='int8', in compute's
    layer layout. ValueError when they are not params of cfg."""
    if compute.weights == "float":
        return layers_as(jax.tree.map(lambda x: x.astype(compute.params_dtype), params), compute.scan_layers)
    return layers_as(quantize_params(unstack_layers(params), cfg, compute), compute.scan_layers)


def int8_shapes(cfg: GPTConfig, compute: ComputeConfig) -> dict:
    """The shapes and dtypes of GPT(cfg, compute)'s params, per layer (nothing is computed)."""
    model = GPT(cfg, compute.replace(scan_layers=False))
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(lambda t: model.init(jax.random.key(0), t)["params"], tokens)


def quantize_params(params, cfg: GPTConfig, compute: ComputeConfig) -> dict:
    """Per-layer float params → the per-layer int8 params of GPT(cfg, compute) (weights='int8')."""
    wanted = int8_shapes(cfg, compute)
    declared = param_layout(GPT(cfg, compute.replace(weights="float", scan_layers=False)))
    quantized = _quantize_node(params, wanted, declared, "params")
    got = jax.tree.map(lambda x: (x.shape, x.dtype), quantized)
    if got != jax.tree.map(lambda x: (x.shape, x.dtype), wanted):
        raise ValueError("the params do not have the shapes of the model config's params, so they cannot be quantised "
                         "for it: give the params and config of one model")
    return quantized


def _quantize_node(node, wanted, declared, path: str):
    """`node` of the float params made like `wanted`, a node of the int8 model's params; which
    axes of a matrix are its inputs is the float parameter's declaration (`declared`): a weight
    matrix's leading `inputs`, a lookup table's last axis (its rows are the outputs of the tied
    unembedding)."""
    if not isinstance(wanted, dict):
        return node.astype(wanted.dtype)
    if not isinstance(node, dict):
        raise ValueError(f"the params have no {path}/{', '.join(wanted)}: they are not params of this model config")
    out = {}
    for name, value in node.items():
        if name + Q in wanted:
            table = declared[name].group == "embed"
            n_out = value.ndim - (1 if table else declared[name].inputs)
            out[name + Q], out[name + SCALE] = quantize_matrix(value, n_out, not table)
        elif name in wanted:
            out[name] = _quantize_node(value, wanted[name], declared[name], f"{path}/{name}")
    return out


@functools.partial(jax.jit, static_argnums=(1, 2))
def quantize_matrix(w, n_out: int, inputs_first: bool):
    """(q, s) of layers.quantize for a float matrix with n_out output dims, its inputs first
    (a Dense kernel) or last (an Embed table): q is outputs first either way."""
    n_in = w.ndim - n_out
    if inputs_first:
        w = jnp.transpose(w, (*range(n_in, w.ndim), *range(n_in)))
    return quantize(w, n_in)


def check_params(params, compute: ComputeConfig) -> None:
    """ValueError (one line) when params are float and compute reads int8 weights, or the reverse."""
    held = "int8" if any(leaf.dtype == jnp.int8 for leaf in jax.tree.leaves(params)) else "float"
    if (held == "int8") != (compute.weights == "int8"):
        raise ValueError(f"the params hold {held} weights but compute.weights={compute.weights!r}: make them with "
                         "load_run(..., compute=compute) or jaxgpt.quantize.params_for(params, cfg, compute)")
