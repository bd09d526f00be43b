"""A run's checkpoints when something is wrong around them: a resume that asks for another model
is refused in one line and every checkpoint kept; a save that fails ends the process."""

import json
import subprocess

import pytest
from processes import with_devices
from test_run import cli_args, corpus, run_records, run_train_py, tiny_config  # noqa: F401 (corpus: a fixture)

from jaxgpt import ComputeConfig, GPTConfig, tokenizers
from jaxgpt.config import TrainConfig
from jaxgpt.errors import TrainingError
from jaxgpt.train.rundir import check_same_run


def test_a_resume_of_another_model_names_only_the_fields_that_differ(tmp_path):
    saved = GPTConfig(vocab_size=30, block_size=8, n_layer=1, n_head=4, n_kv_head=4, d_model=16)
    (tmp_path / "config.json").write_text(json.dumps({"model": saved.to_dict(),
                                                      "compute": ComputeConfig().to_dict()}))
    asked = GPTConfig(vocab_size=30, block_size=8, n_layer=1, n_head=4, n_kv_head=2, d_model=16)
    tokenizer = tokenizers.train_tokenizer("char", ["abc"])
    with pytest.raises(TrainingError) as refused:
        check_same_run(tmp_path, asked, ComputeConfig(), tokenizer)
    assert f"{tmp_path} holds a run of another model (n_kv_head: 4 → 2, saved → asked); " in str(refused.value)


def test_a_truncated_config_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model": {"vocab_size": 3')
    with pytest.raises(TrainingError, match=f"^{tmp_path / 'config.json'} does not parse "):
        check_same_run(tmp_path, GPTConfig(), ComputeConfig(), tokenizers.train_tokenizer("char", ["abc"]))


def test_a_deleted_config_and_another_model_keep_every_checkpoint(tmp_path, corpus):  # noqa: F811
    """config.json deleted, the run resumed with another d_model: refused in one line that
    names the shapes (d_model 16 → 32 with 2 heads: the attention's input kernel d_model × 3 ×
    heads × d_model/heads), nothing moved, and the right config resumes from the last step."""
    from jaxgpt.train.run import train

    train(tiny_config(tmp_path, corpus))  # checkpoints at steps 3 and 6
    (tmp_path / "run" / "config.json").unlink()
    out = run_train_py(cli_args(tmp_path, corpus, **{"model.d_model": 32, "train.steps": 9}))
    errors = [line for line in out.stderr.splitlines() if line.startswith("train.py:")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
    assert "params/h_0/attn/c_attn/kernel saved (16, 3, 2, 8) against asked (32, 3, 2, 16)" in errors[0]
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["3", "6"]
    assert not (tmp_path / "run" / "damaged_checkpoints").exists()
    assert train(tiny_config(tmp_path, corpus, **{"train.steps": 9}))["step"] == 9
    assert run_records(tmp_path / "run") == list(range(1, 10))  # taken up at step 7


FAILED_SAVE = """
import shutil, sys
from pathlib import Path
import jax.numpy as jnp
from jaxgpt.checkpoint import CheckpointError, Checkpoints
checkpoints = Checkpoints(sys.argv[1], async_save=True)
shutil.rmtree(checkpoints.directory)
checkpoints.directory.write_text("not a directory")
try:
    checkpoints.save(1, {"step": jnp.int32(1), "params": {"w": jnp.ones((2, 3))}})
    checkpoints.close()
except CheckpointError as error:
    print(error)
"""


def test_a_failed_asynchronous_save_ends_the_process(tmp_path):
    """The save's error is reported, and no writer thread keeps the process alive after it."""
    process = with_devices(FAILED_SAVE, tmp_path, devices=1)
    try:
        out, err = process.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail("the process did not end after its save failed")
    assert process.returncode == 0, err[-3000:]
    assert out.startswith(f"writing a checkpoint in {tmp_path / 'checkpoints'} failed"), out


def test_train_py_with_checkpoints_a_file_stops_in_one_line(tmp_path, corpus):  # noqa: F811
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("not a directory")
    out = run_train_py(cli_args(tmp_path, corpus), timeout=120)
    errors = [line for line in out.stderr.splitlines() if line.startswith("train.py:")]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert errors == [f"train.py: {tmp_path / 'run' / 'checkpoints'} is a file, not a directory of checkpoints: move "
                      "it away and run again"]


def test_a_resume_under_another_optimizer_is_refused_naming_it(tmp_path):
    cfg = GPTConfig(vocab_size=30, block_size=8, n_layer=1, n_head=4, d_model=16)
    (tmp_path / "config.json").write_text(json.dumps({"model": cfg.to_dict(), "compute": ComputeConfig().to_dict(),
                                                      "train": {"optimizer": "adamw"}}))
    tokenizer = tokenizers.train_tokenizer("char", ["abc"])
    check_same_run(tmp_path, cfg, ComputeConfig(), tokenizer, TrainConfig(optimizer="adamw"))  # the same: resumes
    with pytest.raises(TrainingError) as refused:
        check_same_run(tmp_path, cfg, ComputeConfig(), tokenizer, TrainConfig(optimizer="muon"))
    assert str(refused.value) == (f"{tmp_path} holds a run trained with train.optimizer='adamw', whose state its "
                                  "checkpoints keep: resume it with --config.train.optimizer=adamw, or give "
                                  "train.optimizer='muon' another --config.run_dir")
    muon = TrainConfig(optimizer="muon", muon_coeffs="polar_express")  # a key whose value the state holds
    (tmp_path / "config.json").write_text(json.dumps({"model": cfg.to_dict(), "compute": ComputeConfig().to_dict(),
                                                      "train": {"optimizer": "muon"}}))  # from before muon_coeffs
    with pytest.raises(TrainingError, match=r"holds a run trained with train.muon_coeffs='quintic', whose state its "
                                            r"checkpoints keep: resume it with --config.train.muon_coeffs=quintic"):
        check_same_run(tmp_path, cfg, ComputeConfig(), tokenizer, muon)
