"""Completions of records (jaxgpt.score.completions, eval.py --records, sample.py --record): the scores
on worked examples, the prompt and reference of hand-built examples, greedy answers against a
hand-rolled greedy loop over GPT.apply, prompts formatted against templates rendered by hand,
and train.py → eval.py --records → sample.py --record end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from scripts import load_script
from test_model import forward, random_params

from jaxgpt import GPTConfig, tokenizers
from jaxgpt.data import Examples
from jaxgpt.score.completions import (
    evaluate_completions,
    exact_match,
    greedy_completions,
    prompt_record,
    record_prompt,
    required_fields,
    split_last_completion,
    templates_named,
    token_f1,
)

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Question: 12+345=\nAnswer: 0123456789 User Assistant hi yo ### Instruction Response Input Context ()"
BLOCK = 16


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizers.train_tokenizer("char", [TEXT])


@pytest.fixture(scope="module")
def model(tokenizer):
    """A tiny model whose random params (seed 1) make greedy decoding wander over many tokens."""
    cfg = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=BLOCK, n_layer=1, n_head=2, d_model=16)
    return cfg, random_params(cfg, seed=1)


def hand_greedy(cfg, params, prompt, eos_id, max_new_tokens):
    """Greedy decoding by a full forward pass of GPT.apply per token over the last block_size
    tokens (padded at the end to block_size: one compiled shape; causal, so the padding after
    the last token does not change its logits)."""
    ids, new = [int(t) for t in prompt], []
    for _ in range(max_new_tokens):
        window = ids[-cfg.block_size:]
        padded = jnp.asarray([window + [0] * (cfg.block_size - len(window))], jnp.int32)
        logits = forward(cfg, params, padded)
        token = int(np.argmax(np.asarray(logits[0, len(window) - 1])))
        if token == eos_id:
            break
        new.append(token)
        ids.append(token)
    return new


# --- the scores, on worked examples -----------------------------------------------------------------


@pytest.mark.parametrize("prediction, reference, expected", [
    ("519", "519", True),
    ("  519\n", "519", True),  # surrounding whitespace does not count
    ("519", " 519 ", True),
    ("5 19", "519", False),  # inner whitespace does
    ("Paris", "paris", False),  # and case
    ("", "", True),
    ("", "519", False),
])
def test_exact_match(prediction, reference, expected):
    assert exact_match(prediction, reference) is expected


@pytest.mark.parametrize("prediction, reference, expected", [
    ("the cat sat", "the cat", 4 / 5),  # p = 2/3, r = 1: 2·(2/3)/(5/3)
    ("The the cat", "the dog the the", 4 / 7),  # shared {the: 2}: p = 2/3, r = 1/2: (2/3)/(7/6)
    ("A b", "b a", 1.0),  # a bag: order and case do not count
    ("x y", "z", 0.0),
    ("", "", 1.0),
    ("", "a", 0.0),
    ("a", "", 0.0),
    ("519.", "519", 0.0),  # no punctuation stripping
])
def test_token_f1(prediction, reference, expected):
    assert token_f1(prediction, reference) == pytest.approx(expected, abs=1e-12)


# --- prompts and references of examples ---------------------------------------------------------------


def build_examples(tokenizer, examples, numbers):
    """Examples as the cache holds them, built by hand: each turn's prompt (mask 0), then its
    completion and <|eos|> (mask 1)."""
    tokens, mask, starts = [], [], [0]
    for turns in examples:
        for prompt, completion in turns:
            prompt_ids, completion_ids = tokenizer.encode(prompt), tokenizer.encode(completion) + [tokenizer.eos_id]
            tokens += prompt_ids + completion_ids
            mask += [0] * len(prompt_ids) + [1] * len(completion_ids)
        starts.append(len(tokens))
    origins = np.array([[0, n] for n in numbers], np.int64).reshape(-1, 2)
    return Examples(np.array(tokens, np.uint16), np.array(mask, np.uint8), np.array(starts, np.int64), origins,
                    ("data.jsonl",))


def test_split_last_completion_of_one_turn_and_of_a_chat():
    E = 1
    one = split_last_completion(np.array([7, 8, 9, 4, 5, E]), np.array([0, 0, 0, 1, 1, 1]), E)
    assert [list(part) for part in one] == [[7, 8, 9], [4, 5]]
    # two turns: the prompt holds the first completion and its <|eos|>
    chat = split_last_completion(np.array([7, 8, 4, E, 9, 6, 5, 5, E]), np.array([0, 0, 1, 1, 0, 0, 1, 1, 1]), E)
    assert [list(part) for part in chat] == [[7, 8, 4, E, 9, 6], [5, 5]]
    # two completions with no prompt between them: the inner <|eos|> ends the first
    adjacent = split_last_completion(np.array([7, 4, E, 5, 6, E]), np.array([0, 1, 1, 1, 1, 1]), E)
    assert [list(part) for part in adjacent] == [[7, 4, E], [5, 6]]
    with pytest.raises(ValueError, match="no completion"):
        split_last_completion(np.array([7, 8]), np.array([0, 0]), E)


def test_greedy_completions_equal_a_hand_rolled_greedy_loop(model):
    cfg, params = model
    prompts = [np.array([5, 9, 22, 6]), np.array([12]), np.arange(4, 4 + BLOCK)]  # the last fills the block
    free = [hand_greedy(cfg, params, p, None, 8) for p in prompts]
    # the eos: the first new token of the first prompt's not drawn before; it stops there, the others as they go
    stop = next(k for k in range(1, 8) if free[0][k] not in free[0][:k])
    eos = free[0][stop]
    expected = [hand_greedy(cfg, params, p, eos, 8) for p in prompts]
    assert len(expected[0]) == stop and len(set(free[0] + free[1] + free[2])) > 3
    calls = []
    got = greedy_completions(params, cfg, prompts, eos_id=eos, max_new_tokens=8, batch_size=2,
                             on_batch=lambda done, total: calls.append((done, total)))
    assert [list(g) for g in got] == expected
    assert calls == [(1, 2), (2, 2)]


def test_evaluate_completions_rows_and_scores(tokenizer, model):
    cfg, params = model
    question = "Question: 12+3\nAnswer: "
    answer = tokenizer.decode(hand_greedy(cfg, params, tokenizer.encode(question), tokenizer.eos_id, 12))
    chat = [("User: hi\nAssistant: ", "yo"), ("User: hi\nAssistant: ", "hi")]
    examples = build_examples(tokenizer, [[(question, answer)], chat, [("Question: 45+1\nAnswer: ", "46")]], [3, 8, 9])
    summary, rows = evaluate_completions(params, cfg, tokenizer, examples, batch_size=4, max_new_tokens=12,
                                         max_records=2)
    assert len(rows) == 2 and summary["records"] == 2 and summary["skipped"] == 0
    assert [r["record"] for r in rows] == ["data.jsonl:3", "data.jsonl:8"]
    assert rows[0]["prompt"] == question and rows[0]["reference"] == answer
    assert rows[1]["prompt"] == "User: hi\nAssistant: yo<|eos|>User: hi\nAssistant: " and rows[1]["reference"] == "hi"
    for row, prompt in zip(rows, [question, "User: hi\nAssistant: yo"], strict=True):
        ids = tokenizer.encode(prompt) + ([tokenizer.eos_id] + tokenizer.encode("User: hi\nAssistant: ")
                                          if row is rows[1] else [])
        assert row["prediction"] == tokenizer.decode(hand_greedy(cfg, params, ids, tokenizer.eos_id,
                                                                 summary["max_new_tokens"]))
    assert rows[0]["exact"] is True and rows[0]["f1"] == 1.0
    assert rows[1]["exact"] == (rows[1]["prediction"].strip() == "hi")
    assert summary["exact_match"] == pytest.approx((1 + rows[1]["exact"]) / 2)
    assert summary["token_f1"] == pytest.approx((1 + token_f1(rows[1]["prediction"], "hi")) / 2)


# --- a record's prompt, as training formatted it -------------------------------------------------------


@pytest.mark.parametrize("preset, fields, expected", [
    ("qa", {"question": "12+3"}, "Question: 12+3\nAnswer: "),
    ("qa", {"context": "hi", "question": "12+3"}, "Context: hi\nQuestion: 12+3\nAnswer: "),
    ("alpaca", {"instruction": "hi"}, "### Instruction:\nhi\n\n### Response:\n"),
    ("alpaca", {"instruction": "hi", "input": "yo"}, "### Instruction:\nhi\n\n### Input:\nyo\n\n### Response:\n"),
    ("prompt_completion", {"prompt": "12+3="}, "12+3="),
])
def test_record_prompt_is_the_template_rendered(tokenizer, preset, fields, expected):
    text, ids = record_prompt(templates_named(preset), fields, tokenizer)
    assert text == expected and ids == tokenizer.encode(expected)


def test_record_prompt_of_a_chat_holds_the_earlier_turns(tokenizer):
    fields = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                           {"role": "user", "content": "12+3"}]}
    text, ids = record_prompt(templates_named("chat"), fields, tokenizer)
    expected = (tokenizer.encode("User: hi\nAssistant: ") + tokenizer.encode("yo") + [tokenizer.eos_id]
                + tokenizer.encode("User: 12+3\nAssistant: "))
    assert ids == expected and text == "User: hi\nAssistant: yo<|eos|>User: 12+3\nAssistant: "


def test_run_templates_and_raw_prompts(tokenizer):
    run = {"format": "records", "source": "ignored.jsonl",
           "records": {"template": None, "prompt_template": "Q={q}[[ ({note})]] ", "completion_template": "{a}"}}
    forms = templates_named("run", run)
    # a run directory written before data.records kept these keys flat in its data section
    flat = {"format": "records", "source": "ignored.jsonl", **run["records"], "packing": "pack"}
    assert templates_named("run", flat) == forms
    assert required_fields(forms.prompt) == ["q"]
    assert record_prompt(forms, {"q": "12"}, tokenizer)[0] == "Q=12 "
    assert record_prompt(forms, {"q": "12", "note": "hi"}, tokenizer)[0] == "Q=12 (hi) "
    assert prompt_record(templates_named("qa"), "1+2") == {"question": "1+2"}  # the first required field
    assert prompt_record(templates_named("alpaca"), "hi") == {"instruction": "hi"}
    assert prompt_record(templates_named("prompt_completion"), "hi") == {"prompt": "hi"}
    assert prompt_record(templates_named("chat"), "hi") == {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("name, data, fields, message", [
    ("qa", None, {"query": "1+2"}, "the record has no field 'question', which the prompt template"),
    ("run", {"format": "text"}, {"question": "1"}, "trained on 'text' data, not records"),
    ("squad", None, {"question": "1"}, "--template 'squad' is not a preset"),
    ("chat", None, {"question": "1"}, "has no 'messages' list"),
    ("qa", None, {"question": "1+2é"}, "the tokenizer cannot encode: 'é'"),
])
def test_record_prompt_errors_name_what_is_wrong(tokenizer, name, data, fields, message):
    with pytest.raises(ValueError, match=message) as caught:
        record_prompt(templates_named(name, data), fields, tokenizer)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("script, args, message", [
    ("eval.py", ["--run_dir", "r", "--max_records", "3"], "--max_records go with --records"),
    ("eval.py", ["--hf_dir", "h", "--data", "d", "--records"], "give --run_dir (not --hf_dir)"),
    ("eval.py", ["--run_dir", "r", "--records", "--max_new_tokens", "0"], "--max_new_tokens must be a positive"),
    ("eval.py", ["--run_dir", "r", "--records", "--predictions", "/no/dir/p.jsonl"], "/no/dir does not exist"),
    ("sample.py", ["--run_dir", "r", "--record", "{question: 1}"], "--record is not valid JSON"),
    ("sample.py", ["--run_dir", "r", "--record", "[1]"], "--record must be a JSON object"),
    ("sample.py", ["--hf_dir", "h", "--record", "{}"], "a Hugging Face model has no records template"),
    ("sample.py", ["--run_dir", "r", "--prompt", "x", "--template", "squad"], "--template 'squad' is not a preset"),
])
def test_cli_bad_records_arguments_give_one_line(capsys, script, args, message):
    assert load_script(script).main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{script}: error: ") and message in err and err.count("\n") == 1, err


# --- end to end: one subprocess sequence ---------------------------------------------------------------


def run_script(script, *args):
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=240, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_train_eval_records_and_sample_a_record_end_to_end(tmp_path):
    """train.py on 60 generated addition records, then eval.py --records and sample.py --record."""
    run = tmp_path / "run"
    overrides = {"data.source": "generated:addition:60", "data.cache_dir": tmp_path / "cache", "run_dir": run,
                 "model.n_layer": 1, "model.d_model": 32, "model.n_head": 2, "model.block_size": 32,
                 "train.steps": 12, "train.eval_every": 6, "train.ckpt_every": 6, "train.batch_size": 8,
                 "train.eval_batch_size": 8, "train.warmup_steps": 2, "train.log_every": 6, "mesh.cpu_devices": 1,
                 "sample.max_new_tokens": 0}
    trained = run_script("train.py", "--config=configs/finetune_records.py",
                         *[f"--config.{key}={value}" for key, value in overrides.items()])
    assert trained.returncode == 0, trained.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "val_loss" in metrics[-1] and metrics[-1]["step"] == 12

    kept = tmp_path / "kept_programs"  # eval.py keeps its compiled programs where --compilation_cache says
    evaluated = run_script("eval.py", "--run_dir", run, "--records", "--compilation_cache", kept)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert any(kept.iterdir())
    line, result = evaluated.stdout.splitlines()
    result = json.loads(result)
    held_out = round(60 * 0.05)  # the config's val_fraction
    assert line.startswith(f"records: {held_out} held-out, exact match ") and "token F1" in line
    assert result["records"] == held_out and result["loss"] == pytest.approx(metrics[-1]["val_loss"], rel=1e-4)
    rows = [json.loads(row) for row in (run / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == held_out
    assert all({"record", "prompt", "reference", "prediction", "exact"} <= set(row) for row in rows)
    assert all(row["prompt"].startswith("Question: ") and row["prompt"].endswith("\nAnswer: ") for row in rows)
    assert result["exact_match"] == pytest.approx(np.mean([row["exact"] for row in rows]))
    # char tokens: the longest reference's characters, + <|eos|> and the margin
    assert result["max_new_tokens"] == max(len(row["reference"]) for row in rows) + 8

    sampled = run_script("sample.py", "--run_dir", run, "--record", '{"question": "1+2"}')
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert len(sampled.stdout.splitlines()) == 1 and "Question" not in sampled.stdout  # the completion alone
    # sample.py --record gives a held-out record the answer eval.py found for it (both greedy)
    question = rows[0]["prompt"][len("Question: "):-len("\nAnswer: ")]
    again = run_script("sample.py", "--run_dir", run, "--record", json.dumps({"question": question}),
                       "--max_new_tokens", result["max_new_tokens"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout == rows[0]["prediction"] + "\n"
