"""jaxgpt as a model of the lm-evaluation-harness (the eval extra), checked against the harness's
own transformers backend (`--model hf`) on the GPT-2 export of the same run: the per-request
log-likelihoods, the accuracies and the greedy generations of the local tasks in
tests/data/harness; the KV-cache engine against float64 scores of each request alone, its
programs compiled ahead; loglikelihood_rolling against eval.py; eval.py --choices against the
harness; every tokenizer kind; bad model_args, found before the harness builds its tasks; the
command line."""

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from scripts import load_script
from test_choices import float64_score
from test_model import random_params

from jaxgpt import GPTConfig, export, tokenizers
from jaxgpt.checkpoint import Checkpoints
from jaxgpt.model import GPT
from jaxgpt.score import likelihood
from jaxgpt.train import rundir

lm_eval = pytest.importorskip("lm_eval", reason="the harness tests need the eval extra: pip install -e '.[eval]'")
harness = pytest.importorskip("jaxgpt.harness")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = "tests/data/harness"  # the tasks' data_files are relative to the repository's root
TASKS = ["jaxgpt_choices", "jaxgpt_completions", "jaxgpt_texts"]
TEXT = ("The king speaks to the queen. Then the lord goes there, and now the lady comes here!\n"
        "Q: What color is the sky?\nA: blue. The baker takes warm bread out of the oven.\n") * 8
VOCAB = 298  # the BPE below: 256 bytes, 41 merges, <|endoftext|>; every run here has this many ids, so they
BATCH = 8    # share their compiled programs
LONG_TEXT = ("Then the lord goes there, and now the lady comes here! The fishermen count their boats along the "
             "shore, and the baker takes warm bread out of the oven while the children build a snowman. ") * 2


def make_run(directory: Path, tokenizer, *, eval_stride=None) -> Path:
    cfg = GPTConfig(vocab_size=VOCAB, block_size=64, n_layer=2, n_head=2, d_model=32, d_ff=64)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model": cfg.to_dict(), "data": {"eval_stride": eval_stride}}))
    tokenizer.save(directory / "tokenizer.json")
    checkpoints = Checkpoints(directory)
    checkpoints.save(5, {"step": jnp.int32(5), "params": random_params(cfg), "opt_state": ()})
    checkpoints.close()
    return directory


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    """(the run, its GPT-2 export)."""
    root = tmp_path_factory.mktemp("harness")
    run = make_run(root / "run", tokenizers.train_gpt2_bpe([TEXT], VOCAB, root))
    assert export.main(["--run_dir", str(run), "--out", str(root / "hf")]) == 0
    return run, root / "hf"


@pytest.fixture(scope="module")
def in_root():
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        patch.setenv("HF_HUB_OFFLINE", "1")  # the tasks' data are local files; nothing to ask the Hub
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        yield


def evaluate(model: str, model_args: str) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, batch_size=BATCH,
                                   task_manager=TaskManager(include_path=str(ROOT / TASK_DIR), include_defaults=False),
                                   log_samples=True,
                                   bootstrap_iters=0)


@pytest.fixture(scope="module")
def results(gpt2_run, in_root):
    pytest.importorskip("torch", reason="the hf backend needs torch: pip install -e '.[eval]'")
    run, hf_dir = gpt2_run
    return {"hf": evaluate("hf", f"pretrained={hf_dir},dtype=float32,device=cpu"),
            "jaxgpt": evaluate("jaxgpt", f"run_dir={run}")}


def responses(result: dict, task: str) -> list:
    """Each request's response, in the order of the task's documents and their requests."""
    samples = sorted(result["samples"][task], key=lambda sample: sample["doc_id"])
    return [response[0] for sample in samples for response in sample["resps"]]


def test_loglikelihoods_and_accuracies_are_the_hf_backends(results):
    ours, theirs = responses(results["jaxgpt"], "jaxgpt_choices"), responses(results["hf"], "jaxgpt_choices")
    assert len(ours) == len(theirs) > 90
    np.testing.assert_allclose([float(s) for s, _ in ours], [float(s) for s, _ in theirs], atol=1e-4, rtol=0)
    assert [g for _, g in ours] == [g for _, g in theirs]
    assert np.ptp([float(s) for s, _ in ours]) > 10  # the scores differ from request to request: a test that can fail
    for metric in ("acc,none", "acc_norm,none", "acc_bytes,none"):
        assert results["jaxgpt"]["results"]["jaxgpt_choices"][metric] == results["hf"]["results"]["jaxgpt_choices"][
            metric]


def test_a_context_longer_than_the_block_is_cut_from_the_left(gpt2_run):
    """The task has such an item (the hf backend cuts it the same way, and agrees above); cut by hand, it
    scores the same."""
    run, _ = gpt2_run
    params, cfg, tokenizer = rundir.load_run(run)
    items = [json.loads(line) for line in (ROOT / TASK_DIR / "choices.jsonl").read_text().splitlines()]
    long = next(item for item in items if len(tokenizer.encode(item["context"])) > cfg.block_size)
    context, continuation = tokenizer.encode(long["context"]), tokenizer.encode(" " + long["choices"][0])
    kept = context[-(cfg.block_size + 1 - len(continuation)):]
    whole, cut = likelihood.score_continuations(GPT(cfg), params, [(context, continuation), (kept, continuation)],
                                                batch_size=BATCH)
    assert whole == cut and math.isfinite(whole[0])


def test_generations_are_the_hf_backends(results):
    ours, theirs = responses(results["jaxgpt"], "jaxgpt_completions"), responses(results["hf"], "jaxgpt_completions")
    assert ours == theirs
    assert sum(bool(text.strip()) for text in ours) >= len(ours) // 2  # mostly non-empty: the comparison says something


def test_rolling_loglikelihoods_of_texts_within_a_block_are_the_hf_backends(results, gpt2_run):
    """Within one block both read the whole text after <|endoftext|>; past it, the hf backend gives the last
    window a full context and jaxgpt counts its windows as eval.py does (the next test)."""
    tokenizer = rundir.read_run(gpt2_run[0])[2]
    texts = [json.loads(line)["text"] for line in (ROOT / TASK_DIR / "texts.jsonl").read_text().splitlines()]
    ours, theirs = responses(results["jaxgpt"], "jaxgpt_texts"), responses(results["hf"], "jaxgpt_texts")
    within = [i for i, text in enumerate(texts) if len(tokenizer.encode(text)) < 64]
    assert len(within) == 2 and len(texts) == 3
    np.testing.assert_allclose([ours[i] for i in within], [theirs[i] for i in within], atol=1e-4, rtol=0)


@pytest.mark.parametrize("stride", [None, 24])
def test_rolling_windows_are_those_of_eval_py(gpt2_run, tmp_path, capsys, stride):
    """eval.py's total NLL on a text of two blocks equals −score_texts of its tokens (the first one read,
    not scored), and loglikelihood_rolling is score_texts after <|endoftext|>, with the run's eval stride."""
    run, _ = gpt2_run
    (tmp_path / "text.txt").write_text(LONG_TEXT, encoding="utf-8")
    args = ["--run_dir", str(run), "--data", str(tmp_path / "text.txt"), "--split", "all", "--cache_dir",
            str(tmp_path / "cache"), *(["--stride", str(stride)] if stride else [])]
    assert load_script("eval.py").main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    params, cfg, tokenizer = rundir.load_run(run)
    tokens = tokenizer.encode(LONG_TEXT)
    assert len(tokens) > 2 * cfg.block_size
    score = likelihood.score_texts(GPT(cfg), params, [tokens], batch_size=BATCH, stride=stride)[0]
    assert result["tokens"] == len(tokens) - 1
    assert -score == pytest.approx(result["loss"] * result["tokens"], rel=1e-5)
    model = harness.JaxGPT(run_dir=str(run), stride=stride, batch_size=BATCH)
    rolling = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (LONG_TEXT,), 0)], disable_tqdm=True)
    expected = likelihood.score_texts(GPT(cfg), params, [[tokenizer.eos_id, *tokens]], batch_size=BATCH,
                                      stride=stride)
    assert rolling == expected


def test_eval_py_choices_gives_the_harness_accuracies(results, gpt2_run, tmp_path, capsys):
    run, _ = gpt2_run
    predictions = tmp_path / "predictions.jsonl"
    status = load_script("eval.py").main(["--run_dir", str(run), "--choices", str(ROOT / TASK_DIR / "choices.jsonl"),
                                          "--predictions", str(predictions), "--batch_size", str(BATCH)])
    out = capsys.readouterr().out.strip().splitlines()
    assert status == 0 and out[0].startswith("choices: 30 items, acc ")
    summary = json.loads(out[-1])
    harness_metrics = results["jaxgpt"]["results"]["jaxgpt_choices"]
    for metric in ("acc", "acc_norm", "acc_bytes"):
        assert summary[metric] == harness_metrics[f"{metric},none"]
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    scores = [s for row in rows for s in row["loglikelihoods"]]
    np.testing.assert_allclose(scores, [float(s) for s, _ in responses(results["jaxgpt"], "jaxgpt_choices")],
                               atol=1e-5, rtol=0)


def test_a_task_compiles_one_scoring_program_whatever_its_lengths(results, gpt2_run):
    """The choices (contexts and continuations of many lengths) go through the engine, whose reads and scores
    are one program when block_size ≤ 256, compiled once; the rolling texts through one program per length
    bucket."""
    cfg = rundir.read_run(gpt2_run[0])[1]
    programs = likelihood.engine(GPT(cfg), BATCH).programs
    assert [program._cache_size() for program in programs] == [1]
    assert likelihood._scorer(GPT(cfg))._cache_size() <= 3  # buckets 16, 32, 64


# --- the KV-cache engine ------------------------------------------------------------------------------


def engine_cases(rng, block_size: int) -> list[tuple[list[int], list[int]]]:
    """Contexts of 1 token to past the block (cut from the left), continuations of 1 token to the whole
    block, sharing contexts in groups of different sizes, and an empty continuation."""
    contexts = [list(rng.integers(0, VOCAB, n)) for n in (1, 3, 17, 30, block_size - 1, block_size + 20)]
    pairs = [(x, list(rng.integers(0, VOCAB, m))) for k, x in enumerate(contexts)
             for m in (1, 5, 16, 17, 33, block_size)[:2 + k]]
    return [*pairs, (contexts[2], [])]


@pytest.mark.parametrize("batch_size, block_size, widths", [(1, 48, (32, 32)), (3, 48, (32, 32)), (8, 48, (32, 32)),
                                                        (3, 400, (50, 32))])
def test_the_engine_scores_each_request_as_float64_alone(batch_size, block_size, widths):
    """Contexts read read_width tokens a call, then each row's continuations one after another in the slots
    after its context, score_width tokens a call, the windows past the block's end moved back into it: the
    scores and greedy flags of each (context, continuation) read alone in float64 NumPy."""
    cfg = GPTConfig(vocab_size=VOCAB, block_size=block_size, n_layer=2, n_head=2, d_model=32, d_ff=64,
                    positions="rope")
    params = random_params(cfg)
    pairs = engine_cases(np.random.default_rng(batch_size), cfg.block_size)
    assert likelihood.widths(cfg.block_size) == widths
    assert len(likelihood.engine(GPT(cfg), batch_size).programs) == len(set(widths))
    scores = likelihood.score_continuations(GPT(cfg), params, pairs, batch_size=batch_size)
    expected = [float64_score(cfg, params, x, c) if c else (0.0, True) for x, c in pairs]
    np.testing.assert_allclose([s for s, _ in scores], [s for s, _ in expected], rtol=1e-5, atol=1e-4)
    assert [g for _, g in scores] == [g for _, g in expected]
    assert scores[-1] == (0.0, True) and min(s for s, _ in scores[:-1]) < -100  # long continuations count


@pytest.mark.parametrize("block_size", [64, 512])
def test_prepared_programs_serve_every_length_without_compiling(block_size):
    """prepare compiles the engine's programs (and runs each once); requests of any length then compile
    nothing."""
    cfg = GPTConfig(vocab_size=VOCAB, block_size=block_size, n_layer=2, n_head=2, d_model=32, d_ff=64)
    params, model = random_params(cfg), GPT(cfg)
    likelihood.prepare(model, params, 5)
    programs = likelihood.engine(model, 5).programs
    assert [program._cache_size() for program in programs] == [1] * (2 if block_size > 256 else 1)
    pairs = engine_cases(np.random.default_rng(0), cfg.block_size)
    done = []
    likelihood.score_continuations(model, params, pairs, batch_size=5, on_batch=lambda d, t: done.append((d, t)))
    assert [program._cache_size() for program in programs] == [1] * len(programs)
    assert done == [(d, done[-1][1]) for d in range(1, done[-1][1] + 1)]  # each batch of continuations, in order


# --- every tokenizer, text it cannot encode ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["char", "word", "wordpiece", "unigram"])
def test_every_tokenizer_kind_answers_all_requests_and_names_unknown_text_once(tmp_path, caplog, kind):
    tokenizer = tokenizers.train_tokenizer(kind, [TEXT], **({"vocab_size": 120} if kind in ("wordpiece", "unigram")
                                                             else {}))
    assert tokenizer.vocab_size <= VOCAB
    model = harness.JaxGPT(run_dir=str(make_run(tmp_path / "run", tokenizer)), batch_size=BATCH)
    foreign = "Ωμέγα 😀 zebra"  # characters and a word the tokenizer never saw
    requests = [Instance("loglikelihood", {}, ("The king speaks to", " the queen"), 0),
                Instance("loglikelihood", {}, (foreign, " the lord"), 1)]
    with caplog.at_level(logging.WARNING, logger="jaxgpt.harness"):
        scores = model.loglikelihood(requests, disable_tqdm=True)
        rolling = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (foreign + " here",), 0)])
        texts = model.generate_until([Instance("generate_until", {}, (foreign, {"until": ["\n"], "max_gen_toks": 12}),
                                               0)])
    assert all(math.isfinite(score) for score, _ in scores) and math.isfinite(rolling[0]) and len(texts) == 1
    warnings = [record.getMessage() for record in caplog.records if "<|unk|>" in record.getMessage()]
    counts = [(tokenizer.count_unknown(text), seen) for text, seen in
              ((foreign + " the lord", 2), (foreign + " here", 1), (foreign, 1))]
    assert all(count > 0 for count, _ in counts)
    assert warnings == [f"jaxgpt: {count} piece(s) of text in 1 of {seen} requests have no token in the model's "
                        f"{kind} tokenizer: they were read as <|unk|>, so their scores mean less"
                        for count, seen in counts]


# --- model_args and the command line ------------------------------------------------------------------


@pytest.mark.parametrize("model_args, message", [
    ("step=3", "model_args needs run_dir=RUN, the directory a jaxgpt training run wrote"),
    ("run_dir={run},temperature=0.5", "model_args temperature: jaxgpt takes run_dir, step, batch_size, stride, seed "
                                      "(run_dir=RUN is required)"),
    ("run_dir={run}/nowhere", "model_args run_dir={run}/nowhere: run directory {run}/nowhere does not exist: pass "
                              "the directory a training run wrote"),
    ("run_dir={run},step=7", "model_args step=7: no checkpoint at step 7 in {run}/checkpoints: the steps there are 5"),
    ("run_dir={run},batch_size=many", "batch_size='many': must be a positive integer (or auto: 16)"),
    ("run_dir={run},stride=65", "model_args stride=65: must be at most the model's block_size=64"),
])
def test_bad_model_args_are_one_line_errors(gpt2_run, model_args, message):
    run, _ = gpt2_run
    with pytest.raises(harness.ModelArgsError) as error:
        harness.JaxGPT.create_from_arg_string(model_args.format(run=run), {"batch_size": 1, "device": "cuda:0"})
    assert str(error.value) == message.format(run=run)


def load_module_main():
    from jaxgpt.harness.__main__ import main

    return main


@pytest.fixture
def local_tasks_only(monkeypatch):
    """The command line indexes only the tasks of --include_path: the harness's thousands of built-in
    tasks take seconds to index, and none is used here."""
    from lm_eval.tasks.manager import TaskManager as Manager

    original = Manager.__init__
    monkeypatch.setattr(Manager, "__init__", lambda self, *args, include_defaults=True, **kwargs: original(
        self, *args, include_defaults=False, **kwargs))


def harness_process(model_args: str, *options: str) -> subprocess.CompletedProcess:
    """`python -X importtime -m jaxgpt.harness --model jaxgpt …` on the local choices task, in the
    repository's root: stderr names every module the process imported ("import time: … | name")."""
    command = [sys.executable, "-X", "importtime", "-m", "jaxgpt.harness", "--model", "jaxgpt", "--model_args",
               model_args, "--tasks", "jaxgpt_choices", "--include_path", TASK_DIR, *options]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})


def imported(stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def said(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("import time:")]


@pytest.mark.parametrize("model_args, message", [
    ("run_dir={run}/nowhere", "model_args run_dir={run}/nowhere: run directory {run}/nowhere does not exist: pass "
                              "the directory a training run wrote"),
    ("run_dir={run},temperature=0.5", "model_args temperature: jaxgpt takes run_dir, step, batch_size, stride, seed "
                                      "(run_dir=RUN is required)"),
    ("run_dir={run},batch_size=abc", "batch_size='abc': must be a positive integer (or auto: 16)"),
    ("step=3", "model_args needs run_dir=RUN, the directory a jaxgpt training run wrote"),
])
def test_the_command_line_says_bad_model_args_before_it_imports_the_tasks_or_jax(gpt2_run, model_args, message):
    """The only line on stderr is the error, and the process ends before it imports the harness's tasks
    (whose index of the built-in tasks takes seconds) or JAX: the harness's parser has read the line."""
    run, _ = gpt2_run
    out = harness_process(model_args.format(run=run))
    assert out.returncode == 2, out.stderr[-2000:]
    assert said(out.stderr) == [f"jaxgpt.harness: error: {message.format(run=run)}"]
    modules = imported(out.stderr)
    assert "lm_eval._cli.run" in modules  # the check can fail: the names of what was imported are there
    assert not {"lm_eval.tasks", "lm_eval.evaluator", "jax"} & modules


@pytest.mark.parametrize("model_args, message", [
    ("run_dir={run},step=7", "model_args step=7: no checkpoint at step 7 in {run}/checkpoints: the steps there are "
                             "5"),
    ("run_dir={run},stride=65", "model_args stride=65: must be at most the model's block_size=64"),
])
def test_the_command_line_says_a_run_that_cannot_load_before_it_builds_the_tasks(gpt2_run, model_args, message):
    """The run loads on its own thread while the harness indexes its tasks: its error ends the command in
    one line, whether it interrupts the indexing or the model finds it; the tasks are never built."""
    run, _ = gpt2_run
    out = harness_process(model_args.format(run=run))
    assert out.returncode == 2, out.stderr[-2000:]
    assert said(out.stderr)[-1] == f"jaxgpt.harness: error: {message.format(run=run)}"
    assert "Building contexts" not in out.stderr  # what the harness logs as it builds a task's requests
    assert "Traceback" not in out.stderr and "KeyboardInterrupt" not in out.stderr


def test_the_command_line_evaluates_a_run_on_a_local_task(gpt2_run, in_root, local_tasks_only, capsys):
    run, _ = gpt2_run
    status = load_module_main()(["--model", "jaxgpt", "--model_args", f"run_dir={run},batch_size={BATCH}",
                                 "--tasks", "jaxgpt_choices", "--include_path", TASK_DIR, "--limit", "6"])
    out = capsys.readouterr().out
    assert status == 0
    table = [line for line in out.splitlines() if line.startswith("|jaxgpt_choices")]
    assert table and "acc" in table[0], out
    assert os.getcwd() == str(ROOT)
