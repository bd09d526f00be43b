"""The partial key offset (model.key_offset): each key's second half of channels taken from the key of the
token before it, against the float64 reference of tests/reference.py (positions, QK-norm, grouped heads,
the local form); the op against its reference across packed examples and gaps; decode == forward for the
softmax and local caches, a padded prefill and a packed row's cache; packed == each example alone; the
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
    forward,
    matches_reference,
    random_params,
    tiny,
    tokens,
)

from jaxgpt import GPT, ComputeConfig, GPTConfig, convert, init_cache
from jaxgpt.attention.base import offset_in_row

CASES = {
    "learned": {"key_offset": True},
    "recipe": {**RECIPE, "key_offset": True},  # RoPE and QK-norm before the offset
    "alibi,gqa,post-norm": {"key_offset": True, "positions": "alibi", "n_head": 4, "n_kv_head": 2,
                            "norm_position": "post"},
    "local,rope": {"key_offset": True, "attention": "local", "window": 3, "positions": "rope"},
}


@pytest.mark.parametrize("changes", CASES.values(), ids=CASES.keys())
def test_forward_matches_float64_reference(changes):
    cfg = tiny(**changes)
    _, want = matches_reference(cfg)
    plain = ref.gpt_forward(cfg.replace(key_offset=False), jax.device_get(random_params(cfg)),
                            np.asarray(tokens(cfg, 2, 9)))
    assert np.abs(want - plain).max() > 1e-3  # the offset did act


def test_offset_follows_positions_and_segments():
    """k'_s's second half is k_{s−1}'s only where s − 1 holds the token before s's: not across a packed
    example's boundary, nor a gap in the positions, nor at a row's start (k'_0 = k_0)."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 7, 3, 4))
    positions = np.array([[0, 1, 2, 0, 1, 2, 3], [4, 5, 7, 8, 9, 10, 11]])
    segments = np.array([[1, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 1, 1]])
    got = offset_in_row(jnp.asarray(k, jnp.float32), jnp.asarray(positions), jnp.asarray(segments))
    want = ref.key_offset(k, positions, segments)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(want[:, 0], k[:, 0])
    np.testing.assert_array_equal(want[1, 3, :, 2:], k[1, 2, :, 2:])  # positions 7, 8: the token before
    np.testing.assert_array_equal(want[1, 2], k[1, 2])  # position 7 after 5: none before
    np.testing.assert_array_equal(want[0, 3], k[0, 3])  # a new example


@pytest.mark.parametrize("form", [{}, {"attention": "local", "window": 3}, {"attention": "local", "window": 20}],
                         ids=["softmax", "local,ring", "local,whole"])
def test_decode_equals_forward(form):
    """The cache keeps the keys as made and each read offsets them, so a prefill then one token at a time
    computes what one pass does: each new key's half from the cache's newest, the ring's slot by slot."""
    decodes_as_forward(tiny(key_offset=True, positions="rope", **form))


def test_padded_prefill_rows_continue_as_if_alone():
    """A padded prefill, then each row's index set back to its prompt's length (the softmax cache's slots
    past it are stale): the next key takes its half from the prompt's last key, not the padding's."""
    continues_as_if_alone(tiny(key_offset=True, positions="rope"))


@pytest.mark.parametrize("kernel", ["explicit", "xla"])
def test_packed_examples_are_offset_each_alone(kernel):
    """No example's first key takes a half from the example before it in the row."""
    cfg = packed.tiny(key_offset=True, positions="rope")
    params = packed.init(cfg)
    (x, positions, segments), examples = packed.packed_row(packed.LENGTHS, cfg.block_size, np.random.default_rng(1))
    logits = GPT(cfg, ComputeConfig(kernel=kernel)).apply({"params": params}, x, positions=positions,
                                                           segments=segments)
    packed.assert_each_example_alone(cfg, params, logits, examples)


def test_a_packed_rows_cache_continues_its_last_example_alone():
    cfg = packed.tiny(key_offset=True, positions="rope")
    params, model = packed.init(cfg), GPT(cfg)
    (x, positions, segments), examples = packed.packed_row(packed.LENGTHS, sum(packed.LENGTHS),
                                                           np.random.default_rng(3))
    _, cache = model.apply({"params": params}, x, init_cache(cfg, 1), positions=positions, segments=segments)
    last, step = examples[-1], jnp.array([[7]], jnp.int32)
    got, _ = model.apply({"params": params}, step, cache, positions=jnp.array([[len(last)]]),
                         segments=jnp.array([[len(examples)]]))
    _, fresh = model.apply({"params": params}, jnp.asarray(last, jnp.int32)[None], init_cache(cfg, 1))
    want, _ = model.apply({"params": params}, step, fresh)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", [{"attention": "local", "window": 4, "block_size": 16}, {"paired_heads": (0,)}],
                         ids=["local", "softmax,past the context"])
def test_generate_with_padded_prompts_equals_recomputing(form):
    """Two prompt lengths in one padded batch (the ring keeps no padding; the softmax cache's index set back),
    the softmax form's past block_size: each row's greedy tokens are the argmax of one pass over its own
    (cropped) sequence."""
    from jaxgpt.decode import sampling

    cfg = tiny(**{"key_offset": True, "positions": "rope", "block_size": 8, **form})
    params, prompts = random_params(cfg), [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    result = sampling.generate(params, cfg, prompts, 0, max_new_tokens=7, temperature=0.0)
    for prompt, row in zip(prompts, result.new_tokens(), strict=True):
        sequence = list(prompt)
        for token in row:
            window = jnp.asarray(sequence[-cfg.block_size:])[None]
            assert int(jnp.argmax(forward(cfg, params, window)[0, -1])) == int(token)
            sequence.append(int(token))


def test_scores_through_the_cache_engine_are_one_pass_scores():
    """jaxgpt.score reads contexts into the KV cache in windows, then continuations after them over one
    another's slots: with the key offset (and a paired layer) each slot's key still takes its half from the
    slot before it, so the scores are those of one pass over each (context, continuation)."""
    from test_choices import TEXT, float64_score

    from jaxgpt import tokenizers
    from jaxgpt.score import likelihood

    char = tokenizers.train_tokenizer("char", [TEXT])
    cfg = GPTConfig(vocab_size=char.vocab_size, block_size=32, n_layer=2, n_head=2, d_model=16, d_ff=32,
                    positions="rope", key_offset=True, paired_heads=(1,))
    params, ids = random_params(cfg), char.encode(TEXT)
    pairs = [(ids[:9], ids[9:12]), (ids[:9], ids[20:27]), (ids[50:53], ids[9:18]), (ids[70:90], ids[5:8]),
             (ids[:20], ids[20:31]), (ids[:2], ids[2:3])]
    scores = likelihood.score_continuations(GPT(cfg), params, pairs, batch_size=4)
    expected = [float64_score(cfg, params, x, c) for x, c in pairs]
    np.testing.assert_allclose([s for s, _ in scores], [s for s, _ in expected], rtol=1e-5, atol=1e-4)
    assert [g for _, g in scores] == [g for _, g in expected]


def test_what_cannot_offset_is_refused_in_one_line():
    with pytest.raises(ValueError, match="key_offset=True with attention='linear': .* attention='softmax' or "
                                         "'local'") as error:
        GPT(tiny(key_offset=True, attention="linear"))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="key_offset=True: GPT-2's keys are each token's own") as error:
        convert.config_to_hf(tiny(key_offset=True))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="GPTConfig.key_offset=1: must be True or False"):
        GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=8, key_offset=1)
