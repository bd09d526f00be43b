"""Multiple choice without the harness (jaxgpt.score.choices, jaxgpt.score.likelihood): items read from JSONL in
both forms, requests encoded as the harness encodes them, the accuracies on a worked example, and
the batched, bucketed scores against a float64 NumPy evaluation of the model's logits."""

import functools
import json

import jax
import numpy as np
import pytest
from test_model import random_params

from jaxgpt import GPTConfig, tokenizers
from jaxgpt.model import GPT
from jaxgpt.score import choices, likelihood

TEXT = "the king speaks to the queen. the lord goes there, and the lady comes here!\n"


@pytest.fixture(scope="module")
def char():
    return tokenizers.train_tokenizer("char", [TEXT])


def write_lines(path, lines):
    path.write_text("\n".join(json.dumps(line) if not isinstance(line, str) else line for line in lines) + "\n")
    return path


def test_items_are_read_in_both_forms(tmp_path):
    path = write_lines(tmp_path / "items.jsonl", [
        {"context": "A man bakes", "choices": ["bread.", "a cloud."], "label": 0}, "",
        {"ind": 7, "ctx": "A woman runs", "endings": ["fast.", "upward.", "into soup."], "label": "2"}])
    assert choices.read_items(path) == [choices.Item("A man bakes", ("bread.", "a cloud."), 0),
                                        choices.Item("A woman runs", ("fast.", "upward.", "into soup."), 2)]


@pytest.mark.parametrize("line, message", [
    ("{not json", "{path}:2 is not JSON (Expecting property name enclosed in double quotes): give one record per line"),
    ({"context": "x", "label": 0}, "{path}:2 needs the fields context, choices and label (or HellaSwag's ctx, "
                                   "endings, label)"),
    ({"context": "x", "choices": ["a"], "label": 1}, "{path}:2: label must be the index of the right choice, 0…0, "
                                                     "got 1"),
    ({"context": "x", "choices": [], "label": 0}, "{path}:2: context must be a string and choices a non-empty list "
                                                  "of strings"),
])
def test_a_bad_item_is_a_one_line_error_naming_its_line(tmp_path, line, message):
    path = write_lines(tmp_path / "items.jsonl", [{"context": "ok", "choices": ["a", "b"], "label": 1}, line])
    with pytest.raises(ValueError) as error:
        choices.read_items(path)
    assert str(error.value) == message.format(path=path)


def test_requests_are_encoded_as_the_harness_encodes_them(char):
    """Trailing whitespace of the context belongs to the continuation; an empty context is <|eos|>."""
    assert choices.encode_request(char, "the king ", "speaks") == (char.encode("the king"), char.encode(" speaks"))
    assert choices.encode_request(char, "", " the lord") == ([char.eos_id], char.encode(" the lord"))


def test_accuracies_on_a_worked_example():
    """Item 1: ℓ = (−2.2, −3.0) for "ab", "éé" (2 characters each, 2 and 4 bytes): acc and acc_norm pick
    "ab" (−1.1 > −1.5 per character), acc_bytes picks "éé" (−0.75 > −1.1 per byte); item 2 is right by all."""
    items = [choices.Item("x", ("ab", "éé"), 1), choices.Item("y", ("a", "bbbb"), 1)]
    summary, rows = choices.accuracies(items, [[-2.2, -3.0], [-3.0, -2.0]])
    assert summary == {"items": 2, "acc": 0.5, "acc_norm": 0.5, "acc_bytes": 1.0}
    assert [(r["prediction"], r["prediction_norm"], r["prediction_bytes"]) for r in rows] == [(0, 0, 1), (1, 1, 1)]


@functools.cache
def forward(cfg):
    return jax.jit(lambda params, tokens: GPT(cfg).apply({"params": params}, tokens))


def padded_logits(cfg, params, tokens):
    """The logits (n, V) of n ≤ block_size tokens, in float64, from one padded pass."""
    padded = np.zeros((1, cfg.block_size), np.int32)
    padded[0, :len(tokens)] = tokens
    return np.asarray(forward(cfg)(params, padded), np.float64)[0, :len(tokens)]


def float64_score(cfg, params, context, continuation):
    """log p(continuation | context) and greedy, from the model's logits in float64 NumPy, the sequence cut
    from the left to block_size + 1 tokens by hand (and padded after its end to one width: the mask is causal)."""
    whole = np.array([*context, *continuation])[-(cfg.block_size + 1):]
    logits = padded_logits(cfg, params, whole[:-1])
    logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    rows = np.arange(len(whole) - 1 - len(continuation), len(whole) - 1)
    return logprobs[rows, whole[rows + 1]].sum(), bool(np.all(logits[rows].argmax(-1) == whole[rows + 1]))


def test_batched_bucketed_scores_are_the_float64_scores(char):
    cfg = GPTConfig(vocab_size=char.vocab_size, block_size=32, n_layer=2, n_head=2, d_model=16, d_ff=32)
    params = random_params(cfg)
    ids = char.encode(TEXT)
    greedy = ids[:5]
    for _ in range(4):  # the greedy continuation, one argmax at a time
        greedy = [*greedy, int(padded_logits(cfg, params, greedy)[-1].argmax())]
    pairs = [(ids[:5], greedy[5:]), (ids[:3], ids[3:9]), (ids[:40], ids[40:45]),
             (ids[:2], ids[2:3]), (ids[:20], ids[20:31]), ([char.eos_id], ids[:7])]
    scores = likelihood.score_continuations(GPT(cfg), params, pairs, batch_size=4)
    expected = [float64_score(cfg, params, x, c) for x, c in pairs]
    np.testing.assert_allclose([s for s, _ in scores], [s for s, _ in expected], rtol=1e-5, atol=1e-4)
    assert [g for _, g in scores] == [g for _, g in expected] and scores[0][1]
    with pytest.raises(ValueError, match="longer than the model's context"):
        likelihood.score_continuations(GPT(cfg), params, [(ids[:1], ids[1:34])], batch_size=4)


def test_choices_sharing_a_context_score_as_each_alone_in_float64(char):
    """Choices of one context are read after one KV cache of it: the same log-probabilities and
    greedy flags as each (context, choice) scored alone, in float64; groups of different sizes,
    contexts and choices of different lengths, in batches that mix them."""
    cfg = GPTConfig(vocab_size=char.vocab_size, block_size=32, n_layer=2, n_head=2, d_model=16, d_ff=32,
                    positions="rope")
    params = random_params(cfg)
    ids = char.encode(TEXT)
    pairs = [(ids[:9], ids[9:12]), (ids[:9], ids[20:27]), (ids[:9], ids[30:31]), (ids[:9], ids[40:44]),
             (ids[50:53], ids[60:62]), (ids[50:53], ids[9:18]), (ids[:2], ids[2:5]), (ids[70:90], ids[5:8]),
             (ids[70:90], ids[3:4]), (ids[:9], [])]
    scores = likelihood.score_continuations(GPT(cfg), params, pairs, batch_size=4)
    expected = [float64_score(cfg, params, x, c) if c else (0.0, True) for x, c in pairs]
    np.testing.assert_allclose([s for s, _ in scores], [s for s, _ in expected], rtol=1e-5, atol=1e-4)
    assert [g for _, g in scores] == [g for _, g in expected]
