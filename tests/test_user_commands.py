"""The README's commands as a user runs them: in subprocesses, from the README's own lines, with
the machine's default devices (one CPU device per core; the rest of the suite runs on one).
Only the length of the runs is cut, by overrides appended to each line. In order: the main
job, its resume with changed settings, the fine-tune of its model on records (`init_from`), and
an unconditional sample."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from processes import SUITE_XLA_FLAGS

from jaxgpt import sharding

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

SHORT = ["--config.train.steps=4", "--config.train.warmup_steps=1", "--config.train.eval_every=2",
         "--config.train.ckpt_every=2", "--config.train.log_every=1", "--config.train.eval_max_batches=2"]
SMALL_MAIN_JOB = [*SHORT, "--config.model.n_layer=1", "--config.model.d_model=32", "--config.model.n_head=2",
                  "--config.data.max_bytes=300000", "--config.data.vocab_size=512", "--config.sample.max_new_tokens=8"]


def readme_line(pattern: str) -> list[str]:
    """The argument list of the README's command line that matches `pattern` (the last
    `&&` part of it, a comment dropped, continuation lines joined)."""
    text = README.replace("\\\n", " ")
    line = next(line for line in text.splitlines() if re.search(pattern, line))
    return shlex.split(line.split("&&")[-1], comments=True)


def run(argv: list[str], cwd: Path, *extra: str, suite_flags: bool = False) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS… EXTRA…` run in `cwd` as a user's shell would, on the machine's own
    devices: scripts and configs are the repository's, run directories land under `cwd`. With
    `suite_flags` (a command of the tests' own, not the docs'), it compiles as the suite does."""
    assert argv[0] == "python", argv
    args = [str(ROOT / a) if a.endswith(".py") and (ROOT / a).exists() else a for a in argv[1:]]
    args = [re.sub(r"^--config=(configs/.*)", lambda m: f"--config={ROOT / m[1]}", a) for a in args]
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env |= {"JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(cwd / "cache")}
    if suite_flags:
        env["XLA_FLAGS"] = SUITE_XLA_FLAGS
    return subprocess.run([sys.executable, *args, *extra], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=env, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """The README's first command's job, cut short, in a fresh directory."""
    home = tmp_path_factory.mktemp("user")
    out = run(readme_line(r"pip install -e \. && python train.py"), home, *SMALL_MAIN_JOB)
    assert out.returncode == 0, out.stderr[-3000:]
    return home, out


def test_the_main_job_trains_on_one_device_per_core_and_ends_with_a_sample(main_job):
    home, out = main_job
    devices = sharding.auto_cpu_devices(sharding.available_cores(), [16, 32])
    assert f"{devices} cpu device(s)" in out.stderr
    python = ".".join(map(str, sys.version_info[:3]))
    assert f"jaxgpt: data, the standard library of {sys.implementation.name.replace('cpython', 'CPython')} {python}" \
        in out.stderr, out.stderr[-2000:]
    assert "--- sample (run directory runs/default) ---" in out.stdout
    assert sorted(int(p.name) for p in (home / "runs/default/checkpoints").iterdir()) == [2, 4]


def test_a_resume_with_changed_settings_says_each_and_keeps_the_earlier_config(main_job):
    home, _ = main_job
    out = run(readme_line(r"pip install -e \. && python train.py"), home, *SMALL_MAIN_JOB,
              "--config.train.steps=6", "--config.train.lr=0.002")
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if line.startswith("jaxgpt: changed since step")]
    assert sorted(said) == ["jaxgpt: changed since step 4: train.lr 0.001 → 0.002 (the config of the steps before: "
                            "config.step-4.json)",
                            "jaxgpt: changed since step 4: train.steps 4 → 6 (the config of the steps before: "
                            "config.step-4.json)"], out.stderr[-3000:]
    earlier = json.loads((home / "runs/default/config.step-4.json").read_text())
    now = json.loads((home / "runs/default/config.json").read_text())
    assert (earlier["train"]["lr"], earlier["train"]["steps"]) == (0.001, 4)
    assert (now["train"]["lr"], now["train"]["steps"]) == (0.002, 6)
    steps = [json.loads(line)["step"] for line in (home / "runs/default/metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6 and 5 in steps


def test_the_readme_fine_tune_of_the_main_jobs_model_starts_from_its_checkpoints(main_job):
    """init_from reads the source's checkpoints while the run's mesh of one device per core is
    set: its checksums must run where the restored leaves are, and the checkpoints are intact."""
    home, _ = main_job
    out = run(readme_line(r"--config.init_from=runs/default"), home, *SHORT, "--config.sample.max_new_tokens=4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "damaged" not in out.stderr and not (home / "runs/damaged_checkpoints").exists()
    assert sorted(int(p.name) for p in (home / "runs/default/checkpoints").iterdir())  # the source's, all kept
    assert (home / "runs/default_lookup/checkpoints/4").is_dir()


def test_sample_py_with_no_prompt_starts_a_new_document(main_job):
    home, _ = main_job
    argv = readme_line(r"python sample.py --run_dir runs/default\b(?! --prompt)")
    out = run(argv, home, "--max_new_tokens", "6", "--num_samples", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("-" * 15) == 1 and out.stdout.strip()


def corpus_text() -> str:
    """A small corpus of many characters (a char tokenizer's), long enough for a validation split."""
    words = ["the", "model", "reads", "a", "token", "and", "writes", "its", "next", "one", "from", "what", "came"]
    return "\n".join(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(9)) + f" {i}." for i in range(600))


EVERY_SWITCH = ["--config.model.unet_skips=True", "--config.model.smear=True",  # the plus config has the rest
                "--config.model.attn_gate=12", "--config.model.trigram_table=16", "--config.model.dense_skips=8",
                "--config.model.key_offset=True", "--config.model.paired_heads=(0,2)",
                "--config.train.untie_at=0.5"]  # of its 2 steps: one tied, one untied
# the recipe's 4 layers (its value-embedding tables need them), narrower and shorter: the same programs, smaller
NARROW = ["--config.model.d_model=32", "--config.model.n_head=2", "--config.model.d_ff=64",
          "--config.model.block_size=32", "--config.model.bigram_table=16", "--config.train.batch_size=4"]
# learning rates so small that a step moves no weight by a float32 ulp: the tuned run's checkpoint holds its start
FROZEN = [f"--config.train.{key}=1e-30" for key in ("lr", "embed_lr", "head_lr", "scalar_lr")]
QUICK = ["--config.train.warmup_steps=1", "--config.train.eval_every=2", "--config.train.ckpt_every=2",
         "--config.train.eval_batch_size=8", "--config.train.eval_max_batches=1", "--config.sample.max_new_tokens=4"]


TRAIN_PLUS = ["python", "train.py", "--config=configs/speedrun_cpu_plus.py", "--config.data.source=corpus.txt", *QUICK,
              *NARROW]


@pytest.fixture(scope="module")
def scanned_source(tmp_path_factory):
    """A run of the CPU recipe trained with compute.scan_layers and every speedrun switch on."""
    home = tmp_path_factory.mktemp("scanned_source")
    (home / "corpus.txt").write_text(corpus_text())
    source = run(TRAIN_PLUS, home, *EVERY_SWITCH, "--config.compute.scan_layers=True", "--config.train.steps=2",
                 "--config.run_dir=runs/source", "--config.sample.max_new_tokens=0",  # the tuned run samples
                 suite_flags=True)
    assert source.returncode == 0, source.stderr[-3000:]
    return home


def test_init_from_a_scanned_run_with_every_speedrun_switch_starts_from_its_weights(scanned_source):
    """A run trained with compute.scan_layers (every speedrun switch on) is fine-tuned on the machine's
    default devices into the per-layer layout: the new run starts from the source's weights (steps at
    learning rates of 1e-30 leave them as they were), placed on its own mesh. (Scanned into scanned is
    tests/test_scan_layers.py's resume in either layout.)"""
    from jaxgpt.train.rundir import load_run

    home, tuned_dir = scanned_source, "runs/tuned"
    tuned = run(TRAIN_PLUS, home, "--config.init_from=runs/source", "--config.compute.scan_layers=False",
                "--config.train.steps=2", *FROZEN, f"--config.run_dir={tuned_dir}", suite_flags=True)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert f"--- sample (run directory {tuned_dir}) ---" in tuned.stdout
    before, after = load_run(home / "runs/source")[0], load_run(home / tuned_dir)[0]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-20), after, before)


def doc_line(page: str, pattern: str) -> list[str]:
    """The argument list of the command in docs/PAGE whose text matches `pattern` (continuation lines joined)."""
    text = (ROOT / "docs" / page).read_text().replace("\\\n", " ")
    return shlex.split(next(line for line in text.splitlines() if re.search(pattern, line)), comments=True)


def test_finetune_docs_own_template_means_newlines_and_ends_with_a_sample_in_it(tmp_path):
    """docs/FINETUNE.md's own-template command, as a shell passes it (`\\n` a backslash and an n): the run's
    template holds a newline (config.json), every held-out prompt eval.py answers is made with it, and the
    run's final sample is a record's prompt made by the run's own template, not the preset's qa."""
    animals = ["owl", "cat", "fox", "elk", "yak", "emu", "bee", "ant"]
    records = [{"question": f"Which animal is number {i}?", "answer": animals[i % len(animals)]} for i in range(240)]
    (tmp_path / "my_records.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    argv = doc_line("FINETUNE.md", r"prompt_template='Q: \{question\}\\nA: '")
    out = run(argv, tmp_path, "--config.model.n_layer=1", "--config.model.d_model=32", "--config.model.n_head=2",
              "--config.train.steps=3", "--config.train.warmup_steps=1", "--config.train.eval_every=3",
              "--config.train.ckpt_every=3", "--config.train.eval_batch_size=4",
              '--config.sample.record={"question": "Which animal is number 3?"}')
    assert out.returncode == 0, out.stderr[-3000:]
    saved = json.loads((tmp_path / "runs/mine/config.json").read_text())["data"]["records"]
    assert saved["prompt_template"] == "Q: {question}\nA: "
    assert out.stdout.split("---\n", 1)[1].startswith("Q: Which animal is number 3?\nA: "), out.stdout[-500:]
    evaluated = run(["python", "eval.py", "--run_dir", "runs/mine", "--records", "--max_records", "4",
                     "--max_new_tokens", "2"], tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    predictions = (tmp_path / "runs/mine/predictions.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in predictions]
    assert len(prompts) == 4 and all(p.startswith("Q: Which animal") and p.endswith("?\nA: ") for p in prompts), prompts


def test_a_refused_run_leaves_nothing_behind_and_keeps_what_was_there(tmp_path):
    """A model that cannot be built is refused in one line after the directory was opened: a directory made
    for the run is gone again; one that held a file keeps it and gains nothing."""
    (tmp_path / "runs/mine").mkdir(parents=True)
    (tmp_path / "runs/mine/notes.txt").write_text("mine")
    for run_dir in ("runs/new", "runs/mine"):
        out = run(["python", "train.py", "--config.model.n_head=3", f"--config.run_dir={run_dir}"], tmp_path)
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 2 and lines[-1].startswith("train.py: GPTConfig.d_model=128 is not divisible"), lines
    assert not (tmp_path / "runs/new").exists()
    assert sorted(p.name for p in (tmp_path / "runs/mine").iterdir()) == ["notes.txt"]
