"""Whole runs (jaxgpt.train.run and train.py): resume, checkpoints kept and damaged, failures, the
CLI, kill -9, several processes, signals, and a run directory from before the restructure."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from processes import free_port
from runs import TINY_OVERRIDES, cli_args, tiny_config, trained_run, write_corpus

from jaxgpt import ComputeConfig, GPTConfig, sharding

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


def final_params(run_dir, step=None):
    from jaxgpt.blocks import layers_as
    from jaxgpt.checkpoint import Checkpoints
    from jaxgpt.model import GPT
    from jaxgpt.train.rundir import saved_compute

    saved = json.loads((Path(run_dir) / "config.json").read_text())
    written = saved_compute(saved)  # the layout and dtype its checkpoints hold
    model = GPT(GPTConfig.from_dict(saved["model"]), ComputeConfig(param_dtype=written.param_dtype,
                                                                  scan_layers=written.scan_layers))
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"])
    checkpoints = Checkpoints(run_dir, read_only=True)
    params, _ = checkpoints.restore_params(abstract, step=step if step is not None else checkpoints.steps()[-1])
    checkpoints.close()
    return layers_as(params, False)


def assert_trees_close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


def test_resume_equals_uninterrupted(tmp_path, tmp_path_factory, corpus):
    from jaxgpt.train.run import train

    first = train(tiny_config(tmp_path, corpus, "split", **{"train.steps": 3}))
    assert first["step"] == 3
    resumed = train(tiny_config(tmp_path, corpus, "split", **{"train.steps": 6}))
    whole_dir, whole = trained_run(tmp_path_factory)  # TINY_OVERRIDES: 6 steps
    assert resumed["step"] == whole["step"] == 6
    assert_trees_close(final_params(tmp_path / "split"), final_params(whole_dir), atol=1e-6)
    assert resumed["val_loss"] == pytest.approx(whole["val_loss"], abs=1e-6)
    records = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # the resumed run took up at step 4


def test_keeps_last_checkpoints_and_best_by_validation_loss(tmp_path, corpus):
    from jaxgpt.checkpoint import Checkpoints
    from jaxgpt.train.run import train

    train(tiny_config(tmp_path, corpus, **{"train.steps": 12, "train.ckpt_every": 2, "train.eval_every": 4,
                                          "train.keep_checkpoints": 2}))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    best = min(val, key=val.get)
    checkpoints = Checkpoints(tmp_path / "run", read_only=True)
    assert set(checkpoints.steps()) == {10, 12} | {best}
    assert checkpoints.best_step() == best
    checkpoints.close()


def test_resume_modes_and_another_model_in_the_run_dir(tmp_path, corpus):
    from jaxgpt.train.run import TrainingError, train

    with pytest.raises(TrainingError, match="resume='must' but .* has no checkpoint"):
        train(tiny_config(tmp_path, corpus, **{"train.steps": 3}, resume="must"))
    train(tiny_config(tmp_path, corpus, **{"train.steps": 3}))
    with pytest.raises(TrainingError, match="resume='never' but .* already holds checkpoints"):
        train(tiny_config(tmp_path, corpus, **{"train.steps": 6}, resume="never"))
    with pytest.raises(TrainingError, match="holds a run of another model"):
        train(tiny_config(tmp_path, corpus, **{"train.steps": 6, "model.d_model": 32}))


@pytest.mark.parametrize("damage", ["arrays", "everything"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, corpus, caplog, damage):
    from jaxgpt.train.run import train

    train(tiny_config(tmp_path, corpus))  # checkpoints at steps 3 and 6
    for f in (tmp_path / "run" / "checkpoints" / "6").rglob("*"):
        is_metadata = "METADATA" in f.name or f.parent.name == "metrics" or f.suffix == ".json"
        if f.is_file() and f.stat().st_size > 0 and (damage == "everything" or not is_metadata):
            f.write_bytes(b"\0garbage")
    caplog.set_level("WARNING")
    result = train(tiny_config(tmp_path, corpus, **{"train.steps": 9}))
    assert "checkpoint at step 6" in caplog.text and "unreadable" in caplog.text
    assert result["step"] == 9
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records][-6:] == [4, 5, 6, 7, 8, 9]  # redone from step 3


def test_nan_loss_stops_the_run_naming_the_step(tmp_path, corpus):
    from jaxgpt.train.run import TrainingError, train

    with pytest.raises(TrainingError, match=r"non-finite loss .* at step \d+: stopping"):
        train(tiny_config(tmp_path, corpus, **{"train.lr": 1e30, "train.clip": 0.0, "train.steps": 6}))


def run_train_py(args, env=None, timeout=240):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env={**os.environ, **(env or {})})


def test_train_py_end_to_end_then_sample(tmp_path, corpus):
    out = run_train_py(cli_args(tmp_path, corpus, **{"sample.max_new_tokens": 20, "sample.prompt": "The"}))
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 6 and "val_loss" in records[-1] and records[-1]["tokens_per_sec"] > 0
    assert {"train_loss", "lr", "grad_norm", "mfu", "elapsed"} <= set(records[0])
    assert (run / "checkpoints" / "6").is_dir()
    assert (run / "loss.png").stat().st_size > 1000
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["vocab_size"] > 0 and saved["train"]["steps"] == 6
    sample = (run / "sample.txt").read_text()
    assert sample.startswith("The") and sample in out.stdout
    cores = sharding.auto_cpu_devices(sharding.available_cores(), [TINY_OVERRIDES["train.batch_size"]])
    assert f"{cores} cpu device(s), mesh {{'data': {cores}," in out.stderr  # one device per core

    # sample.py on the run directory these training steps made: streamed, with next-token probabilities; as on
    # a user's machine (no JAX_COMPILATION_CACHE_DIR) its programs are kept in ~/.cache/jaxgpt/xla for the next
    home = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"} | {
        "XDG_CACHE_HOME": str(tmp_path / "user_cache")}
    sampled = subprocess.run([sys.executable, str(ROOT / "sample.py"), "--run_dir", str(run), "--prompt", "The king",
                              "--max_new_tokens", "5", "--stream", "--show_probs", "3"],
                             capture_output=True, text=True, cwd=ROOT, timeout=240, env=home)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert "The king" in sampled.stdout and "%" in sampled.stdout and "↦" in sampled.stdout
    assert any((tmp_path / "user_cache" / "jaxgpt" / "xla").iterdir())


@pytest.mark.parametrize("override, message", [
    ("--config.train.no_such_key=1", "no key 'train.no_such_key'"),
    ("--config.train.lrr=1", "no key 'train.lrr'; did you mean 'train.lr'?"),
    ("--config.train.eval_every=0", "train.eval_every=0: must be a positive integer"),
    ("--config.train.lr=-0.1", "train.lr=-0.1: must be a number ≥ 0"),
    ("--config.train.steps=many", "steps"),
    ("--config.xla_flags=fast", "xla_flags='fast' is no flag preset: use one of default, cublas"),
])
def test_train_py_bad_override_is_a_one_line_error(tmp_path, corpus, override, message, capsys):
    """As a user's shell runs it (its whole stderr one line); the overrides train.py's own parse
    refuses (a key's name, a value's type) through that function in this process: the same exit
    status and line, without a process each."""
    if not override.startswith(("--config.train.lrr", "--config.train.steps")):
        out = run_train_py(cli_args(tmp_path, corpus) + [override])
        status, stderr = out.returncode, out.stderr
    else:
        with pytest.raises(SystemExit) as exited:
            train_py().parse(["train.py", *cli_args(tmp_path, corpus), override])
        status, stderr = exited.value.code, capsys.readouterr().err
    assert status == 2
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("train.py: ") and message in lines[0], stderr


def train_py():
    """train.py as a module (its main not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_py", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_py_bad_setting_is_a_one_line_error(tmp_path, corpus):
    out = run_train_py(cli_args(tmp_path, corpus, **{"model.n_head": 3}))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("train.py: GPTConfig.d_model=16 is not divisible by n_head=3")


def test_killed_run_resumes_from_its_last_checkpoint(tmp_path, corpus):
    """kill -9 mid-run: the next run starts at the newest finished checkpoint, at most
    2·ckpt_every steps back with asynchronous saves (the default; synchronous ones, at most
    ckpt_every: test_killed_three_times_ends_bit_for_bit_where_an_uninterrupted_run_ends)."""
    import time

    args = cli_args(tmp_path, corpus, **{"train.steps": 100000, "train.decay_steps": 100000,
                                         "train.ckpt_every": 2, "train.eval_every": 1000,
                                         "train.async_checkpoints": True})
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = tmp_path / "run" / "checkpoints"
    deadline = time.monotonic() + 120
    while not (checkpoints.is_dir() and any(p.name.isdigit() and int(p.name) >= 6 for p in checkpoints.iterdir())):
        assert proc.poll() is None and time.monotonic() < deadline, "training did not reach step 6"
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    reached = records[-1]["step"]
    resume_args = cli_args(tmp_path, corpus, **{"train.steps": reached + 3, "train.decay_steps": 100000,
                                                "train.ckpt_every": 2, "train.eval_every": 1000})
    out = run_train_py(resume_args + ["--config.resume=must"])
    assert out.returncode == 0, out.stderr[-3000:]
    resumed_from = int(out.stderr.split("resuming at step ")[1].split(";")[0])
    # `reached` (the last step logged) is at most where the run was killed. A synchronous save
    # finishes before the next step; an asynchronous one may still be in flight when the kill
    # lands, and then the newest finished checkpoint is the one ckpt_every steps before it.
    # A saving step's record is written once its save returns (it holds checkpoint_seconds),
    # so the kill may land between the two: the checkpoint one step past the last record.
    lost = 2 * 2  # 2·ckpt_every: the last save may still have been under way when the run was killed
    assert reached - lost <= resumed_from <= reached + 1
    assert resumed_from % 2 == 0 and resumed_from >= 6


def test_two_processes_train_together_like_one(tmp_path, corpus):
    """Two local processes (one CPU device each) on 127.0.0.1 share each batch, half the rows
    each, and end where one process with the whole batch ends."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *cli_args(tmp_path, corpus, "pair", **{"mesh.cpu_devices": 1}),
             f"--config.distributed.coordinator_address=127.0.0.1:{port}",
             "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert "2 cpu device(s)" in outputs[0][1]
    single = run_train_py(cli_args(tmp_path, corpus, "single"))
    assert single.returncode == 0, single.stderr[-3000:]
    assert_trees_close(final_params(tmp_path / "pair"), final_params(tmp_path / "single"), atol=1e-5)
    losses = [[json.loads(line)["train_loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
              for run in ("pair", "single")]
    np.testing.assert_allclose(losses[0], losses[1], atol=1e-5)


def test_sigterm_saves_a_checkpoint_and_exits(tmp_path, corpus):
    """Preemption: SIGTERM stops after the current step, saves it, and says how to resume."""
    import signal
    import time

    args = cli_args(tmp_path, corpus, **{"train.steps": 100000, "train.decay_steps": 100000,
                                         "train.ckpt_every": 1000, "train.eval_every": 1000})
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, "training did not reach step 3"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    last_step = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert (tmp_path / "run" / "checkpoints" / str(last_step)).is_dir()  # saved where it stopped, not at 1000
    assert f"stopped by SIGTERM at step {last_step}; the last checkpoint is step {last_step}" in err


def test_run_directory_written_before_the_restructure_samples_and_resumes(tmp_path, corpus, capsys):
    """tests/data/run_v0 was written by train.py at commit aadd5cf, before the loop moved into
    jaxgpt.train.run and data and sampling were split, and before a model's identity and its compute
    settings were: configs/default.py with TINY_OVERRIDES and train.steps=3 on write_corpus's
    text, one CPU device (the three steps' config.json, tokenizer.json, checkpoint and metrics,
    as they were). Today's code samples from it, and resumes it at step 3 to step 6 from its
    restored state. (Its batches were drawn by a generator since replaced, so its steps 1–3
    cannot be compared with a run of today's code; run_v1's can.)"""
    from scripts import load_script

    from jaxgpt.train.run import load_run, train

    old = tmp_path / "old"
    shutil.copytree(TESTS / "data" / "run_v0", old)
    params, cfg, tokenizer = load_run(old)
    assert cfg.n_layer == 1 and tokenizer.vocab_size <= cfg.vocab_size
    status = load_script("sample.py").main(["--run_dir", str(old), "--prompt", "The king", "--max_new_tokens", "5",
                                            "--temperature", "0"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert out.startswith("The king") and len(out) > len("The king\n")

    before = [json.loads(line) for line in (old / "metrics.jsonl").read_text().splitlines()]
    resumed = train(tiny_config(tmp_path, corpus, "old", preset="default", **{"mesh.cpu_devices": 0}))
    assert resumed["step"] == 6
    records = [json.loads(line) for line in (old / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # resumed at 3, not started again
    assert resumed["val_loss"] < before[-1]["val_loss"]  # it went on learning from the restored state


def test_run_directory_written_by_todays_code_resumes_where_an_uninterrupted_run_ends(tmp_path, corpus, capsys):
    """tests/data/run_v1 was written by this version's train.py (tests/data/make_run_v1.py: the
    split model and compute sections, the data sources' own sections, per-tensor sums in the
    checkpoint's metadata). It samples, and resumes at step 3 to step 6 exactly where an
    uninterrupted run of today's code ends."""
    from scripts import load_script

    from jaxgpt.train.run import train

    run = tmp_path / "v1"
    shutil.copytree(TESTS / "data" / "run_v1", run)
    status = load_script("sample.py").main(["--run_dir", str(run), "--prompt", "The king", "--max_new_tokens", "5",
                                            "--temperature", "0"])
    assert status == 0, capsys.readouterr().err
    resumed = train(tiny_config(tmp_path, corpus, "v1", preset="default", **{"mesh.cpu_devices": 0}))
    fresh = train(tiny_config(tmp_path, corpus, "fresh", preset="default", **{"mesh.cpu_devices": 0}))
    assert resumed["step"] == fresh["step"] == 6
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert_trees_close(final_params(run), final_params(tmp_path / "fresh"), atol=1e-6)
    assert resumed["val_loss"] == pytest.approx(fresh["val_loss"], abs=1e-6)


# --- nothing lost, nothing silently wrong ---------------------------------------------------------


def run_records(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_garbage_in_one_steps_metrics_keeps_every_checkpoint(tmp_path, corpus):
    from jaxgpt.train.run import train

    train(tiny_config(tmp_path, corpus))  # checkpoints 3 and 6, both evaluated
    run = tmp_path / "run"
    (run / "checkpoints" / "6" / "metrics" / "metrics").write_bytes(b"\x00garbage")
    assert train(tiny_config(tmp_path, corpus, **{"train.steps": 9}))["step"] == 9
    assert run_records(run) == [1, 2, 3, 4, 5, 6, 7, 8, 9]  # resumed at 6: its parameters were kept
    assert [p.name for p in (run / "damaged_checkpoints").iterdir()] == ["metrics-of-step-6"]


def test_flipped_bytes_in_the_newest_checkpoint_fall_back_to_the_previous(tmp_path, corpus, caplog):
    from jaxgpt.train.run import train

    train(tiny_config(tmp_path, corpus))
    run = tmp_path / "run"
    largest = max((f for f in (run / "checkpoints" / "6").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(largest.read_bytes())
    for position in np.random.default_rng(0).choice(len(data), size=min(64, len(data)), replace=False):
        data[position] ^= 0xFF
    largest.write_bytes(bytes(data))
    caplog.set_level("WARNING")
    assert train(tiny_config(tmp_path, corpus, **{"train.steps": 9}))["step"] == 9
    assert "checkpoint at step 6" in caplog.text
    assert run_records(run)[6:] == [4, 5, 6, 7, 8, 9]  # redone from step 3


def test_resume_whose_data_makes_another_tokenizer_refuses(tmp_path, corpus):
    from jaxgpt.train.run import TrainingError, train

    train(tiny_config(tmp_path, corpus))
    pinned = (tmp_path / "run" / "tokenizer.json").read_bytes()
    text = corpus.read_text()
    assert "k" in text and "#" not in text
    other = tmp_path / "other.txt"
    other.write_text(text.replace("k", "#"))  # as many characters, another mapping of ids to text
    with pytest.raises(TrainingError, match=r"the data now makes another tokenizer than .*tokenizer.json"):
        train(tiny_config(tmp_path, other, **{"train.steps": 9}))
    assert (tmp_path / "run" / "tokenizer.json").read_bytes() == pinned


def test_a_non_finite_state_is_never_checkpointed(tmp_path, corpus):
    """eps = 0 divides zero by zero in AdamW where a gradient is zero (the rows of an untied
    embedding that no batch uses): NaN parameters after step 1, which are never saved."""
    from jaxgpt.train.run import TrainingError, train

    config = tiny_config(tmp_path, corpus, **{"train.eps": 0.0, "train.ckpt_every": 1, "model.tie_embeddings": False})
    with pytest.raises(TrainingError, match=r"step 1: \['(opt_state|params)'\]\S* holds NaN or infinite values; "
                                            r"not saving it: .* The last good checkpoint is none"):
        train(config)
    assert not list((tmp_path / "run" / "checkpoints").glob("[0-9]*"))


def test_an_impossible_model_is_refused_before_anything_is_allocated(tmp_path, corpus):
    from jaxgpt.errors import ConfigError
    from jaxgpt.train.run import train

    # 16e9 parameters × 20 B (each, float32, with two gradients and two moments) + 64 tokens × 4·1e9 bytes of
    # float32 logits ≈ 5.76e11 B = 536 GiB
    with pytest.raises(ConfigError, match=r"the run needs about 536 GiB .* set train.memory_limit_gib"):
        train(tiny_config(tmp_path, corpus, **{"model.vocab_size": 1_000_000_000}))
    # sizes in the unit that shows them: 1e-6 GiB is 1,074 bytes; the tiny model needs 4,240 × 20 B of state and
    # 64 tokens × (4·V + …) bytes: some hundreds of KiB
    with pytest.raises(ConfigError, match=r"needs about \d{3} KiB .*more than the 1\.0 KiB of "
                                          r"train.memory_limit_gib=1e-06: make the model"):
        train(tiny_config(tmp_path, corpus, **{"train.memory_limit_gib": 1e-6}))


def test_a_run_dir_that_is_a_file_is_a_one_line_error(tmp_path, corpus):
    from jaxgpt.errors import ConfigError
    from jaxgpt.train.run import train

    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(ConfigError, match="is a file, not a directory: choose another --config.run_dir"):
        train(tiny_config(tmp_path, corpus))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes whatever the permissions say")
def test_a_read_only_run_dir_is_a_one_line_error(tmp_path, corpus):
    from jaxgpt.errors import ConfigError
    from jaxgpt.train.run import train

    (tmp_path / "run").mkdir()
    (tmp_path / "run").chmod(0o555)
    with pytest.raises(ConfigError, match="cannot write in run_dir .* choose a writable --config.run_dir"):
        train(tiny_config(tmp_path, corpus))


def test_train_py_config_file_with_a_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from jaxgpt.config import default_config\n\ndef get_config():\n    return default_config(\n")
    out = run_train_py([f"--config={bad}"])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"train.py: {bad}:4: '(' was never closed (a syntax error in the "
                                               "config file)"]


def long_run_args(tmp_path, corpus, run="run", **changes):
    return cli_args(tmp_path, corpus, run, **{"train.steps": 100000, "train.decay_steps": 100000,
                                              "train.ckpt_every": 1000, "train.eval_every": 1000, **changes})


def wait_for_step(run_dir: Path, step: int, proc, timeout: float = 120) -> None:
    import time

    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().strip() and run_records(run_dir)[-1] >= step):
        assert proc.poll() is None and time.monotonic() < deadline, f"training did not reach step {step}"
        time.sleep(0.05)


def test_a_second_process_on_a_live_run_directory_refuses_and_a_dead_ones_lock_is_taken_over(tmp_path, corpus):
    import socket

    first = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *long_run_args(tmp_path, corpus)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_step(tmp_path / "run", 1, first)
        second = run_train_py(cli_args(tmp_path, corpus, **{"train.lr": 5e-4}))
    finally:
        first.kill()  # kill -9: the kernel drops its lock
        first.wait()
    assert second.returncode == 2
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"is in use by process {first.pid} on {socket.gethostname()}" in lines[0], lines
    third = run_train_py(cli_args(tmp_path, corpus))
    assert third.returncode == 0, third.stderr[-2000:]
    assert f"took over the lock of process {first.pid} on {socket.gethostname()}" in third.stderr


@pytest.mark.parametrize("delay", [0.5, 2.0, 4.0])
def test_ctrl_c_at_any_moment_exits_130_cleanly(tmp_path, corpus, delay):
    """SIGINT while importing, preparing data or compiling: a clean exit 130, never a crash nor a
    run that goes on (a library could swallow the KeyboardInterrupt while JAX imports), however
    busy the machine and so whatever the moment the delay lands on."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *long_run_args(tmp_path, corpus)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err


def test_killed_three_times_ends_bit_for_bit_where_an_uninterrupted_run_ends(tmp_path, corpus):
    """kill -9 at three random steps (seeded), resuming each time from the last checkpoint
    (synchronous, every step): the final parameters equal an uninterrupted run's exactly."""
    changes = {"train.steps": 24, "train.decay_steps": 24, "train.ckpt_every": 1, "train.eval_every": 8,
               "train.async_checkpoints": False, "mesh.cpu_devices": 1}
    kills = sorted(np.random.default_rng(7).choice(np.arange(3, 22), size=3, replace=False))
    for step in kills:
        proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *cli_args(tmp_path, corpus, "killed",
                                                                                    **changes)],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_step(tmp_path / "killed", step, proc)
        finally:
            proc.kill()
            proc.wait()
    for run in ("killed", "straight"):
        out = run_train_py(cli_args(tmp_path, corpus, run, **changes))
        assert out.returncode == 0, out.stderr[-2000:]
    killed, straight = final_params(tmp_path / "killed"), final_params(tmp_path / "straight")
    for a, b in zip(jax.tree.leaves(killed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_every_checkpoint_damaged_is_a_one_line_error(tmp_path, corpus):
    from jaxgpt.checkpoint import CheckpointError
    from jaxgpt.train.run import train

    train(tiny_config(tmp_path, corpus))
    for f in (tmp_path / "run" / "checkpoints").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(b"\0garbage")
    message = (r"every checkpoint in .* is damaged \(steps \[6, 3\]; moved to .*damaged_checkpoints\): run the same "
               "command again to start from scratch")
    with pytest.raises(CheckpointError, match=message):
        train(tiny_config(tmp_path, corpus, **{"train.steps": 9}))
    assert train(tiny_config(tmp_path, corpus, **{"train.steps": 9}))["step"] == 9  # and so it does
    assert run_records(tmp_path / "run")[-9:] == list(range(1, 10))


def test_a_full_disk_stops_the_run_in_one_line_and_it_resumes_from_the_last_good_checkpoint(tmp_path, corpus):
    """The run directory on a 400 KiB file system: an asynchronous save fails for want of
    space; the run stops in one line naming the last good checkpoint, and once there is space
    the same command resumes from it. A checkpoint takes ~150 KiB and three are kept, so the
    third save fails whenever the older ones are deleted (600 KiB held three, depending on
    when the oldest was deleted)."""
    import re

    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode:
        pytest.skip("needs to mount a small tmpfs (root)")
    try:
        args = cli_args(tmp_path, corpus, "small/run", **{"train.steps": 80, "train.decay_steps": 80,
                                                          "train.ckpt_every": 2, "train.eval_every": 1000})
        out = run_train_py(args)
        assert out.returncode == 2, out.stderr[-2000:]
        errors = [line for line in out.stderr.splitlines() if line.startswith("train.py:")]
        assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert "no space left on" in errors[0].lower()  # most often while saving, else writing metrics
        saved = [int(p.name) for p in (small / "run" / "checkpoints").iterdir() if p.name.isdigit()]
        good = max(saved)
        if "the last good checkpoint is step" in errors[0]:
            assert int(re.search(r"the last good checkpoint is step (\d+)", errors[0])[1]) == good
        subprocess.run(["mount", "-o", "remount,size=16m", str(small)], check=True)
        resumed = run_train_py(args)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert f"resuming at step {good};" in resumed.stderr
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


# --- the loop: records, timings, non-blocking metrics, programs -----------------------------------


def poisoned_train_step(monkeypatch, bad_step: int):
    """Make the run's train step report a NaN loss at `bad_step` (its parameters stay finite,
    so only the loss guard can stop the run)."""
    from jaxgpt.train import run as run_module

    real = run_module.make_train_step

    def make(*args, **kwargs):
        step = real(*args, **kwargs)

        def poisoned(state, batch, key):
            state, values = step(state, batch, key)
            return state, {**values, "loss": jnp.where(state.step == bad_step, jnp.nan, values["loss"])}

        return poisoned

    monkeypatch.setattr(run_module, "make_train_step", make)


@pytest.mark.parametrize("bad_step", [4, 5])  # a log step, whose record is read one step late; a step between logs
def test_a_nan_loss_stops_the_run_naming_its_step_and_nothing_after_it_is_saved(tmp_path, corpus, monkeypatch,
                                                                                bad_step):
    from jaxgpt.checkpoint import Checkpoints
    from jaxgpt.train.run import TrainingError, train

    poisoned_train_step(monkeypatch, bad_step)
    config = tiny_config(tmp_path, corpus, **{"train.steps": 12, "train.log_every": 4, "train.ckpt_every": 3,
                                              "train.eval_every": 100})
    with pytest.raises(TrainingError, match=rf"non-finite loss \(nan\) .* at step {bad_step}: stopping; the "
                                            r"parameters .* still finite.* The last good checkpoint is step 3 "):
        train(config)
    checkpoints = Checkpoints(tmp_path / "run", read_only=True)
    assert checkpoints.steps() == [3]  # not 6: the state after the bad step is never saved
    checkpoints.close()
    assert all(step < bad_step for step in run_records(tmp_path / "run"))


def test_every_log_eval_and_save_step_writes_one_record_and_log_steps_do_not_wait(tmp_path, corpus, monkeypatch):
    """A log step's metrics are read only after the next step was dispatched; a step that
    evaluates or saves reads its own at once."""
    from jaxgpt import metrics
    from jaxgpt.train.run import train

    reads = []  # (the step read up to, the newest step dispatched by then)
    fetch = metrics.Meter.fetch

    def spied_fetch(meter, through=None):
        reads.append((through, max(step for step, _ in meter.pending)))
        return fetch(meter, through)

    monkeypatch.setattr(metrics.Meter, "fetch", spied_fetch)
    train(tiny_config(tmp_path, corpus, **{"train.steps": 10, "train.log_every": 3, "train.eval_every": 4,
                                          "train.ckpt_every": 5}))
    assert run_records(tmp_path / "run") == [3, 4, 5, 6, 8, 9, 10]  # multiples of 3, 4 and 5, and the last step
    assert reads == [(3, 4), (4, 4), (5, 5), (6, 7), (8, 8), (9, 10), (10, 10)]


def test_evaluation_and_checkpoint_seconds_are_reported_and_left_out_of_tokens_per_sec(tmp_path, corpus, monkeypatch,
                                                                                       capsys):
    import time

    from jaxgpt.train import run as run_module

    evaluate = run_module.evaluate

    def slow_evaluate(*args, **kwargs):
        time.sleep(1.5)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(run_module, "evaluate", slow_evaluate)
    run_module.train(tiny_config(tmp_path, corpus, **{"train.steps": 4, "train.eval_every": 2,
                                                      "train.ckpt_every": 3}))
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert {s for s, r in records.items() if "eval_seconds" in r} == {2, 4}
    assert {s for s, r in records.items() if "checkpoint_seconds" in r} == {2, 3, 4}
    assert all(records[s]["eval_seconds"] >= 1.5 and records[s]["checkpoint_seconds"] >= 0 for s in (2, 4))
    # step 3's interval began after step 2's evaluation: had the 1.5 s counted, 64 tokens / 1.5 s < 43 tokens/s
    assert records[3]["tokens_per_sec"] > 64 / 1.0
    err = capsys.readouterr().err
    assert "step 2: train loss" in err and "evaluation 1.5" in err and "checkpoint 0." in err


def test_a_one_step_run_compiles_one_program_per_kind(tmp_path, corpus):
    """JAX's log of its compilations in a whole run as train.py's default makes it (two CPU
    devices, a checkpoint, a sample): one init, one train step, one eval step and the
    sampler's programs, and the matmul that measures the CPU's peak. None for making keys, folding
    them, converting values or slicing replicated arrays for a checkpoint. The peak kept in the
    cache is above any this CPU measures, so the MFU is against it."""
    from collections import Counter

    from jaxgpt import metrics

    cache_home = tmp_path / "xdg"
    peaks = metrics.peak_cache_path({"XDG_CACHE_HOME": str(cache_home)})
    peaks.parent.mkdir(parents=True)
    peaks.write_text(json.dumps({metrics.machine_key(): 1e15}))
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS")}
    env.update(JAX_LOG_COMPILES="1", XDG_CACHE_HOME=str(cache_home))
    args = [arg for arg in cli_args(tmp_path, corpus, **{"train.steps": 1, "train.eval_max_batches": 3,
                                                         "mesh.cpu_devices": 2, "sample.max_new_tokens": 4})
            if not arg.startswith("--config.train.peak_flops=")] + ["--config.compilation_cache=off"]
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True, cwd=ROOT,
                         timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    compiled = Counter(_compiled(out.stderr))
    sampler = {"_row_keys": 1, "_generate_program": 1, "dynamic_slice": 1}  # the last drops the prompt bucket's padding
    checksums = {"_device_checksums": 2}  # of the state when it is saved, of the params restored to sample
    assert compiled == {"init": 1, "seeded_step": 1, "step": 1, "_matmul": 1, **sampler, **checksums}, compiled
    assert f"MFU against a peak of 1000000 GFLOP/s measured on this CPU (the best of its float32 matmuls so far, " \
           f"cached in {peaks})" in out.stderr
    assert (tmp_path / "run" / "checkpoints" / "1").is_dir()
    # run again: the finished run is restored onto its shapes alone (no init) and has no step left to compile
    again = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True, cwd=ROOT,
                           timeout=240, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    recompiled = set(_compiled(again.stderr))
    assert "resuming at step 1" in again.stderr and not recompiled & {"init", "seeded_step"}, recompiled


def _compiled(log: str) -> list[str]:
    """The programs XLA compiled, from JAX_LOG_COMPILES's lines (its "Compiling" lines are
    written when a program is lowered, compiled or not)."""
    marker = "Finished XLA compilation of jit("
    return [line.split(marker)[1].split(")")[0] for line in log.splitlines() if marker in line]


def test_hundreds_of_steps_between_logs_on_two_cpu_devices_do_not_stall(tmp_path, corpus):
    """The host runs only a few steps ahead of the devices: with hundreds queued, XLA's
    all-reduce between two CPU devices waited forever and the process aborted."""
    out = run_train_py(cli_args(tmp_path, corpus, **{"train.steps": 400, "train.decay_steps": 400,
                                                     "train.log_every": 1000, "train.eval_every": 1000,
                                                     "train.ckpt_every": 1000, "mesh.cpu_devices": 2}), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert run_records(tmp_path / "run") == [400]


# --- the end of a run, a finished run asked for fewer steps, a peer that never comes ----------------


def test_an_end_sample_whose_prompt_the_data_cannot_encode_warns_and_the_run_exits_0(tmp_path):
    """A sample record whose prompt holds letters against a char tokenizer of digits: the run trains,
    warns in one line, samples a new document instead, and succeeds."""
    records = tmp_path / "sums.jsonl"
    records.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n"
                               for a in range(20) for b in range(10)))
    tiny = {key: value for key, value in TINY_OVERRIDES.items() if key != "sample.max_new_tokens"}
    out = run_train_py(["--config=configs/finetune_records.py", f"--config.data.source={records}",
                        "--config.data.records.template=prompt_completion", '--config.sample.record={"prompt": "C+D="}',
                        *[f"--config.{k}={v}" for k, v in
                                                                                tiny.items()],
                        f"--config.data.cache_dir={tmp_path / 'cache'}", f"--config.run_dir={tmp_path / 'run'}"])
    assert out.returncode == 0, out.stderr[-3000:]
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning: sample")]
    assert len(warnings) == 1 and "sample.record's prompt cannot be made" in warnings[0] and "'C'" in warnings[0]
    assert "Traceback" not in out.stderr
    assert (tmp_path / "run" / "sample.txt").read_text() in out.stdout


def test_a_finished_run_asked_for_fewer_steps_says_so_and_keeps_its_config(tmp_path, corpus, capsys):
    from jaxgpt.train.run import train

    train(tiny_config(tmp_path, corpus))  # 6 steps
    saved = (tmp_path / "run" / "config.json").read_bytes()
    capsys.readouterr()
    result = train(tiny_config(tmp_path, corpus, **{"train.steps": 3}))
    assert result["step"] == 6
    assert "at step 6, past train.steps=3: nothing to train" in capsys.readouterr().err
    assert (tmp_path / "run" / "config.json").read_bytes() == saved
    assert json.loads(saved)["train"]["steps"] == 6


def test_a_process_whose_peer_never_starts_says_what_it_waits_for_and_gives_up_in_one_line(tmp_path, corpus):
    out = run_train_py([*cli_args(tmp_path, corpus, **{"mesh.cpu_devices": 1}),
                        f"--config.distributed.coordinator_address=127.0.0.1:{free_port()}",
                        "--config.distributed.num_processes=2", "--config.distributed.process_id=0",
                        "--config.distributed.timeout_s=2"], timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("jaxgpt: waiting for all 2 processes") and "distributed.timeout_s=2" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("jaxgpt: not every process joined within distributed.timeout_s=2")
