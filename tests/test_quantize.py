"""Narrow weights for sampling (ComputeConfig.param_dtype, .weights): int8 quantisation
(jaxgpt.quantize.layers: quantize, int8_linear in each of compute.matmul's forms) against a
float64 NumPy evaluation of its formula, the int8 model against the float model it
approximates, and generation with bfloat16 and int8."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model import random_params

from jaxgpt import GPT, ComputeConfig, GPTConfig
from jaxgpt.config import default_config
from jaxgpt.decode import sampling
from jaxgpt.decode.logits import start_cache
from jaxgpt.errors import ConfigError
from jaxgpt.platforms import forms
from jaxgpt.quantize import params_for
from jaxgpt.quantize.layers import dequantize, int8_linear, quantize
from jaxgpt.train.run import compute_config

INT8 = ComputeConfig(weights="int8")
BF16 = ComputeConfig(dtype="bfloat16", param_dtype="bfloat16")


def tiny(**changes):
    return GPTConfig(**{**dict(vocab_size=23, block_size=8, n_layer=2, n_head=2, d_model=16), **changes})


def quantize64(w, n_in):
    """The formula in float64: s_o = max_i |W_oi|/127 (1 for an all-zero channel), q = round(W/s)."""
    w = np.asarray(w, np.float64)
    peak = np.abs(w).reshape(*w.shape[:w.ndim - n_in], -1).max(axis=-1)
    scale = np.where(peak > 0, peak / 127, 1.0)
    return np.clip(np.round(w / scale.reshape(*scale.shape, *(1,) * n_in)), -127, 127), scale


@pytest.mark.parametrize("shape, n_in", [((7, 5), 1), ((3, 4, 6), 1), ((6, 2, 5), 2)])
def test_quantize_is_the_formula_within_half_a_step(shape, n_in):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 0.3
    w[1] = 0.0  # an all-zero output channel
    q, scale = jax.device_get(quantize(jnp.asarray(w), n_in))
    want_q, want_scale = quantize64(w, n_in)
    assert q.dtype == np.int8 and q.shape == shape and scale.shape == shape[:len(shape) - n_in]
    np.testing.assert_allclose(scale, want_scale, rtol=1e-6)
    np.testing.assert_array_equal(q, want_q)
    steps = want_scale.reshape(*want_scale.shape, *(1,) * n_in)
    error = np.abs(np.asarray(dequantize(q, scale), np.float64) - w)
    assert np.all(error <= steps / 2 * (1 + 1e-6))
    assert np.all(np.abs(q).max(axis=tuple(range(q.ndim - n_in, q.ndim)))[np.arange(shape[0]) != 1] == 127)


@pytest.mark.parametrize("form", [*forms.MATMULS, forms.AUTO])
@pytest.mark.parametrize("rows", [1, 3])
def test_int8_linear_is_x_times_the_dequantised_transpose(rows, form):
    """y = x (q·s)ᵀ in float64, for one row (a decoding step) and several (a prefill), in each
    of compute.matmul's forms; 301 outputs make uneven chunks in the CPU's."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, 24)).astype(np.float32)
    q, scale = quantize(jnp.asarray(rng.standard_normal((301, 24)), jnp.float32))
    want = x.astype(np.float64) @ (np.asarray(q, np.float64) * np.asarray(scale, np.float64)[:, None]).T
    got = int8_linear(jnp.asarray(x), q, scale, form)
    assert got.shape == (rows, 301) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)


def dequantised(int8_params):
    """The float params (Flax's layouts) that int8 params stand for: W = (q·s) with the inputs
    put back first for a Dense kernel; the embedding table is outputs first already."""
    def node(tree):
        if not isinstance(tree, dict):
            return tree
        out = {}
        for name, value in tree.items():
            if name == "kernel_q":
                w = np.asarray(value, np.float32) * np.asarray(tree["kernel_scale"])[(...,) + (None,) * (
                    value.ndim - tree["kernel_scale"].ndim)]
                n_out = tree["kernel_scale"].ndim
                out["kernel"] = jnp.asarray(np.moveaxis(w, tuple(range(n_out)), tuple(range(w.ndim - n_out, w.ndim))))
            elif name == "embedding_q":
                scale = np.asarray(tree["embedding_scale"])[:, None]
                out["embedding"] = jnp.asarray(np.asarray(value, np.float32) * scale)
            elif not name.endswith("_scale"):
                out[name] = node(value)
        return out

    return node(jax.device_get(int8_params))


@pytest.mark.parametrize("changes, matmul", [({}, forms.AUTO), ({"tie_embeddings": False, "n_kv_head": 1}, forms.AUTO),
                                             ({}, "xla")])
def test_the_int8_model_is_the_float_model_with_the_dequantised_weights(changes, matmul):
    """With the int8 product in either form (compute.matmul: the CPU's chunks, or XLA's one product)."""
    cfg = tiny(**changes)
    params = random_params(cfg)
    int8 = params_for(params, cfg, INT8)
    assert all(leaf.dtype == jnp.int8 for path, leaf in jax.tree_util.tree_leaves_with_path(int8)
               if path[-1].key.endswith("_q"))
    tokens = jnp.array([[3, 1, 4, 1, 5, 9]])
    got = GPT(cfg, INT8.replace(matmul=matmul)).apply({"params": int8}, tokens)
    want = GPT(cfg).apply({"params": dequantised(int8)}, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_int8_logits_move_at_most_by_half_a_step_times_their_sensitivity():
    """|δW| ≤ s/2 per weight, so to first order |δ logits| ≤ Σ_w |∂logits/∂w| s_w/2: the bound
    the quantisation step allows (with room for the second-order terms)."""
    cfg = tiny()
    params, tokens = random_params(cfg), jnp.array([[3, 1, 4, 1, 5, 9]])
    int8 = params_for(params, cfg, INT8)
    half_steps = jax.tree.map(np.zeros_like, jax.device_get(params))

    def steps_of(tree, int8_tree):  # s/2 broadcast over each matrix in its float layout, 0 elsewhere
        for name, value in tree.items():
            if name == "kernel":
                tree[name] = value + np.asarray(int8_tree["kernel_scale"]) / 2
            elif name == "embedding" and "embedding_scale" in int8_tree:
                tree[name] = value + np.asarray(int8_tree["embedding_scale"])[:, None] / 2
            elif isinstance(value, dict):
                steps_of(value, int8_tree[name])

    steps_of(half_steps, jax.device_get(int8))
    logits = lambda p: GPT(cfg).apply({"params": p}, tokens)  # noqa: E731
    sensitivity = jax.jacrev(logits)(params)
    bound = sum(jnp.tensordot(jnp.abs(j), h, axes=h.ndim) for j, h in
                zip(jax.tree.leaves(sensitivity), jax.tree.leaves(half_steps), strict=True))
    moved = jnp.abs(GPT(cfg, INT8).apply({"params": int8}, tokens) - logits(params))
    assert float(moved.max()) > 0
    assert np.all(np.asarray(moved) <= 1.5 * np.asarray(bound) + 1e-5)


@pytest.mark.parametrize("compute", [BF16, INT8, INT8.replace(scan_layers=True)], ids=["bf16", "int8", "int8 scan"])
def test_generate_samples_with_narrow_weights(compute):
    cfg = tiny()
    params = random_params(cfg)
    narrow = params_for(params, cfg, compute)
    result = sampling.generate(narrow, cfg, [[5, 1, 7], [2]], 0, max_new_tokens=12, temperature=0.0, compute=compute)
    tokens = np.asarray(result.tokens)
    assert tokens.shape == (2, 3 + 12) and np.all((0 <= tokens) & (tokens < cfg.vocab_size))
    if compute.weights == "int8":  # the same function as the float model with the dequantised weights
        same = sampling.generate(dequantised(params_for(params, cfg, INT8)), cfg, [[5, 1, 7], [2]], 0,
                                 max_new_tokens=12, temperature=0.0)
        np.testing.assert_array_equal(tokens, np.asarray(same.tokens))


def test_the_kv_cache_is_in_the_compute_dtype():
    cfg = tiny()
    params = params_for(random_params(cfg), cfg, BF16)
    tokens, lengths = jnp.array([[1, 2, 3, 0]]), jnp.array([3])
    cache = start_cache(params, GPT(cfg, BF16), tokens, lengths, 3)
    assert {leaf.dtype for leaf in (*cache.keys, *cache.values)} == {jnp.dtype(jnp.bfloat16)}


def test_params_of_the_other_kind_are_refused_in_one_line():
    cfg = tiny()
    with pytest.raises(ValueError, match=r"^the params hold float weights but compute.weights='int8': make them"):
        sampling.generate(random_params(cfg), cfg, [[1]], 0, max_new_tokens=2, compute=INT8)
    with pytest.raises(ValueError, match="do not have the shapes of the model config's params"):
        params_for(random_params(cfg), tiny(d_model=32), INT8)


def test_training_refuses_int8_weights_in_one_line():
    config = default_config()
    config.compute.weights = "int8"
    with pytest.raises(ConfigError) as error:
        compute_config(config)
    assert re.fullmatch(r"compute.weights='int8' is weight-only quantisation for inference .*", str(error.value))
    assert "\n" not in str(error.value)
