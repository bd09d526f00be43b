"""Paired heads (model.paired_heads): heads 2j and 2j+1 of the layers named attend as one sequence of 2T
places, rotated at 2p + i, against the float64 reference of tests/reference.py (with the key offset, the
block forms, each positions scheme that pairs); the interleaving ops; decode == forward and a padded
prefill; packed == each example alone by each CPU kernel; remat; the per-token weights pictures draw; the
refusals in one line (scan_layers: tests/test_scan_layers.py; resume: tests/test_multi_token.py's run)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
import test_packed as packed
from test_model import (
    RECIPE,
    continues_as_if_alone,
    decodes_as_forward,
    matches_reference,
    random_params,
    tiny,
    tokens,
)

from jaxgpt import GPT, ComputeConfig, GPTConfig, convert, ops

CASES = {
    "rope,layer 0": {"paired_heads": (0,), "positions": "rope"},
    "recipe,key_offset,4 heads,both layers": {**RECIPE, "n_head": 4, "paired_heads": (0, -1), "key_offset": True},
    "learned,parallel": {"paired_heads": (1,), "parallel_block": True},
    "none,post-norm": {"paired_heads": (-1,), "positions": "none", "norm_position": "post"},
}


@pytest.mark.parametrize("changes", CASES.values(), ids=CASES.keys())
def test_forward_matches_float64_reference(changes):
    cfg = tiny(**changes)
    _, want = matches_reference(cfg)
    apart = ref.gpt_forward(cfg.replace(paired_heads=()), jax.device_get(random_params(cfg)),
                            np.asarray(tokens(cfg, 2, 9)))
    assert np.abs(want - apart).max() > 1e-3  # the pairing did act


def test_interleaving_places_and_its_inverse():
    """Place 2t+i of pair j holds head 2j+i of token t, at position 2p_t + i; unpair undoes pair."""
    x = jnp.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    y = ops.pair_heads(x)
    assert y.shape == (2, 6, 2, 5)
    for t, j, i in np.ndindex(3, 2, 2):
        np.testing.assert_array_equal(y[:, 2 * t + i, j], x[:, t, 2 * j + i])
    np.testing.assert_array_equal(ops.unpair_heads(y), x)
    np.testing.assert_array_equal(ops.pair_positions(jnp.array([[0, 1, 5]])), [[0, 1, 2, 3, 10, 11]])
    np.testing.assert_array_equal(ops.pair_segments(jnp.array([[1, 1, 2]])), [[1, 1, 1, 1, 2, 2]])


@pytest.mark.parametrize("changes", [{"paired_heads": (1,)}, {"paired_heads": (0, 1), "key_offset": True}],
                         ids=["layer 1", "both,key_offset"])
def test_decode_equals_forward(changes):
    """The cache keeps each token's heads; each read pairs every slot's, so one token at a time computes
    what one pass does."""
    decodes_as_forward(tiny(positions="rope", **changes))


def test_padded_prefill_rows_continue_as_if_alone():
    continues_as_if_alone(tiny(positions="rope", paired_heads=(0,)))


@pytest.mark.parametrize("kernel", ["explicit", "xla", "blocked"])
def test_packed_examples_pair_each_alone(kernel):
    """Every kernel computes the interleaved sequence, and no pair's place sees another example's."""
    cfg = packed.tiny(paired_heads=(0,), positions="rope", block_size=40)
    params = packed.init(cfg)
    (x, positions, segments), examples = packed.packed_row((11, 20, 6), cfg.block_size, np.random.default_rng(1))
    logits = GPT(cfg, ComputeConfig(kernel=kernel)).apply({"params": params}, x, positions=positions,
                                                           segments=segments)
    packed.assert_each_example_alone(cfg, params, logits, examples)


def test_remat_gives_the_same_gradients():
    """Under remat the loop's `paired` stays a static bool of each block."""
    cfg = tiny(paired_heads=(1,), positions="rope")
    params, x = random_params(cfg), tokens(cfg, 2, 9)
    grads = [jax.jit(jax.grad(lambda p, c=compute: ops.cross_entropy(GPT(cfg, c).apply({"params": p}, x[:, :-1]),
                                                                     x[:, 1:])))(params)
             for compute in (ComputeConfig(), ComputeConfig(remat=True))]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), *grads)


def test_pictures_get_each_heads_weights_per_token():
    """A paired layer records w_h[t, s], the weight head h at token t gives token s (both heads' keys):
    (B, H, T, T) as a plain layer's, rows summing to 1, nothing after t, and head 2j at t nothing of its
    partner's key at t (place 2t + 1 comes after 2t)."""
    cfg = tiny(paired_heads=(0,), positions="rope")
    _, state = GPT(cfg).apply({"params": random_params(cfg)}, tokens(cfg, 2, 9), mutable=["intermediates"])
    weights = np.asarray(state["intermediates"]["h_0"]["attn"]["attention_weights"][0])
    assert weights.shape == (2, 2, 9, 9)
    np.testing.assert_allclose(weights.sum(-1), 1, atol=1e-5)
    assert not np.triu(weights, 1).any()
    q, k, v = (np.zeros((1, 1, 2, 4)) for _ in range(3))
    np.testing.assert_allclose(ref.paired_attention(q, k + 1, v + np.arange(2)[:, None]), [[[[0] * 4, [0.5] * 4]]])


@pytest.mark.parametrize("changes, message", [
    ({"n_head": 1}, "paired_heads=(0,) with n_head=1: heads are paired 2j with 2j+1, so n_head must be even"),
    ({"n_head": 4, "n_kv_head": 2}, "paired_heads=(0,) with n_kv_head=2: paired heads read each other's keys"),
    ({"paired_heads": (0, 2)}, "paired_heads=(0, 2): n_layer=2 has layers 0 … 1"),
    ({"paired_heads": (1, -1)}, "a layer is named twice"),
    ({"paired_heads": "0"}, "paired_heads='0': must be a tuple of layer indices"),
], ids=["odd heads", "gqa", "no such layer", "twice", "not a tuple"])
def test_bad_settings_are_one_line(changes, message):
    with pytest.raises(ValueError) as error:
        tiny(**{"paired_heads": (0,), **changes})
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("changes, message", [
    ({"attention": "local", "window": 3}, ("paired_heads=(0,) with attention='local': ", "attention='softmax'")),
    ({"attention": "linear"}, ("paired_heads=(0,) with attention='linear': ",)),
    ({"positions": "alibi"}, ("paired_heads=(0,) with positions='alibi': ", "use positions='rope'")),
], ids=["local", "linear", "alibi"])
def test_what_cannot_pair_is_refused_in_one_line(changes, message):
    with pytest.raises(ValueError) as error:
        GPT(tiny(paired_heads=(0,), **changes))
    assert all(part in str(error.value) for part in message) and "\n" not in str(error.value)


def test_gpt2_export_refuses_in_one_line():
    with pytest.raises(ValueError) as error:
        convert.config_to_hf(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=8, paired_heads=(0,)))
    assert "paired_heads=(0,): GPT-2's heads attend apart" in str(error.value) and "\n" not in str(error.value)
