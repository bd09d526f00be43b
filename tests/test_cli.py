"""The command line of a run (jaxgpt.cli): both of absl's forms read alike, and nothing on it
silently ignored (a stray word, a --json that cannot be written)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxgpt.cli import equals_form, overridden_keys, parse_config
from jaxgpt.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "configs" / "default.py"
SMALL = ["--config.model.vocab_size=256", "--config.model.n_layer=1", "--config.model.n_head=2",
         "--config.model.d_model=16", "--config.model.block_size=16", "--config.train.batch_size=2",
         "--config.train.eval_batch_size=2", "--config.sample.max_new_tokens=2"]


def parsed(*args):
    return parse_config(["train.py", *args], DEFAULT)


def test_config_file_with_a_space_is_the_config_file_and_names_the_run_dir():
    spaced, joined = parsed("--config", "configs/shakespeare_char.py"), parsed("--config=configs/shakespeare_char.py")
    assert spaced.to_dict() == joined.to_dict()
    assert spaced.run_dir == str(Path("runs") / "shakespeare_char")


def test_space_form_none_clears_a_key_whose_default_is_none():
    args = ["--config=configs/finetune_records.py", "--config.data.records.template"]
    assert parsed(*args, "None").data.records.template is None
    assert parsed(*args, "None").to_dict() == parsed(f"{args[0]}", f"{args[1]}=None").to_dict()


def test_space_form_values_and_booleans():
    config = parsed("--config.train.steps", "7", "--config.mesh.data", "-1", "--config.compile_only",
                    "--config.train.lr", "0.5")
    assert (config.train.steps, config.mesh.data, config.compile_only, config.train.lr) == (7, -1, True, 0.5)


def test_equals_form_joins_values_and_leaves_boolean_flags():
    argv = ["train.py", "--config", "c.py", "--config.a.b", "-1", "--config.flag", "--noconfig.other",
            "--config.last"]
    assert equals_form(argv) == ["train.py", "--config=c.py", "--config.a.b=-1", "--config.flag", "--noconfig.other",
                                 "--config.last"]


def test_overridden_keys_sees_every_form():
    argv = ["sweep", "--config.train.steps", "5", "--config.compile_only", "--noconfig.model.bias",
            "--config.mesh.data=-1", "--config=c.py"]
    assert overridden_keys(argv) == ["train.steps", "compile_only", "model.bias", "mesh.data"]


@pytest.mark.parametrize("args, says", [
    (["steps=10"], "'steps=10' is neither: did you mean --config.train.steps=10?"),
    (["configs/shakespeare_char.py"], "did you mean --config=configs/shakespeare_char.py?"),
    (["--config=configs/shakespeare_char.py", "train.lr=0.1"], "did you mean --config.train.lr=0.1?"),
    (["-config.train.steps=3"], "did you mean --config.train.steps=3?"),
    (["--config.train.steps=3", "hello"], "'hello' is neither"),
    (["--config"], "--config needs a value: --config=FILE"),
])
def test_a_stray_argument_is_refused(args, says):
    with pytest.raises(ConfigError) as caught:
        parsed(*args)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_train_py_refuses_a_stray_word_in_one_line():
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config=configs/shakespeare_char.py",
                           "steps=10"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0] == ("train.py: the command line takes --config=FILE and --config.KEY=VALUE overrides; 'steps=10' "
                        "is neither: did you mean --config.train.steps=10?")


def compile_command(*argv):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "jaxgpt.compile", *SMALL, *argv], env=env, capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("where, reason", [(".", "it is a directory"), ("missing/report.json", "no directory")])
def test_compile_refuses_a_json_path_it_cannot_write_in_one_line(tmp_path, where, reason):
    path = tmp_path / where
    done = compile_command("--json", str(path))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith(f"jaxgpt.compile: cannot write --json {path} ({reason}")
    assert not done.stdout.strip()  # refused before anything was compiled


def test_a_json_write_that_fails_after_the_table_is_one_line(tmp_path, monkeypatch, capsys):
    from jaxgpt import compile as ahead

    monkeypatch.setattr(ahead, "format_report", lambda result: "the table")
    assert ahead.print_and_check({"programs": {"train step": {}}}, str(tmp_path)) == 2
    out, err = capsys.readouterr()
    assert out == "the table\n" and err.startswith(f"jaxgpt.compile: cannot write --json {tmp_path} (")
    assert len(err.strip().splitlines()) == 1


def test_train_py_help_prints_its_usage_and_exits_0():
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("Train a GPT: `python train.py") and "--config.SECTION.KEY=VALUE" in done.stdout


@pytest.mark.parametrize("typed, means", [(r"Q: {q}\nA: ", "Q: {q}\nA: "), (r"a\tb", "a\tb"), (r"C:\\n", "C:\\n"),
                                          (r"x\y \d", r"x\y \d"), ("no escapes", "no escapes")])
def test_a_text_on_the_command_line_reads_three_escapes_once(typed, means):
    """A worked example of the rule (docs/CONFIG.md): \\n, \\t and \\\\ as Python reads them, any other backslash
    as typed; the value given twice is read once (the last), in any string key."""
    config = parsed("--config.sample.prompt=first", f"--config.sample.prompt={typed}",
                    f"--config.data.records.prompt_template={typed}")
    assert config.sample.prompt == config.data.records.prompt_template == means


def test_an_override_may_stand_before_the_config_file():
    before = parsed("--config.run_dir=X", "--config.train.lr=0.01", "--config=configs/shakespeare_char.py")
    after = parsed("--config=configs/shakespeare_char.py", "--config.run_dir=X", "--config.train.lr=0.01")
    assert before.to_dict() == after.to_dict() and before.run_dir == "X" and before.train.lr == 0.01
    assert before.data.tokenizer == "char"  # the file's, not the default's


@pytest.mark.parametrize("command, rest", [(["train.py"], []), (["-m", "jaxgpt.data"], []),
                                           (["-m", "jaxgpt.sweep"], ["--grid", "model.bias=False,True", "--out", "S"])])
def test_every_command_with_config_overrides_reads_one_before_the_file_and_prints_its_help(command, rest, tmp_path):
    """Each command line that takes --config (train.py, jaxgpt.data, the sweep) prints its usage for --help, and
    an override before the file is read as after it (here a bad value, refused in one line, not absl's error)."""
    argv = [sys.executable, *[str(ROOT / c) if c.endswith(".py") else c for c in command]]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    helped = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert helped.returncode == 0 and "--config" in helped.stdout, helped.stderr[-2000:]
    refused = subprocess.run([*argv, "--config.train.lr=oops", f"--config={ROOT}/configs/shakespeare_char.py", *rest],
                             capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1 and "train.lr" in lines[0], refused.stderr[-2000:]
    assert "before a value for --config" not in refused.stderr
