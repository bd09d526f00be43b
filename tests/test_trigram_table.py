"""The trigram hash embedding (jaxgpt.previous; model.trigram_table = M): the row C[h(x_{t−2}, x_{t−1}, x_t)]
added to e_t, against the float64 reference of tests/reference.py (alone and beside the bigram table and
the smear), within packed rows, the hash as documented and how it spreads, decode == forward for each
attention form's cache (the first new tokens' two predecessors from the cache, also for a prompt of one
token), packed segments decoded through the softmax cache, the layout, the GPT-2 export's refusal and bad
settings (scan_layers: tests/test_scan_layers.py; resume: tests/test_multi_token.py's run)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from test_model import decodes_as_forward, forward, init_params, matches_reference, random_params, tiny, tokens

from jaxgpt import GPT, ComputeConfig, GPTConfig, convert, init_cache, layout
from jaxgpt.model import param_layout
from jaxgpt.previous import PreviousToken, trigram_hash

ALL = {"smear": True, "bigram_table": 13, "trigram_table": 29}


@pytest.mark.parametrize("changes", [{"trigram_table": 29}, ALL], ids=["trigram", "with_bigram_and_smear"])
def test_forward_matches_float64_reference(changes):
    cfg = tiny(**changes)
    _, want = matches_reference(cfg)
    params, x = jax.device_get(random_params(cfg)), np.asarray(tokens(cfg, 2, 9))
    without = ref.gpt_forward(cfg.replace(trigram_table=0), params, x)
    assert not np.allclose(want, without, atol=1e-3)  # the table did act


def test_fewer_than_two_before_across_a_packed_example_or_near_position_zero():
    """Packed rows: an example's first two tokens take row M − 1, and no token of another example counts."""
    cfg = tiny(**ALL)
    params = jax.device_get(random_params(cfg))
    x = np.array([[3, 5, 7, 2, 9, 4, 4, 1, 6], [8, 8, 6, 1, 0, 3, 5, 2, 2]])
    positions = np.array([[0, 1, 2, 0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    segments = np.array([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
    got = PreviousToken(cfg, ComputeConfig()).apply(
        {"params": params["previous"]}, lambda t: jnp.take(params["wte"]["embedding"], t, axis=0),
        jnp.asarray(x), jnp.asarray(positions), jnp.asarray(segments))
    want = ref.previous_token_embedding(cfg, ref._to_float64(params), x, positions, segments)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    alone = ref.previous_token_embedding(cfg, ref._to_float64(params), x[:1, 3:7])  # example 2 on its own
    np.testing.assert_allclose(np.asarray(got)[0, 3:7], alone[0], rtol=1e-5, atol=1e-5)


def test_trigram_hash_is_the_documented_function():
    before2 = np.array([[0, 50256, 17, 9, 4_000_000, 3]])
    before = np.array([[0, 50255, 17, 1, 3_999_999, 3]])
    token = np.array([[1, 50254, 17, 9, 123_456, 3]])
    has2 = jnp.array([[True, True, True, True, True, False]])
    got = trigram_hash(*(jnp.asarray(a) for a in (before2, before, token)), has2, 1000)
    want = [ref.trigram_hash(*(int(a[0, t]) for a in (before2, before, token)), 1000) for t in range(5)] + [999]
    np.testing.assert_array_equal(np.asarray(got)[0], want)


def test_trigram_hash_spreads_where_the_table_is_a_power_of_two():
    """Into M − 1 = 1024 rows: the rows of random triples of GPT-2's vocabulary fill the table as a
    uniform draw would, a token and that token + 1024 (equal in their low 10 bits) share a row no more
    often than chance, nor do (x_{t−1}, x_t) and the pair swapped: what the high bits' fold and a
    multiplier per place are for."""
    rng = np.random.default_rng(0)
    n, rows = 20_000, 1024
    x2, x1, x0 = (jnp.asarray(rng.integers(0, 49_000, n)) for _ in range(3))
    yes = jnp.ones(n, bool)
    hashed = np.asarray(trigram_hash(x2, x1, x0, yes, rows + 1))
    filled = np.unique(hashed).size
    assert abs(filled - rows * (1 - np.exp(-n / rows))) < 0.02 * rows  # ≈ 1024: every row is reached
    counts = np.bincount(hashed, minlength=rows)
    assert counts.max() < 2 * n / rows  # no row takes twice its share (binomial: ≈ 1.3× at most)
    for other in (trigram_hash(x2, x1, x0 + 1024, yes, rows + 1), trigram_hash(x2, x0, x1, yes, rows + 1)):
        assert np.mean(hashed == np.asarray(other)) < 3 / rows  # chance: 1/1024


@pytest.mark.parametrize("form", [{}, {"attention": "local", "window": 3}, {"attention": "linear"}], ids=str)
def test_decode_equals_forward(form):
    """Prefill a prompt (1 or 5 tokens), then one token at a time: each new token's two predecessors
    come from the cache (the second new token's second one too)."""
    decodes_as_forward(tiny(**ALL, **form), prompt_lengths=(1, 2, 5))


def test_decode_of_packed_examples_through_the_cache_equals_forward():
    """A packed row (positions and segments given) fed to the softmax cache three tokens at a time gives
    the logits of one pass: a new example's first two tokens take nothing from the one before it."""
    cfg = tiny(trigram_table=29, bigram_table=13)
    params = random_params(cfg)
    x = tokens(cfg, 2, 12)
    positions = jnp.array([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]] * 2)
    segments = jnp.array([[1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3]] * 2)
    apply = jax.jit(lambda p, t, c, pos, seg: GPT(cfg).apply({"params": p}, t, c, positions=pos, segments=seg))
    full = GPT(cfg).apply({"params": params}, x, positions=positions, segments=segments)
    cache, outputs = init_cache(cfg, 2, cfg.block_size), []
    for start in range(0, 12, 3):
        logits, cache = apply(params, x[:, start:start + 3], cache, positions[:, start:start + 3],
                              segments[:, start:start + 3])
        outputs.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outputs, axis=1)), np.asarray(full), atol=1e-5, rtol=1e-5)


def test_layout_groups_and_starting_point():
    """The table is a lookup (embed, its rows split like the vocabulary's and the bigram table's); it
    starts at zero, so a fresh model computes what it does without it."""
    declared = param_layout(tiny(trigram_table=29))["previous"]
    assert {name: (leaf.names, leaf.group) for name, leaf in declared.items()} == {
        "trigram": (("trigrams", "embed"), "embed")}
    assert dict(layout.RULES)["trigrams"] == dict(layout.RULES)["vocab"] == "tensor"
    fresh = init_params(tiny(trigram_table=29))
    assert not np.any(np.asarray(fresh["previous"]["trigram"]))
    x = tokens(tiny(), 2, 9)  # the shape test_forward_matches_float64_reference compiled
    without = {name: value for name, value in fresh.items() if name != "previous"}
    want = ref.gpt_forward(tiny(), jax.device_get(without), np.asarray(x))
    np.testing.assert_allclose(np.asarray(forward(tiny(trigram_table=29), fresh, x)), want, atol=1e-4, rtol=1e-4)


def test_gpt2_export_refuses_in_one_line():
    with pytest.raises(ValueError, match="trigram_table=8: GPT-2 has no trigram hash embedding") as error:
        convert.config_to_hf(tiny(trigram_table=8))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("value", [1, -5, 2.5, True])
def test_bad_settings_are_one_line(value):
    with pytest.raises(ValueError, match=f"trigram_table={value!r}: must be 0") as error:
        GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=8, trigram_table=value)
    assert "\n" not in str(error.value)
