"""The modern recipe's model switches (configs/speedrun_*.py): zero-initialised output projections,
soft-capped logits, QK-norm and ReLU² with the features they meet. The float64 forward
(tests/test_model.py), the KV cache (tests/test_variants.py), scan_layers
(tests/test_scan_layers.py) and GPT-2 export (tests/test_convert.py) cover them in their own
files' lists; what is particular to them is here."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model import RECIPE, forward, init_params, random_params, tiny, tokens
from test_packed import LENGTHS, assert_each_example_alone, packed_row

from jaxgpt import GPT, GPTConfig, ops
from jaxgpt.analysis import circuits
from jaxgpt.registries import check_model


def test_zero_initialised_projections_start_at_zero_and_the_first_loss_is_log_v():
    """Every projection into the residual stream and the unembedding start at zero, so the
    first logits are all zero and the first loss is log V exactly, whatever the tokens."""
    cfg = tiny(zero_init_out=True, tie_embeddings=False, n_layer=2)
    params = init_params(cfg)
    flat = {"/".join(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    zero = {name for name, leaf in flat.items() if name.endswith("kernel") and not np.any(np.asarray(leaf))}
    assert zero == {"h_0/attn/c_proj/kernel", "h_0/mlp/c_proj/kernel", "h_1/attn/c_proj/kernel",
                    "h_1/mlp/c_proj/kernel", "lm_head/kernel"}
    x = tokens(cfg, 2, 9)
    loss = ops.cross_entropy(forward(cfg, params, x[:, :-1]), x[:, 1:])
    np.testing.assert_allclose(float(loss), math.log(cfg.vocab_size), rtol=1e-6)
    tied = init_params(tiny(zero_init_out=True))  # tied: the unembedding is the embedding, drawn as before
    assert np.std(np.asarray(tied["wte"]["embedding"])) > 0.01


def test_soft_capped_logits_are_the_cap_of_the_plain_ones():
    """logits_c = c·tanh(z/c) for the plain model's z, with the same params: never beyond ±c,
    nearly z where |z| ≪ c."""
    plain = tiny()
    params = random_params(plain)
    x = tokens(plain, 2, 9)
    z = np.asarray(forward(plain, params, x), np.float64)
    for cap in (0.5, 4.0):
        capped = np.asarray(forward(plain.replace(logit_softcap=cap), params, x), np.float64)
        np.testing.assert_allclose(capped, cap * np.tanh(z / cap), atol=1e-5)
        assert np.abs(capped).max() <= cap
    assert np.abs(z).max() > 1.0  # the cap of 0.5 bites


def test_packed_rows_of_the_recipe_equal_each_example_alone():
    cfg = tiny(**RECIPE, block_size=20, vocab_size=19)
    params = random_params(cfg)  # drawn: zero-initialised projections would hide the attention
    (row, positions, segments), examples = packed_row(LENGTHS, cfg.block_size, np.random.default_rng(4))
    packed = GPT(cfg).apply({"params": params}, row, positions=positions, segments=segments)
    assert_each_example_alone(cfg, params, packed, examples)


def test_qk_norm_bounds_each_score_by_the_gains():
    """With QK-norm, |q̂·k̂|/√D ≤ √D·max|γ_q|·max|γ_k| (Cauchy–Schwarz on two RMS-normalised vectors):
    huge query and key weights cannot make the attention's scores blow up."""
    cfg = tiny(qk_norm=True, n_layer=1)
    params = random_params(cfg)
    attn = params["h_0"]["attn"]
    big = {**attn, "c_attn": {**attn["c_attn"], "kernel": 1e3 * attn["c_attn"]["kernel"]}}
    x = tokens(cfg, 1, 9)
    _, state = GPT(cfg).apply({"params": {**params, "h_0": {**params["h_0"], "attn": big}}}, x,
                              mutable=["intermediates"])
    weights = np.asarray(state["intermediates"]["h_0"]["attn"]["attention_weights"][0])  # (B, H, T, S)
    bound = math.sqrt(cfg.head_dim) * np.abs(attn["q_norm"]["scale"]).max() * np.abs(attn["k_norm"]["scale"]).max()
    # softmax weights of scores within ±bound are at least e^(−2·bound)/T of the largest in each row
    seen = np.tril(np.ones(weights.shape[-2:], bool))
    ratio = weights / weights.max(axis=-1, keepdims=True)
    assert ratio[..., seen].min() >= math.exp(-2 * bound) * 0.999


def test_circuits_refuse_qk_norm_in_one_line():
    cfg = tiny(qk_norm=True)
    with pytest.raises(ValueError, match="qk_norm") as err:
        circuits.head_matrices(random_params(cfg), cfg, 0)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("key, value", [("logit_softcap", 0.0), ("logit_softcap", -3.0), ("logit_softcap", "30"),
                                        ("logit_softcap", float("inf")), ("qk_norm", "yes"), ("zero_init_out", 1),
                                        ("activation", "relu3")])
def test_a_bad_value_is_one_line_naming_the_key(key, value):
    with pytest.raises(ValueError, match=f"GPTConfig.{key}=") as err:
        check_model(GPTConfig(**{key: value}))  # as a config is opened
    assert "\n" not in str(err.value)


def test_relu_squared_is_relu_times_itself():
    x = jnp.linspace(-3, 3, 13)
    np.testing.assert_array_equal(np.asarray(ops.relu_squared(x)), np.where(np.asarray(x) > 0, np.asarray(x), 0) ** 2)
