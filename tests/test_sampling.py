"""Sampling (jaxgpt.decode.sampling, jaxgpt.decode.logits, jaxgpt.decode.beam, jaxgpt.decode.text): the filters against
worked examples and NumPy, generate and beam search against naive float64 recomputation
(tests/reference.py) and enumeration, and sample.py end to end."""

import ast
import functools
import io
import itertools
import json
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from runs import save_params, write_run
from scripts import load_script
from test_model import random_params as uncommitted_random_params

from jaxgpt import ComputeConfig, GPTConfig, tokenizers
from jaxgpt.decode import beam, sampling
from jaxgpt.decode.text import generate_text
from jaxgpt.train.run import load_run

ROOT = Path(__file__).resolve().parents[1]
POSITIONS = ["learned", "sinusoidal", "rope", "alibi", "none"]

# One batch shape for most generate tests, so they share compiled programs: three prompts of
# different lengths (bucket 16), one already longer than the context, and twelve new tokens,
# so every row goes past block_size.
BLOCK = 8
PROMPTS = [[5, 1, 7], [3, 9, 2, 4, 8, 6, 1, 0, 2, 7], [4]]
NEW = 12


@functools.cache
def random_params(cfg):
    """test_model's random params, committed to the device as restored checkpoints are: jit
    compiles anew for a change of placement, and this way the tests share programs with
    sample.py, which restores them."""
    return jax.device_put(uncommitted_random_params(cfg), jax.devices()[0])


def tiny(**changes):
    base = dict(vocab_size=23, block_size=BLOCK, n_layer=2, n_head=2, d_model=16)
    return GPTConfig(**{**base, **changes})


def run(cfg, prompts=PROMPTS, key=0, **options):
    """generate with the settings the tests share: one compiled program per config (return_logprobs,
    temperature, eos_id and pad_id do not select a program)."""
    key = jax.random.key(key) if isinstance(key, int) else key
    options = {"max_new_tokens": NEW, "return_logprobs": True, **options}
    return jax.device_get(sampling.generate(random_params(cfg), cfg, prompts, key, **options))


def naive_log_probs(cfg, params, sequence):
    """log p(· | crop(sequence)) in float64: the whole cropped context through the NumPy model."""
    context = np.asarray(sequence[-cfg.block_size:])[None]
    logits = ref.gpt_forward(cfg, params, context)[0, -1]
    return logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()


def naive_greedy(cfg, prompt, n):
    """Greedy continuation by recomputing the cropped context for every token: tokens, logprobs."""
    params = jax.device_get(random_params(cfg))
    sequence, logprobs = list(prompt), []
    for _ in range(n):
        log_p = naive_log_probs(cfg, params, sequence)
        first, second = np.sort(log_p)[-2:][::-1]
        assert first - second > 1e-3, "a near-tie: float32 and float64 could choose differently; change the seed"
        sequence.append(int(np.argmax(log_p)))
        logprobs.append(log_p.max())
    return sequence[len(prompt):], np.array(logprobs)


def rows(result):
    return [list(row[:length]) for row, length in zip(result.tokens, result.lengths, strict=True)]


def padded(prompts, width=16):
    """The prompts as a (B, width) array and their lengths (the list form's bucket is 16)."""
    array = np.zeros((len(prompts), width), np.int32)
    for b, prompt in enumerate(prompts):
        array[b, :len(prompt)] = prompt
    return jnp.asarray(array), jnp.array([len(prompt) for prompt in prompts])


# --- the filters -------------------------------------------------------------------------


def kept(filtered):
    return set(np.flatnonzero(np.isfinite(np.asarray(filtered))))


def test_top_k_keeps_exactly_k_with_ties_to_the_lower_id():
    logits = jnp.array([1.0, 3.0, 0.0, 3.0, 3.0, -2.0])
    assert kept(sampling.top_k_filter(logits, 2)) == {1, 3}
    assert kept(sampling.top_k_filter(logits, 4)) == {0, 1, 3, 4}
    assert kept(sampling.top_k_filter(logits, 10)) == set(range(6))
    kept_values = np.asarray(sampling.top_k_filter(logits, 2))[[1, 3]]
    np.testing.assert_array_equal(kept_values, [3.0, 3.0])  # kept logits are unchanged


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-4, 4, width=32, allow_subnormal=False), min_size=7, max_size=7), st.integers(1, 7))
@example(values=[-0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], k=1)  # −0 and +0 tie: the lower id is kept
def test_top_k_keeps_the_k_largest(values, k):
    want = set(sorted(range(7), key=lambda i: (-values[i], i))[:k])
    assert kept(sampling.top_k_filter(jnp.array(values), k)) == want


def test_top_p_keeps_the_smallest_set_reaching_p():
    # Worked example: sorted, the probabilities are 0.5, 0.2, 0.15, 0.1, 0.05 and their running
    # sums 0.5, 0.7, 0.85, 0.95, 1.
    probs = {0: 0.1, 1: 0.5, 2: 0.05, 3: 0.2, 4: 0.15}
    logits = jnp.log(jnp.array([probs[i] for i in range(5)]))
    for p, want in [(0.3, {1}), (0.6, {1, 3}), (0.8, {1, 3, 4}), (0.9, {0, 1, 3, 4}), (0.99, set(range(5))),
                    (1.0, set(range(5)))]:
        assert kept(sampling.top_p_filter(logits, p)) == want, p


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-4, 4, width=32, allow_subnormal=False), min_size=7, max_size=7), st.floats(0.01, 1.0))
def test_top_p_property(values, p):
    probs = np.exp(np.array(values) - max(values))
    probs /= probs.sum()
    order = sorted(range(7), key=lambda i: (-probs[i], i))
    mass = np.cumsum(probs[order])
    # float32 and float64 agree on the order and the boundary unless they are a hair apart
    gaps = np.abs(probs[:, None] - probs[None, :])
    assume(np.all((gaps == 0) | (gaps > 1e-6)) and np.all(np.abs(mass - p) > 1e-4))
    size = int(np.argmax(mass >= p)) + 1 if p < mass[-1] else 7
    assert kept(sampling.top_p_filter(jnp.array(values), p)) == set(order[:size])


def test_filters_apply_in_order_temperature_top_k_top_p():
    # τ first: p(0.6, 0.3, 0.1) needs two tokens to reach 0.65, at τ = 0.5 (0.78, 0.20, 0.02) one.
    logits = jnp.log(jnp.array([0.6, 0.3, 0.1]))
    assert kept(sampling.filter_logits(logits, 1.0, top_p=0.65)) == {0, 1}
    assert kept(sampling.filter_logits(logits, 0.5, top_p=0.65)) == {0}
    # top-k before top-p: after top-2, (0.4, 0.3) renormalise to (0.57, 0.43) and one reaches 0.5.
    logits = jnp.log(jnp.array([0.4, 0.3, 0.2, 0.1]))
    assert kept(sampling.filter_logits(logits, 1.0, top_k=2, top_p=0.5)) == {0}
    np.testing.assert_allclose(sampling.filter_logits(logits, 2.0)[0], np.log(0.4) / 2, rtol=1e-6)


def test_temperature_zero_is_argmax_whatever_the_key_and_filters():
    logits = jnp.array([0.1, 2.0, 1.9, -1.0])
    for seed in range(3):
        for top_k, top_p in [(None, None), (3, None), (None, 0.2), (2, 0.9)]:
            assert int(sampling.sample_token(jax.random.key(seed), logits, 0.0, top_k, top_p)) == 1


def filtered_distribution(logits, temperature, k, p):
    """Temperature, top-k and nucleus by hand in float64: the distribution samples come from."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, kind="stable")[:k]
    probs = np.exp(z[order] - z[order].max())
    probs /= probs.sum()
    size = int(np.argmax(np.cumsum(probs) >= p)) + 1
    nucleus = order[:size]
    q = np.zeros(len(z))
    q[nucleus] = np.exp(z[nucleus] - z[nucleus].max())
    return q / q.sum()


def chi_square_critical(df, z=4.753):
    """The chi-square quantile with upper tail 1e-6 (z), by the Wilson–Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_frequencies_match_the_filtered_distribution():
    logits = jnp.array([1.2, 0.4, -0.3, 2.0, 0.9, -1.5, 0.1, 1.6])
    temperature, k, p, n = 0.7, 6, 0.9, 20_000
    draw = jax.jit(jax.vmap(lambda key: sampling.sample_token(key, logits, temperature, k, p)))
    counts = np.bincount(np.asarray(draw(jax.random.split(jax.random.key(0), n))), minlength=8)

    def chi_square(q):
        support = q > 0
        assert counts[~support].sum() == 0, "drew a token the filters remove"
        return (((counts - n * q) ** 2)[support] / (n * q[support])).sum(), support.sum() - 1

    statistic, df = chi_square(filtered_distribution(logits, temperature, k, p))
    assert statistic < chi_square_critical(df)
    # The check has the power to see a wrong temperature: τ = 1 with the same support fails.
    wrong = filtered_distribution(logits, 1.0, k, p) * (filtered_distribution(logits, temperature, k, p) > 0)
    assert chi_square(wrong / wrong.sum())[0] > chi_square_critical(df)


# --- generate -------------------------------------------------------------------------------


@pytest.mark.parametrize("positions", POSITIONS)
def test_greedy_with_cache_equals_naive_recomputation(positions):
    """Token for token, past block_size too, with the model's log-probabilities."""
    cfg = tiny(positions=positions)
    result = run(cfg, temperature=0.0)
    assert result.tokens.shape == (3, 10 + NEW)
    np.testing.assert_array_equal(result.prompt_lengths, [3, 10, 1])
    np.testing.assert_array_equal(result.lengths, result.prompt_lengths + NEW)
    for b, prompt in enumerate(PROMPTS):
        tokens, logprobs = naive_greedy(cfg, prompt, NEW)
        assert rows(result)[b] == prompt + tokens, f"row {b}"
        np.testing.assert_allclose(result.logprobs[b], logprobs, atol=1e-4)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_greedy_with_the_ring_cache_equals_naive_recomputation(positions):
    """attention='local': prompts that fit the context, in a batch that goes past it, so the
    first step is a pass over the context windows and the next ones go on from the ring (which
    must hold each row's last prompt token) until a row passes block_size."""
    cfg = tiny(attention="local", window=4, positions=positions)
    prompts = [[5, 1, 7], [3, 9, 2, 4, 8, 6], [4]]
    result = run(cfg, prompts, temperature=0.0)
    for b, prompt in enumerate(prompts):
        tokens, logprobs = naive_greedy(cfg, prompt, NEW)
        assert rows(result)[b] == prompt + tokens, f"row {b}"
        np.testing.assert_allclose(result.logprobs[b], logprobs, atol=1e-4)


def eos_case(cfg):
    """(an EOS id, the step at which row 0 first draws it), a step ≥ 2, from the greedy run without EOS."""
    new = run(cfg, temperature=0.0).tokens[0, 3:]
    step = next(i for i in range(2, NEW) if new[i] not in new[:i])
    return int(new[step]), step


def test_a_row_that_draws_eos_stops_and_is_padded_after_it():
    cfg = tiny()
    free = run(cfg, temperature=0.0)
    eos, _ = eos_case(cfg)
    pad = next(t for t in range(cfg.vocab_size) if t != eos)
    stopped = run(cfg, temperature=0.0, eos_id=eos, pad_id=pad)
    assert stopped.tokens.shape == free.tokens.shape
    for b, prompt in enumerate(PROMPTS):
        new = list(free.tokens[b, len(prompt):len(prompt) + NEW])
        end = len(prompt) + (new.index(eos) + 1 if eos in new else NEW)
        assert stopped.lengths[b] == end
        np.testing.assert_array_equal(stopped.tokens[b, :end], free.tokens[b, :end])
        assert (stopped.tokens[b, end:] == pad).all()
        np.testing.assert_array_equal(stopped.logprobs[b, :end - len(prompt)], free.logprobs[b, :end - len(prompt)])
        assert (stopped.logprobs[b, end - len(prompt):] == 0).all()
    assert stopped.lengths[0] < len(PROMPTS[0]) + NEW


def test_stream_gives_the_tokens_of_generate_step_by_step():
    """Rows streamed alone (with the key they have in the batch) draw what they draw in the
    batch; a row that draws EOS ends the loop there. (One prompt in bucket 16: the program
    that sample.py --stream uses.)"""
    cfg = tiny()
    params, key = random_params(cfg), jax.random.key(4)
    whole = run(cfg, key=key, temperature=1.0)
    for b in (0, 1):
        prompt, length = padded([PROMPTS[b]])
        steps = list(sampling.stream(params, cfg, prompt, jax.random.fold_in(key, b)[None], max_new_tokens=NEW,
                                     temperature=1.0, return_logprobs=True, prompt_lengths=length))
        assert len(steps) == NEW and all(step.active[0] for step in steps)
        assert [int(step.token[0]) for step in steps] == rows(whole)[b][len(PROMPTS[b]):]
        np.testing.assert_allclose([step.logprob[0] for step in steps], whole.logprobs[b], atol=1e-5)

    eos, stop = eos_case(cfg)
    prompt, length = padded([PROMPTS[0]])
    steps = list(sampling.stream(params, cfg, prompt, key[None], max_new_tokens=NEW, temperature=0.0, eos_id=eos,
                                 prompt_lengths=length))
    assert len(steps) == stop + 1 and int(steps[-1].token[0]) == eos and steps[0].logprob is None


def test_the_loop_in_chunks_gives_what_the_steps_give_one_by_one():
    """generate takes its steps in chunks of sampling.CHUNK between looks at whether any row is
    going; the last chunk's steps past max_new_tokens, and those after every row drew EOS,
    change nothing: tokens, lengths and every record equal stream's, step by step."""
    cfg = tiny()
    params, key, new = random_params(cfg), jax.random.key(6), sampling.CHUNK + 5
    prompt, length = padded([PROMPTS[1]])
    options = dict(max_new_tokens=new, temperature=1.0, return_logprobs=True, top_logprobs=3, pad_id=11,
                   prompt_lengths=length)

    def check(eos):
        whole = jax.device_get(sampling.generate(params, cfg, prompt, key[None], eos_id=eos, **options))
        steps = list(sampling.stream(params, cfg, prompt, key[None], eos_id=eos, **options))
        drawn = [int(step.token[0]) for step in steps]
        assert whole.lengths[0] == length[0] + len(drawn)
        assert list(whole.tokens[0, length[0]:whole.lengths[0]]) == drawn
        assert (whole.tokens[0, whole.lengths[0]:] == 11).all()
        np.testing.assert_allclose(whole.logprobs[0, :len(drawn)], [s.logprob[0] for s in steps], atol=1e-5)
        assert (whole.logprobs[0, len(drawn):] == 0).all()
        np.testing.assert_array_equal(whole.top_ids[0, :len(drawn)], [s.top_ids[0] for s in steps])
        assert (whole.top_ids[0, len(drawn):] == 11).all()
        return drawn

    free = check(None)
    assert len(free) == new
    eos = free[sampling.CHUNK + 1]  # drawn in the second chunk: the loop stops inside it, or before
    stopped = check(eos)
    assert stopped == free[:free.index(eos) + 1]


def test_each_row_gives_what_its_prompt_gives_without_the_others():
    """Sampling (τ = 1): row b of a batch with key k draws what its prompt draws in a batch
    of copies of it, each with row b's key fold_in(k, b); prompts of different lengths."""
    cfg = tiny()
    key = jax.random.key(7)
    batch = run(cfg, key=key, temperature=1.0)
    for b, prompt in enumerate(PROMPTS):
        copies, lengths = padded([prompt] * 3)
        keys = jnp.stack([jax.random.fold_in(key, b)] * 3)
        alone = run(cfg, copies, keys, temperature=1.0, prompt_lengths=lengths)
        assert rows(alone) == [rows(batch)[b]] * 3, f"row {b}"


def test_same_key_same_sample_different_keys_differ():
    cfg = tiny()
    a, again, other = (run(cfg, key=key, temperature=1.0) for key in (1, 1, 2))
    np.testing.assert_array_equal(again.tokens, a.tokens)
    assert rows(other) != rows(a)
    same_prompt = run(cfg, [PROMPTS[1]] * 3, key=1, temperature=1.0)
    assert len({tuple(r) for r in rows(same_prompt)}) == 3  # each row has its own key


def test_an_integer_seed_draws_as_its_key():
    """generate(…, seed) is generate(…, jax.random.key(seed)): the key is made inside the
    program (one program fewer than making it eagerly)."""
    cfg = tiny()
    params = random_params(cfg)
    by_seed = sampling.generate(params, cfg, PROMPTS, 7, max_new_tokens=NEW, temperature=1.0)
    by_key = sampling.generate(params, cfg, PROMPTS, jax.random.key(7), max_new_tokens=NEW, temperature=1.0)
    np.testing.assert_array_equal(np.asarray(by_seed.tokens), np.asarray(by_key.tokens))
    other = sampling.generate(params, cfg, PROMPTS, 8, max_new_tokens=NEW, temperature=1.0)
    assert rows(jax.device_get(other)) != rows(jax.device_get(by_seed))
    with pytest.raises(ValueError, match="PRNG key .* or an integer seed"):
        sampling.generate(params, cfg, PROMPTS, 7.0, max_new_tokens=NEW)


def test_generate_traces_under_jit():
    """Everything may be traced but the static choices (what the arrays hold is checked by
    the tests above, which give prompts as arrays too)."""
    cfg = tiny()

    @jax.jit
    def sample(params, prompts, lengths, key, temperature, top_p):
        return sampling.generate(params, cfg, prompts, key, max_new_tokens=NEW, temperature=temperature, top_k=5,
                                 top_p=top_p, prompt_lengths=lengths, return_logprobs=True)

    prompts, lengths = padded(PROMPTS)
    shapes = jax.eval_shape(sample, random_params(cfg), prompts, lengths, jax.random.key(0), 0.5, 0.9)
    assert shapes.tokens.shape == (3, 16 + NEW) and shapes.logprobs.shape == (3, NEW)


@pytest.mark.parametrize("options, message", [
    (dict(temperature=-1.0), r"temperature must be a finite number ≥ 0 \(0 means greedy\), got -1.0"),
    (dict(temperature=float("nan")), "temperature must be"),
    (dict(top_k=0), "top_k must be a positive integer"),
    (dict(top_k=2.5), "top_k must be a positive integer"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(eos_id=23), r"eos_id must be a token id in 0…22, got 23"),
    (dict(prompts=[[1, 2], []]), "prompt 1 must be a non-empty sequence of token ids"),
    (dict(prompts=[1, 2, 3]), r"for one prompt pass \[prompt\]"),
    (dict(prompts=[[1, 40]]), "prompt token 40 is not an id of this model's vocabulary 0…22"),
    (dict(key=jax.random.split(jax.random.key(0), 2)), r"one PRNG key or one per row \(3,\)"),
])
def test_bad_arguments_are_refused_with_a_clear_message(options, message):
    cfg = tiny()
    arguments = {"prompts": PROMPTS, "key": jax.random.key(0), "max_new_tokens": NEW, **options}
    with pytest.raises(ValueError, match=message):
        sampling.generate(random_params(cfg), cfg, **arguments)


def test_options_as_an_object_or_as_keywords_draw_the_same():
    """A SamplingOptions and its fields given as keywords are the same request; giving both
    is a one-line error, and so is an impossible option, when the options are made."""
    cfg = tiny()
    params, key = random_params(cfg), jax.random.key(5)
    options = sampling.SamplingOptions(NEW, temperature=0.7, eos_id=3, return_logprobs=True)
    as_object = jax.device_get(sampling.generate(params, cfg, PROMPTS, key, options))
    as_keywords = run(cfg, key=key, temperature=0.7, eos_id=3)
    jax.tree.map(np.testing.assert_array_equal, as_object, as_keywords)
    assert as_object.logprobs is not None and as_object.top_ids is None

    with pytest.raises(ValueError, match=r"as a SamplingOptions or as keywords, not both: got options and top_k$"):
        sampling.generate(params, cfg, PROMPTS, key, options, top_k=3)
    with pytest.raises(ValueError, match="not both"):
        sampling.stream(params, cfg, PROMPTS, key, options, temperature=0.0)
    with pytest.raises(ValueError, match=r"temperature must be a finite number ≥ 0 \(0 means greedy\), got -1.0"):
        sampling.SamplingOptions(NEW, temperature=-1.0)
    with pytest.raises(ValueError, match=r"eos_id must be a token id in 0…22, got 23"):
        sampling.generate(params, cfg, PROMPTS, key, sampling.SamplingOptions(NEW, eos_id=23))


# --- beam search --------------------------------------------------------------------------


def test_one_beam_is_greedy_past_the_context_too():
    cfg = tiny()
    beams = jax.device_get(beam.beam_search(random_params(cfg), cfg, PROMPTS[0], num_beams=1, max_new_tokens=NEW))
    tokens, logprobs = naive_greedy(cfg, PROMPTS[0], NEW)
    assert list(beams.tokens[0]) == PROMPTS[0] + tokens
    np.testing.assert_allclose(beams.scores[0], logprobs.sum() / NEW, rtol=1e-4)


def enumerate_continuations(cfg, prompt, n, eos_id=None, length_penalty=0.0):
    """Every continuation of up to n tokens (ending at EOS or at n) with its score
    log p / length^length_penalty, from one float64 pass over all V^n full sequences."""
    params = jax.device_get(random_params(cfg))
    full = np.array([prompt + list(c) for c in itertools.product(range(cfg.vocab_size), repeat=n)])
    log_p = ref.gpt_forward(cfg, params, full)
    log_p = log_p - np.log(np.exp(log_p).sum(-1, keepdims=True))
    steps = np.take_along_axis(log_p[:, len(prompt) - 1:-1], full[:, len(prompt):, None], axis=-1)[..., 0]
    scores = {}
    for sequence, step_log_p in zip(full[:, len(prompt):], steps, strict=True):
        for length in range(1, n + 1):
            head = tuple(sequence[:length])
            if eos_id in head[:-1]:
                break
            if head[-1] == eos_id or length == n:
                scores[head] = step_log_p[:length].sum() / length ** length_penalty
    return sorted(scores.items(), key=lambda item: -item[1])


@pytest.mark.parametrize("eos_id, length_penalty", [(None, 0.0), (2, 1.0), (2, -0.5)])
def test_enough_beams_find_the_most_probable_continuations(eos_id, length_penalty):
    """V = 5, 3 new tokens: 25 = V² beams keep every prefix, so beam search is exhaustive."""
    cfg = tiny(vocab_size=5)
    prompt, k = [1, 3], 25
    beams = jax.device_get(beam.beam_search(random_params(cfg), cfg, prompt, num_beams=k, max_new_tokens=3,
                                            eos_id=eos_id, length_penalty=length_penalty))
    best = enumerate_continuations(cfg, prompt, 3, eos_id, length_penalty)[:k]
    got = [tuple(row[len(prompt):length]) for row, length in zip(beams.tokens, beams.lengths, strict=True)]
    assert got[0] == best[0][0]
    np.testing.assert_allclose(beams.scores, [score for _, score in best], rtol=1e-4)
    assert set(got) == {sequence for sequence, _ in best}


def reference_beam_search(cfg, prompt, k, n, eos_id, length_penalty):
    """Beam search as the docstring says it, in float64 and without stopping early: live
    beams extended by every token, the k best non-EOS ones kept, those ending in EOS finished."""
    params = jax.device_get(random_params(cfg))
    live, finished = [((), 0.0)], []
    for step in range(1, n + 1):
        extended = []
        for sequence, log_p in live:
            step_log_p = naive_log_probs(cfg, params, prompt + list(sequence))
            for token, token_log_p in enumerate(step_log_p):
                hypothesis = (sequence + (token,), log_p + token_log_p)
                if token == eos_id:
                    finished.append((hypothesis[0], hypothesis[1] / step ** length_penalty))
                else:
                    extended.append(hypothesis)
        live = sorted(extended, key=lambda h: -h[1])[:k]
    finished += [(sequence, log_p / n ** length_penalty) for sequence, log_p in live]
    return sorted(finished, key=lambda h: -h[1])[:k]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_few_beams_past_the_context_match_a_plain_beam_search(length_penalty):
    """Two beams, eight new tokens from a prompt of two (past block_size 8): finished
    hypotheses fill the two slots early, so the search may stop early, but never differently."""
    cfg = tiny()
    prompt, eos_id = [1, 3], 2
    beams = jax.device_get(beam.beam_search(random_params(cfg), cfg, prompt, num_beams=2, max_new_tokens=8,
                                            eos_id=eos_id, length_penalty=length_penalty))
    want = reference_beam_search(cfg, prompt, 2, 8, eos_id, length_penalty)
    got = [tuple(row[len(prompt):length]) for row, length in zip(beams.tokens, beams.lengths, strict=True)]
    assert got == [sequence for sequence, _ in want]
    np.testing.assert_allclose(beams.scores, [score for _, score in want], rtol=1e-4)


# --- run directories, text and sample.py ------------------------------------------------------

# 19 characters + 4 special tokens: the run's model is tiny(), so sample.py shares compiled programs
# with the tests above.
TEXT = "First Citizen:\nSpeak, speak.\nFirst:\nSpeak, speak up.\n"


def make_run_dir(path: Path, with_checkpoint: bool = True) -> Path:
    """A tiny run directory as training writes it: config.json, tokenizer.json, a checkpoint at step 3."""
    tokenizer = tokenizers.train_tokenizer("char", [TEXT])
    cfg = tiny()
    assert tokenizer.vocab_size == cfg.vocab_size
    return write_run(path, cfg, tokenizer, step=3 if with_checkpoint else None, params=random_params(cfg))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run_dir(tmp_path_factory.mktemp("sampling") / "run")


@pytest.fixture(scope="module")
def loaded(run_dir):
    return load_run(run_dir)


@pytest.fixture(scope="module")
def cli():
    return load_script("sample.py")


def sample(cli, capsys, run_dir, *args):
    status = cli.main(["--run_dir", str(run_dir), *map(str, args)])
    out, err = capsys.readouterr()
    return status, out, err


PROMPT = "First Citizen:"  # bucket 16, three samples, twelve new tokens: the shape of PROMPTS
SAMPLING = ("--prompt", PROMPT, "--num_samples", 3, "--max_new_tokens", NEW, "--seed", 3)


def test_load_run_gives_the_saved_params_config_and_tokenizer(run_dir, loaded):
    params, cfg, tokenizer = loaded
    assert cfg == GPTConfig.from_dict(json.loads((run_dir / "config.json").read_text())["model"])
    assert tokenizer == tokenizers.load(run_dir / "tokenizer.json")
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), jax.device_get(random_params(cfg)))


def test_sample_py_prints_what_generate_text_gives(cli, capsys, run_dir, loaded):
    status, out, _ = sample(cli, capsys, run_dir, *SAMPLING)
    assert status == 0
    texts = generate_text(*loaded, [PROMPT] * 3, seed=3, max_new_tokens=NEW)
    assert out == f"\n{cli.DIVIDER}\n".join(PROMPT + text for text in texts) + "\n"
    assert len(set(texts)) == 3

    prompt_file = run_dir.parent / "prompt.txt"
    prompt_file.write_text(PROMPT)
    assert sample(cli, capsys, run_dir, *SAMPLING[2:], "--prompt_file", prompt_file)[1] == out


def parse_probs_line(line):
    """'…context ↦ 'a' 29%, ' ' <1%' → (context, [('a', 29), (' ', None)])."""
    context, choices = line.rsplit(" ↦ ", 1)
    pairs = re.findall(r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*") (\d+%|<1%)""", choices)
    return context, [(ast.literal_eval(token), None if p == "<1%" else int(p[:-1])) for token, p in pairs]


def test_sample_py_show_probs(cli, capsys, run_dir, loaded):
    params, cfg, tokenizer = loaded
    plain = sample(cli, capsys, run_dir, *SAMPLING)[1]
    status, out, _ = sample(cli, capsys, run_dir, *SAMPLING, "--show_probs", 3)
    assert status == 0
    # Per sample: a line per new token (an EOS drawn included), then the text as without --show_probs.
    news = sampling.generate(params, cfg, [tokenizer.encode(PROMPT)] * 3, jax.random.key(3), max_new_tokens=NEW,
                             eos_id=tokenizer.eos_id).new_tokens()
    samples, texts = out.split(f"\n{cli.DIVIDER}\n"), plain.split(f"\n{cli.DIVIDER}\n")
    assert len(samples) == len(texts) == 3
    log_p = naive_log_probs(cfg, jax.device_get(params), tokenizer.encode(PROMPT))
    top = np.argsort(-log_p)[:3]
    for lines, text, new in zip((s.split("\n") for s in samples), texts, news, strict=True):
        assert "\n".join(lines[len(new):]) == text
        context, choices = parse_probs_line(lines[0])
        assert context == PROMPT
        assert [token for token, _ in choices] == [tokenizer.decode([int(t)], keep_special=True) for t in top]
        for (_, shown), t in zip(choices, top, strict=True):
            percent = 100 * np.exp(log_p[t])
            assert percent < 1 if shown is None else abs(shown - percent) <= 0.51
        second_context = tokenizer.decode(tokenizer.encode(PROMPT) + [int(new[0])], keep_special=True)
        assert parse_probs_line(lines[1])[0] == second_context.replace("\n", "⏎")


def test_sample_py_streams_a_prompt_from_stdin(cli, capsys, run_dir, monkeypatch):
    expected = sample(cli, capsys, run_dir, *SAMPLING)[1]
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    status, out, _ = sample(cli, capsys, run_dir, *SAMPLING[2:], "--stream")
    assert status == 0 and out == expected


def test_sample_py_beams(cli, capsys, run_dir, loaded):
    params, cfg, tokenizer = loaded
    prompt = "Fi"  # two beams, eight new tokens, from two tokens: as in the beam search tests
    status, out, _ = sample(cli, capsys, run_dir, "--prompt", prompt, "--beams", 2, "--num_samples", 2,
                            "--max_new_tokens", 8)
    assert status == 0
    beams = jax.device_get(beam.beam_search(params, cfg, tokenizer.encode(prompt), num_beams=2, max_new_tokens=8,
                                            eos_id=tokenizer.eos_id))
    printed = [chunk.split("\n", 1) for chunk in out.split(f"\n{cli.DIVIDER}\n")]
    for i, (header, text) in enumerate(printed):
        assert header == f"# beam {i + 1}, score {beams.scores[i]:.4f}"
        assert text.removesuffix("\n") == tokenizer.decode(beams.tokens[i, :beams.lengths[i]])
    best = list(beams.tokens[0, :beams.lengths[0]])
    # the score is the continuation's float64 log-probability over its length
    new = best[len(prompt):]
    log_p = sum(naive_log_probs(cfg, jax.device_get(params), best[:len(prompt) + i])[t] for i, t in enumerate(new))
    np.testing.assert_allclose(beams.scores[0], log_p / len(new), rtol=1e-4)


@pytest.mark.parametrize("flags, compute", [
    (("--weights", "int8"), ComputeConfig(weights="int8")),
    (("--param_dtype", "bfloat16", "--kernel", "xla"), ComputeConfig(kernel="xla", dtype="bfloat16",
                                                                     param_dtype="bfloat16")),
], ids=["int8", "bfloat16"])
def test_sample_py_samples_with_the_compute_settings_it_is_given(cli, capsys, run_dir, flags, compute):
    """The printed samples are what generate draws from the run's params made for `compute`."""
    status, out, _ = sample(cli, capsys, run_dir, *SAMPLING, *flags)
    assert status == 0
    params, cfg, tokenizer = load_run(run_dir, compute=compute)
    result = sampling.generate(params, cfg, [tokenizer.encode(PROMPT)] * 3, jax.random.key(3), max_new_tokens=NEW,
                               eos_id=tokenizer.eos_id, compute=compute)
    texts = [PROMPT + tokenizer.decode(new) for new in result.new_tokens()]
    assert out == f"\n{cli.DIVIDER}\n".join(texts) + "\n"


@pytest.mark.parametrize("backend, dtype", [("cpu", "float32"), ("gpu", "bfloat16"), ("tpu", "bfloat16")])
def test_sample_py_keeps_the_weights_in_bfloat16_where_the_devices_compute_in_it(cli, monkeypatch, backend, dtype):
    """--param_dtype auto (the default): a GPU or TPU reads the weights in bfloat16, half the bytes of
    each token; a CPU keeps float32. --param_dtype and --dtype given win."""
    monkeypatch.setattr(cli.jax, "default_backend", lambda: backend)
    compute = cli.compute_settings(cli.parse_args(["--run_dir", "run"]))
    assert (compute.param_dtype, compute.dtype) == (dtype, dtype)
    chosen = cli.compute_settings(cli.parse_args(["--run_dir", "run", "--param_dtype", "float32"]))
    assert (chosen.param_dtype, chosen.dtype) == ("float32", "float32")


def test_sample_py_with_no_prompt_draws_each_sample_from_a_new_document(cli, capsys, run_dir):
    """An empty prompt (as no prompt at all) continues <|eos|>, the context that starts each
    document of the corpus; nothing is printed before the sample."""
    status, out, _ = sample(cli, capsys, run_dir, "--prompt", "", "--num_samples", 3, "--max_new_tokens", NEW,
                            "--seed", 3)
    assert status == 0
    params, cfg, tokenizer = load_run(run_dir)
    result = sampling.generate(params, cfg, [[tokenizer.eos_id]] * 3, jax.random.key(3), max_new_tokens=NEW,
                               eos_id=tokenizer.eos_id)
    assert out == f"\n{cli.DIVIDER}\n".join(tokenizer.decode(new) for new in result.new_tokens()) + "\n"


@pytest.mark.parametrize("args, message", [
    (("--prompt", "x", "--kernel", "flash"), "--kernel=flash needs a TPU, but the devices are cpu: use explicit or "
                                              "blocked or xla"),
    (("--prompt", "x", "--kernel", "cudnn"), "--kernel=cudnn needs a CUDA GPU, but the devices are cpu"),
    (("--prompt", "x", "--weights", "int8", "--attention_png", "a.png"),
     "--attention_png draws the float model's attention: drop --weights int8"),
    (("--prompt", "Zebra €"), r"characters the tokenizer cannot encode: 'Z', 'b', '€'"),
    (("--prompt", "x", "--stream", "--beams", 2), "beam search is deterministic .* drop --stream, or --beams"),
    (("--prompt", "x", "--temperature", -1), "temperature must be a finite number ≥ 0"),
    (("--prompt", "x", "--top_k", 0), "top_k must be a positive integer"),
    (("--prompt", "x", "--top_p", 1.5), r"top_p must be in \(0, 1\]"),
    (("--prompt", "x", "--show_probs", 0), "--show_probs must be a positive integer"),
    (("--prompt", "x", "--beams", 2, "--top_k", 5), "beam search is deterministic .* drop --top_k, or --beams"),
    (("--prompt", "x", "--beams", 2, "--num_samples", 3), "--num_samples=3 is more than --beams=2"),
    (("--prompt_file", "/nonexistent/prompt.txt"), "cannot read --prompt_file /nonexistent/prompt.txt"),
])
def test_sample_py_bad_input_gives_one_line(cli, capsys, run_dir, args, message):
    status, out, err = sample(cli, capsys, run_dir, *args)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and re.search(message, err), err


def test_sample_py_missing_run_dir_or_checkpoint(cli, capsys, tmp_path):
    status, _, err = sample(cli, capsys, tmp_path / "missing", "--prompt", "x")
    assert status == 2 and err == f"sample.py: error: run directory {tmp_path / 'missing'} does not exist: pass the " \
                                  "directory a training run wrote\n"
    empty = make_run_dir(tmp_path / "untrained", with_checkpoint=False)
    status, _, err = sample(cli, capsys, empty, "--prompt", "x")
    assert status == 2 and err.count("\n") == 1 and "no checkpoint in" in err and "train first" in err


def test_sample_py_step_that_is_not_there_names_the_steps_that_are(cli, capsys, tmp_path):
    run_dir = make_run_dir(tmp_path / "run")  # a checkpoint at step 3
    save_params(run_dir, 20, random_params(tiny()))
    status, out, err = sample(cli, capsys, run_dir, "--prompt", "First", "--step", 999)
    assert status == 2 and out == ""
    assert err == f"sample.py: error: no checkpoint at step 999 in {run_dir / 'checkpoints'}: the steps there are 3, " \
                  "20\n"


def test_sample_py_with_a_config_of_another_model_refuses_in_one_line(cli, capsys, tmp_path):
    """A config.json edited to another model: its shapes against the checkpoint's, in one line."""
    run_dir = make_run_dir(tmp_path / "run")
    saved = json.loads((run_dir / "config.json").read_text())
    saved["model"]["d_model"] = 32
    (run_dir / "config.json").write_text(json.dumps(saved))
    status, out, err = sample(cli, capsys, run_dir, "--prompt", "First")
    assert status == 2 and out == "" and err.count("\n") == 1
    # the config's head_dim (8) and n_head (2) stay: the attention's input kernel is d_model × 3 × 2 × 8
    assert "holds another model than the one asked for (params/h_0/attn/c_attn/kernel saved (16, 3, 2, 8) against " \
           "asked (32, 3, 2, 8); " in err

