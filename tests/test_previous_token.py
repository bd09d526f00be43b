"""The smear and the bigram hash embedding (jaxgpt.previous; model.smear, model.bigram_table):
against the float64 reference of tests/reference.py, within packed rows, decode == forward for
each attention form's cache, greedy generation from padded prompts, the layout, the GPT-2
export's refusal and bad input (scan_layers and resume: tests/test_multi_token.py's run)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from test_model import (
    decodes_as_forward,
    forward,
    init_params,
    matches_reference,
    random_params,
    tiny,
    tokens,
)
from test_sampling import PROMPTS, naive_greedy, run
from test_sampling import tiny as tiny_sampled

from jaxgpt import ComputeConfig, GPTConfig, convert, layout
from jaxgpt.model import param_layout
from jaxgpt.previous import PreviousToken, bigram_hash

BOTH = {"smear": True, "bigram_table": 29}


@pytest.mark.parametrize("changes", [{"smear": True}, {"bigram_table": 29}, BOTH], ids=str)
def test_forward_matches_float64_reference(changes):
    cfg = tiny(**changes)
    _, want = matches_reference(cfg)
    without = ref.gpt_forward(tiny(), jax.device_get(random_params(cfg)), np.asarray(tokens(cfg, 2, 9)))
    assert not np.allclose(want, without, atol=1e-3)


def test_no_token_before_across_a_packed_example_or_position_zero():
    """Packed rows: the first token of each example (position 0, or another segment) takes nothing."""
    cfg = tiny(**BOTH)
    params = jax.device_get(random_params(cfg))
    x = np.array([[3, 5, 7, 2, 9, 4, 4, 1], [8, 8, 6, 1, 0, 3, 5, 2]])
    positions = np.array([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]])
    segments = np.array([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    got = PreviousToken(cfg, ComputeConfig()).apply(
        {"params": params["previous"]}, lambda t: jnp.take(params["wte"]["embedding"], t, axis=0),
        jnp.asarray(x), jnp.asarray(positions), jnp.asarray(segments))
    want = ref.previous_token_embedding(cfg, ref._to_float64(params), x, positions, segments)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    alone = ref.previous_token_embedding(cfg, ref._to_float64(params), x[:1, 3:5])  # example 2 on its own
    np.testing.assert_allclose(np.asarray(got)[0, 3:5], alone[0], rtol=1e-5, atol=1e-5)


def test_bigram_hash_is_the_documented_function():
    before = np.array([[0, 50256, 17, 4_000_000]])
    token = np.array([[1, 50255, 17, 123_456]])
    got = bigram_hash(jnp.asarray(before), jnp.asarray(token), jnp.array([[True, True, True, False]]), 1000)
    want = [ref.bigram_hash(int(b), int(t), 1000) for b, t in zip(before[0, :3], token[0, :3], strict=True)] + [999]
    np.testing.assert_array_equal(np.asarray(got)[0], want)


@pytest.mark.parametrize("form", [{}, {"attention": "local", "window": 3}, {"attention": "linear"}], ids=str)
def test_decode_equals_forward(form):
    """Prefill a prompt, then one token at a time: each new token's predecessor comes from the cache."""
    decodes_as_forward(tiny(**BOTH, **form))


@pytest.mark.parametrize("form", [{}, {"attention": "linear", "positions": "rope"}], ids=str)
def test_greedy_from_padded_prompts_equals_naive_recomputation(form):
    """Prompts of different lengths prefilled as one padded batch (softmax: one longer than the
    context, every row going past it), token for token as the float64 model recomputed."""
    cfg = tiny_sampled(**BOTH, **form)
    prompts, new = (PROMPTS, 12) if not form else ([[5, 1, 7], [4]], 4)
    result = run(cfg, prompts=prompts, temperature=0.0, max_new_tokens=new)
    for b, prompt in enumerate(prompts):
        drawn, logprobs = naive_greedy(cfg, prompt, new)
        assert list(result.tokens[b, len(prompt):len(prompt) + new]) == drawn, f"row {b}"
        np.testing.assert_allclose(result.logprobs[b], logprobs, atol=1e-4)


def test_layout_groups_and_starting_point():
    """The table is a lookup (embed, its rows split like the vocabulary's), the gate and λ scalars;
    all start at zero, so a fresh model computes what it does without them."""
    declared = param_layout(tiny(**BOTH))["previous"]
    got = {name: (leaf.names, leaf.group) for name, leaf in declared.items()}
    assert got == {"bigram": (("bigrams", "embed"), "embed"), "smear_gate": (("gate",), "scalar"),
                   "smear_lambda": ((), "scalar")}
    assert dict(layout.RULES)["bigrams"] == "tensor"
    fresh = init_params(tiny(**BOTH))
    assert all(not np.any(np.asarray(leaf)) for leaf in jax.tree.leaves(fresh["previous"]))
    x = tokens(tiny(), 2, 9)  # the shape test_forward_matches_float64_reference compiled
    without = {name: value for name, value in fresh.items() if name != "previous"}
    want = ref.gpt_forward(tiny(), jax.device_get(without), np.asarray(x))
    np.testing.assert_allclose(np.asarray(forward(tiny(**BOTH), fresh, x)), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("changes, named", [({"smear": True}, "smear=True"), ({"bigram_table": 8}, "bigram_table=8")])
def test_gpt2_export_refuses_in_one_line(changes, named):
    with pytest.raises(ValueError, match=named) as error:
        convert.config_to_hf(tiny(**changes))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("changes, message", [
    ({"smear": 1}, "smear=1: must be True or False"),
    ({"bigram_table": 1}, "bigram_table=1: must be 0"),
    ({"bigram_table": -5}, "bigram_table=-5: must be 0"),
    ({"bigram_table": 2.5}, "bigram_table=2.5: must be 0"),
])
def test_bad_settings_are_one_line(changes, message):
    with pytest.raises(ValueError, match=message) as error:
        GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=8, **changes)
    assert "\n" not in str(error.value)
