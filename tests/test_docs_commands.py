"""The commands of the README's and docs/'s code blocks as a user types them. Each command line of a
```bash block that runs `python train.py`, `python sample.py`, `python eval.py` or `python -m jaxgpt.…`
is run here, cut short by overrides appended to it (steps, model size, workers); or another test runs
it (COVERED, which test); or it is skipped, with the reason (SKIPPED: a GPU, a TPU slice, a download,
GPT-2's size, several hosts). A command new in the docs fails
`test_every_command_is_run_covered_or_skipped` until it is one of the three.

The commands run in a directory laid out like a checkout (the repository's `configs/` and `tests/`, the
pages' placeholders `path/to/input.txt` and `path/to/texts/` as small files), all of them in one
subprocess started once for the module (tests/docs_commands_driver.py), one after another, each through
its program's `main`: on the machine's default devices as a user's shell runs them (one CPU device per
core; no XLA_FLAGS or JAX_NUM_CPU_DEVICES, where the rest of the suite runs on one), its compiled programs
shared between the commands, where a dozen subprocesses would spend more on imports than all of this
takes. It writes each command's exit status, stdout and stderr to a JSON file the tests read. The
commands on `runs/default` share one main job, cut short. Each exits 0 and prints what its page says it
prints. tests/test_user_commands.py runs the main job itself, not cut as short, in its own subprocess."""

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from runs import write_corpus

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = re.compile(r"python (train\.py|sample\.py|eval\.py|-m jaxgpt\.[\w.]+)\b")

SHORT = ["--config.train.steps=2", "--config.train.warmup_steps=1", "--config.train.eval_every=2",
         "--config.train.ckpt_every=2", "--config.train.log_every=1", "--config.train.eval_max_batches=1",
         "--config.train.eval_batch_size=4", "--config.train.batch_size=4", "--config.train.peak_flops=1e9",
         "--config.sample.max_new_tokens=0", "--config.data.workers=1"]
SMALL = ["--config.model.n_layer=1", "--config.model.n_head=2", "--config.model.d_model=16",
         "--config.model.block_size=16"]
# the main job's: 2 layers for the pictures of layer 1, a context the multiple-choice items fit
MAIN_JOB = [*SHORT, *SMALL, "--config.model.n_layer=2", "--config.model.block_size=32",
            "--config.data.max_bytes=100000", "--config.data.vocab_size=300"]

# The commands not run here, by a pattern of their text, and why.
SKIPPED = {
    r"^python (train\.py|-m jaxgpt\.compile) --config=configs/(gpt2_124m|speedrun_gpt2)\.py":
        "GPT-2 small: GPUs or a TPU slice to train, a minute of CPU a compile (tests/test_compile.py and "
        "tests/test_compile_gpu.py compile tiny models for the same targets)",
    r"hf:|path/to/gpt2": "a download from the Hugging Face Hub, or GPT-2's weights (tests/test_convert.py and "
                         "tests/test_hf_source.py read local ones)",
    r"jaxgpt\.harness": "the lm-evaluation-harness's tasks download (tests/test_harness.py runs local ones)",
    r"distributed\.": "several hosts",
    r"jaxgpt\.sweep --config=configs/speedrun_cpu": "the CPU recipe's ablations, 8 to 20 runs: minutes "
                                                  "(tests/test_sweep.py runs an ablation)",
    r"jaxgpt\.sweep --config=configs/experiment\.py --grid model\.(positions|attention)":
        "the same sweep as the norms' (COVERED) over 5 and 6 cells; tests/test_readme.py checks their tables "
        "against their grids",
    r"tfds:local_text_corpus": "a TFDS build: tests/test_data.py::test_tfds_source_reads_a_dataset_built_offline_"
                               "from_local_files",
}
# The commands another test runs, and which.
COVERED = {
    r"^python train\.py$": "tests/test_user_commands.py::test_the_main_job_trains_on_one_device_per_core_and_ends_"
                           "with_a_sample (and here, cut short, for the commands that read runs/default)",
    r"--config\.init_from=runs/default": "tests/test_user_commands.py::test_the_readme_fine_tune_of_the_main_jobs_"
                                         "model_starts_from_its_checkpoints",
    r"^python sample\.py --run_dir runs/default$": "tests/test_user_commands.py::test_sample_py_with_no_prompt_"
                                                   "starts_a_new_document",
    r"prompt_template='Q: |--config\.data\.source=my_records\.jsonl --config\.run_dir=runs/mine$":
        "tests/test_user_commands.py::test_finetune_docs_own_template_means_newlines_and_ends_with_a_sample_in_it "
        "(FINETUNE.md's command on a records file; the README's, without its templates, reads one as "
        "test_completions does)",
    r"^python train\.py --config=configs/finetune_records\.py$|runs/finetune_records":
        "tests/test_completions.py::test_train_eval_records_and_sample_a_record_end_to_end (the preset on generated "
        "records, then `eval.py --records`, whose 'records: N held-out, exact match …' it checks, and "
        "`sample.py --record`)",
    r"jaxgpt\.sweep --config=configs/experiment\.py --grid model\.norm_position":
        "tests/test_sweep.py (this grid of configs/experiment.py: its summary and the cell the config refuses; "
        "rerun with another model.d_model, exit 2 with nothing trained)",
}


@dataclass(frozen=True)
class Command:
    page: str
    line: str  # as the page shows it, continuation lines joined, its comment left out
    comment: str  # what the page says beside it ('' for nothing)

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.line)

    def value(self, flag: str) -> str:
        return self.argv[self.argv.index(flag) + 1]


def doc_commands() -> list[Command]:
    """Each command line of the pages' ```bash blocks that runs a jaxgpt program, once (the same line
    on two pages is one command); an outline with an elision (…) is no command."""
    found = {}
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                text, comment = split_comment(line.strip())
                if PROGRAMS.match(text) and "…" not in text:
                    command = " ".join(text.split())
                    found.setdefault(command, Command(page.name, command, comment))
    return list(found.values())


def split_comment(line: str) -> tuple[str, str]:
    """(the command, its comment): the comment starts at the first # outside quotes after a space."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip(), line[i + 1:].strip()
    return line, ""


def not_run_here(command: Command) -> str | None:
    """Why `command` is not run here (skipped, or which test runs it), or None."""
    return next((why for rules in (SKIPPED, COVERED) for pattern, why in rules.items()
                 if re.search(pattern, command.line)), None)


def commands(pattern: str) -> list[Command]:
    """The commands run here whose text matches `pattern` (at least one)."""
    chosen = [c for c in doc_commands() if re.search(pattern, c.line) and not_run_here(c) is None]
    assert chosen, f"no command of the docs to run matches {pattern!r}"
    return chosen


# The test that runs each command run here, by a pattern of its text.
RUN_BY = {
    r"^python train\.py --config": "test_training_commands",
    r"^python train\.py --config\.train\.lr": "test_training_commands",
    r"^python (sample|eval)\.py --run_dir runs/default\b": "test_sample_and_eval_commands_on_the_main_job",
    r"jaxgpt\.(export|viz)": "test_export_and_picture_commands_on_the_main_job",
    r"^python -m jaxgpt\.data": "test_data_preparation_command",
}


def test_every_command_is_run_covered_or_skipped():
    """Every command is run here (RUN_BY), by another test (COVERED) or skipped (SKIPPED); every pattern
    of those still names a command, and every test they name is there."""
    found = doc_commands()
    assert len(found) >= 40
    unplaced = [c.line for c in found if not_run_here(c) is None and not any(re.search(p, c.line) for p in RUN_BY)]
    assert not unplaced, f"run these here (RUN_BY) or say why not (SKIPPED, COVERED): {unplaced}"
    stale = [p for p in (*SKIPPED, *COVERED, *RUN_BY) if not any(re.search(p, c.line) for c in found)]
    assert not stale, f"patterns that name no command of the docs: {stale}"
    reasons = " ".join([*SKIPPED.values(), *COVERED.values()])
    named = re.findall(r"(tests/\w+\.py)::(\w+)", reasons)
    gone = [f"{path}::{name}" for path, name in named if f"def {name}(" not in (ROOT / path).read_text()]
    assert len(named) >= 6 and not gone, f"tests named as covering commands that are not there: {gone}"


# --- running them ---------------------------------------------------------------------------------

SAMPLE = ["--max_new_tokens", "2"]
DATA = ["--config.data.vocab_size=300", "--config.data.workers=1"]


def training_overrides(command: Command) -> list[str]:
    """A preset's run cut short and small on the user's file; the main job's overrides cut as it is
    (its compiled programs)."""
    if "--config=" not in command.line:
        return MAIN_JOB
    return [*SHORT, *SMALL, *([] if "data.source" in command.line else ["--config.data.source=path/to/input.txt"])]


def planned() -> list[tuple[Command, list[str]]]:
    """Every command run here with the overrides appended to it, in the order of the tests below: the
    main job first, whose runs/default the later ones read."""
    (main_job,) = [c for c in doc_commands() if c.line == "python train.py"]
    return [(main_job, MAIN_JOB),
            *[(c, training_overrides(c)) for c in commands(r"^python train\.py --config")],
            *[(c, SAMPLE) for c in commands(r"^python sample\.py --run_dir runs/default ")],
            *[(c, []) for c in commands(r"^python eval\.py --run_dir runs/default$")],
            *[(c, []) for c in commands(r"^python eval\.py --run_dir runs/default --choices")],
            *[(c, []) for c in commands(r"jaxgpt\.export")],
            *[(c, []) for c in commands(r"jaxgpt\.viz")],
            *[(c, DATA) for c in commands(r"^python -m jaxgpt\.data")]]


def key(command: Command, *extra: str) -> str:
    return " ".join([command.line, *extra])


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A directory like a checkout (the repository's configs/ and tests/, the pages' placeholders as
    small files; the data cache goes inside), the current directory of the commands."""
    home = tmp_path_factory.mktemp("home")
    for name in ("configs", "tests"):
        (home / name).symlink_to(ROOT / name)
    (home / "docs").mkdir()
    (home / "path/to/texts").mkdir(parents=True)
    write_corpus(home / "path/to/input.txt")
    write_corpus(home / "path/to/texts/notes.txt")
    return home


@dataclass(frozen=True)
class Ran:
    results: dict  # key(command, *extra) → {"status", "stdout", "stderr"}
    process: subprocess.CompletedProcess  # the driver's own exit status and output


@pytest.fixture(scope="module")
def ran(home, tmp_path_factory) -> Ran:
    """Every command of planned() run in order in one process (tests/docs_commands_driver.py) in
    `home`, on the machine's default devices as a user's shell: no XLA_FLAGS or JAX_NUM_CPU_DEVICES,
    JAX_PLATFORMS=cpu, the data cache in home/cache; the suite's compiled programs are shared through
    JAX_COMPILATION_CACHE_DIR (conftest.py)."""
    where = tmp_path_factory.mktemp("driver")
    plan, results = where / "plan.json", where / "results.json"
    plan.write_text(json.dumps([[key(c, *extra), [*c.argv, *extra]] for c, extra in planned()]))
    env = {name: value for name, value in os.environ.items() if name not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env |= {"JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(home / "cache")}
    argv = [sys.executable, str(ROOT / "tests/docs_commands_driver.py"), str(plan), str(results)]
    try:
        process = subprocess.run(argv, cwd=home, env=env, capture_output=True, text=True, timeout=900,
                                 stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as late:
        stderr = late.stderr.decode(errors="replace") if isinstance(late.stderr, bytes) else late.stderr or ""
        process = subprocess.CompletedProcess(argv, -9, "", f"{stderr}\n(killed after {late.timeout:.0f} s)")
    return Ran(json.loads(results.read_text()) if results.is_file() else {}, process)


def run(ran: Ran, command: Command, *extra: str) -> tuple[str, str]:
    """(stdout, stderr) of `command` with `extra` appended, as the fixture's process ran it; it must
    have exited 0."""
    result = ran.results.get(key(command, *extra))
    if result is None:
        pytest.fail(f"{command.page}: {command.line} was not run (planned() has it with other overrides, or the "
                    f"process stopped: exit {ran.process.returncode})\n{ran.process.stderr[-3000:]}")
    assert result["status"] == 0, (f"{command.page}: {command.line} exited {result['status']}\n"
                                   f"{result['stderr'][-3000:]}")
    return result["stdout"], result["stderr"]


@pytest.fixture(scope="module")
def main_job(ran, home):
    """runs/default: the README's main job, `python train.py`, cut short (MAIN_JOB)."""
    (main_job,) = [c for c in doc_commands() if c.line == "python train.py"]
    run(ran, main_job, *MAIN_JOB)
    return home / "runs/default"


def test_training_commands(ran, home, main_job):
    """Every train.py line not run elsewhere: a preset on the user's file, overrides of the main job
    (cut as it is: its compiled programs), Muon with its learning-rate groups. Each trains its 2 steps
    into its run directory."""
    trained = commands(r"^python train\.py --config")
    for command in trained:
        run(ran, command, *training_overrides(command))
    assert len(trained) >= 4
    assert {"deeper", "shakespeare_char", "shakespeare_char_cpu", "speedrun_cpu"} <= {
        run_dir.name for run_dir in (home / "runs").iterdir() if (run_dir / "checkpoints/2").is_dir()}


def test_sample_and_eval_commands_on_the_main_job(ran, home, main_job):
    for command in commands(r"^python sample\.py --run_dir runs/default "):
        out, _ = run(ran, command, *SAMPLE)
        assert command.value("--prompt") in out, (command.line, out)
        if "--show_probs" in command.line:  # "the K likeliest next tokens" before each new token
            shown = [line.split(" ↦ ", 1)[1] for line in out.splitlines() if " ↦ " in line]
            assert shown and all(line.count("%") == int(command.value("--show_probs")) for line in shown), out
        if "--attention_png" in command.line:
            assert (home / command.value("--attention_png")).stat().st_size > 0
    (loss,) = commands(r"^python eval\.py --run_dir runs/default$")
    out, _ = run(ran, loss)
    assert loss.comment.startswith("loss, perplexity, bits per byte")
    assert {"loss", "perplexity", "bits_per_byte"} <= set(json.loads(out))
    (choices,) = commands(r"^python eval\.py --run_dir runs/default --choices")
    out, _ = run(ran, choices)  # the page: it prints the items' acc, acc_norm and acc_bytes, and where each item went
    assert re.match(r"choices: \d+ items, acc [\d.]+%, acc_norm [\d.]+%, acc_bytes [\d.]+% \(predictions in "
                    r"runs/default/choices\.jsonl\)\n", out), out
    assert (main_job / "choices.jsonl").is_file()


def test_export_and_picture_commands_on_the_main_job(ran, main_job, home):
    for command in commands(r"jaxgpt\.export"):
        out, _ = run(ran, command)
        folder = command.value("--out")
        assert out.startswith(f"wrote {folder}: ") and (home / folder / "vocab.json").is_file(), out
    for command in commands(r"jaxgpt\.viz"):
        out, _ = run(ran, command)
        assert out == f"{command.value('--out')}\n" and (home / command.value("--out")).stat().st_size > 0


def test_data_preparation_command(ran):
    """DATA.md's preparation without training, on a folder of text with GPT-2's data settings but a
    small vocabulary: it prints the cache and each split."""
    (command,) = commands(r"^python -m jaxgpt\.data")
    out, _ = run(ran, command, *DATA)
    assert re.fullmatch(r"cache: \S+\ntrain: [\d,]+ tokens, .*\nval: [\d,]+ tokens, .*\n", out), out
