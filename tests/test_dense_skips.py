"""Dense skips (model.dense_skips = w, jaxgpt.stack): the input of every layer ℓ ≥ 1 is its last hidden
state h_ℓ plus Σ_{j<ℓ} a_ℓj(t)·h_j, a_ℓ(t) = W2_ℓᵀ GELU(W1_ℓᵀ RMSNorm(h_ℓ(t))) + b_ℓ. Against the float64
reference of tests/reference.py (every block form, beside the U-net's skips), decode == forward for each
attention form's cache, the scanned layout against the loop (with the U-net's skips and value embeddings:
three carries), the declarations and the starting point (the model without the skips), the GPT-2
export's refusal and bad settings in one line (scan_layers alone: tests/test_scan_layers.py; resume:
tests/test_multi_token.py's run; fine-tuning: tests/test_user_commands.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from test_model import (
    RECIPE,
    decode_step_by_step,
    decodes_as_forward,
    forward,
    init_params,
    matches_reference,
    random_params,
    tiny,
    tokens,
)

from jaxgpt import GPT, ComputeConfig, GPTConfig, convert, ops
from jaxgpt.blocks import layers_as, unstack_layers
from jaxgpt.model import param_layout

CASES = {
    "L=3": {"n_layer": 3, "dense_skips": 5},
    "L=4,post-norm,rmsnorm": {"n_layer": 4, "dense_skips": 3, "norm_position": "post", "norm": "rmsnorm"},
    "parallel,gqa": {"n_layer": 3, "dense_skips": 4, "parallel_block": True, "n_head": 4, "n_kv_head": 2},
    "recipe,unet": {**RECIPE, "n_layer": 4, "dense_skips": 6, "unet_skips": True},
}


@pytest.mark.parametrize("changes", CASES.values(), ids=CASES.keys())
def test_forward_matches_float64_reference(changes):
    cfg = tiny(**changes)
    _, want = matches_reference(cfg)
    without = ref.gpt_forward(cfg.replace(dense_skips=0), jax.device_get(random_params(cfg)),
                              np.asarray(tokens(cfg, 2, 9)))
    assert np.abs(want - without).max() > 1e-3  # the skips did act


@pytest.mark.parametrize("form", [{}, {"attention": "local", "window": 3}, {"attention": "linear"}], ids=str)
def test_decode_equals_forward(form):
    """The weights and the states they weigh are the decoded token's own: the cache needs nothing more."""
    decodes_as_forward(tiny(n_layer=3, dense_skips=4, **form))


def test_scan_computes_the_loop_beside_the_unet_and_value_embeds():
    """Under compute.scan_layers the scan carries h_0 … h_{L−2} beside the U-net's outputs: the same
    logits, loss, gradients (those of the padding are not params) and decode as the loop."""
    cfg = tiny(**{**CASES["recipe,unet"], "value_embeds": ((0, 3),)})
    params, scan = random_params(cfg), ComputeConfig(scan_layers=True)
    stacked = layers_as(params, True)
    x = tokens(cfg, 2, 9)
    whole = forward(cfg, params, x)
    np.testing.assert_allclose(forward(cfg, stacked, x, compute=scan), whole, atol=1e-5, rtol=1e-5)

    def grads(compute, p):
        loss = lambda q: ops.cross_entropy(GPT(cfg, compute).apply({"params": q}, x[:, :-1]), x[:, 1:])  # noqa: E731
        return jax.jit(jax.grad(loss))(p)

    scanned, loop = unstack_layers(grads(scan, stacked)), grads(ComputeConfig(), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6), scanned, loop)
    assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(loop["dense_skips"]))
    np.testing.assert_allclose(decode_step_by_step(cfg, stacked, x, 4, cfg.block_size, compute=scan), whole,
                               atol=1e-5, rtol=1e-5)


def test_layout_groups_and_starting_point():
    """W1_ℓ (embed, skip_width) a matrix (Muon's, decayed) read along d; W2_ℓ (skip_width, skip_sources) and
    b_ℓ (skip_sources) scalars (AdamW, no decay) of ℓ weights, at zero: a fresh model computes what the model
    without the skips computes from the same weights, and W2 is the first to learn."""
    cfg = tiny(n_layer=3, dense_skips=5)
    got = {name: (leaf.names, leaf.inputs, leaf.group, leaf.value.shape)
           for name, leaf in param_layout(cfg)["dense_skips"].items()}
    assert got == {**{f"w1_{layer}": (("embed", "skip_width"), 1, "matrix", (16, 5)) for layer in (1, 2)},
                   **{f"w2_{layer}": (("skip_width", "skip_sources"), 0, "scalar", (5, layer)) for layer in (1, 2)},
                   **{f"b_{layer}": (("skip_sources",), 0, "scalar", (layer,)) for layer in (1, 2)}}
    fresh = init_params(cfg)
    assert not any(np.any(np.asarray(fresh["dense_skips"][f"{name}_{layer}"])) for name in ("w2", "b")
                   for layer in (1, 2))
    x = tokens(cfg, 2, 9)
    without = {name: value for name, value in fresh.items() if name != "dense_skips"}
    np.testing.assert_array_equal(forward(cfg, fresh, x), forward(cfg.replace(dense_skips=0), without, x))
    loss = lambda p: ops.cross_entropy(GPT(cfg).apply({"params": p}, x[:, :-1]), x[:, 1:])  # noqa: E731
    first = jax.grad(loss)(fresh)["dense_skips"]
    assert all(np.abs(first[f"w2_{layer}"]).max() > 0 and not np.any(first[f"w1_{layer}"]) for layer in (1, 2))


def test_gpt2_export_refuses_in_one_line():
    with pytest.raises(ValueError, match="dense_skips=64: GPT-2's blocks read only the block before") as error:
        convert.config_to_hf(tiny(d_model=32, dense_skips=64))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("changes", [{"dense_skips": -1}, {"dense_skips": True}, {"dense_skips": 2.0},
                                     {"dense_skips": 4, "n_layer": 1}], ids=str)
def test_bad_settings_are_one_line(changes):
    value = changes["dense_skips"]
    with pytest.raises(ValueError, match=f"GPTConfig.dense_skips={value!r}") as error:
        GPTConfig(**{"vocab_size": 11, "block_size": 8, "n_layer": 2, "n_head": 2, "d_model": 8, **changes})
    assert "\n" not in str(error.value)
    if "n_layer" not in changes:
        assert "must be 0 (no dense skips)" in str(error.value)


def test_bfloat16_compute_in_either_layout():
    """In bf16 compute the carried states are the stream's dtype: either layout gives float32's logits within
    bf16's rounding (here, as without the skips, under 2% of the largest logit)."""
    cfg = tiny(n_layer=3, dense_skips=4)
    params, x = random_params(cfg), tokens(cfg, 2, 9)
    want = np.asarray(forward(cfg, params, x))
    for scanned in (False, True):
        got = forward(cfg, layers_as(params, scanned), x, compute=ComputeConfig(dtype="bfloat16", scan_layers=scanned))
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, atol=0.03 * np.abs(want).max())
