"""Compiled train steps kept with what they were lowered from (jaxgpt.train.programs): a repeated
run loads its step instead of tracing the model, and ends bit for bit where a run that traced and
compiled it ends; anything its lowering reads, changed, lowers it again; a kept program that
cannot be read back is compiled again."""

import os
import sys

import jax
import numpy as np
import pytest
from runs import tiny_config, write_corpus

from jaxgpt import platforms
from jaxgpt.train import programs
from jaxgpt.train import run as run_module


@pytest.fixture
def kept_in(tmp_path, monkeypatch):
    """Programs kept under tmp_path/xla/programs for this test, and a count of the train steps lowered."""
    monkeypatch.setattr(programs, "folder", lambda: tmp_path / "xla" / programs.FOLDER)
    lowered = []
    original = run_module.lower_train_step
    monkeypatch.setattr(run_module, "lower_train_step", lambda *a, **k: lowered.append(1) or original(*a, **k))
    return tmp_path / "xla" / programs.FOLDER, lowered


def trained(tmp_path, name, **changes):
    """A tiny run whose train step no other test compiles (its learning rate): XLA compiles it here,
    not JAX's cache of the session, and only such a program is kept."""
    changes = {"train.lr": 1.23e-3, **changes}
    result = run_module.train(tiny_config(tmp_path, tmp_path / "corpus.txt", name, **changes), keep_programs=True)
    params = run_module.load_run(tmp_path / name)[0]
    return result, jax.tree.leaves(params)


def test_a_repeated_run_loads_its_step_without_tracing_and_ends_bit_for_bit(tmp_path, kept_in):
    folder, lowered = kept_in
    write_corpus(tmp_path / "corpus.txt")
    first, first_params = trained(tmp_path, "first")
    assert len(lowered) == 1 and len(list(folder.glob("*.pickle"))) == 1
    again, again_params = trained(tmp_path, "again")
    assert len(lowered) == 1  # nothing traced: the kept step ran
    assert again["train_loss"] == first["train_loss"] and again["val_loss"] == first["val_loss"]
    assert all(np.array_equal(a, b) for a, b in zip(first_params, again_params, strict=True))
    other, _ = trained(tmp_path, "other", **{"train.lr": 3.21e-3})  # another setting: another program
    assert len(lowered) == 2 and len(list(folder.glob("*.pickle"))) == 2 and other["train_loss"] != first["train_loss"]


def test_a_kept_program_that_cannot_be_read_is_compiled_again(tmp_path, kept_in):
    folder, lowered = kept_in
    write_corpus(tmp_path / "corpus.txt")
    _, first_params = trained(tmp_path, "first", **{"train.lr": 1.37e-3})
    (kept,) = folder.glob("*.pickle")
    kept.write_bytes(b"\0not a program")
    _, again_params = trained(tmp_path, "again", **{"train.lr": 1.37e-3})
    assert len(lowered) == 2  # lowered again, and read from JAX's cache (which a kept program cannot be made of)
    assert kept.read_bytes() == b"\0not a program"  # so nothing was kept in its place
    assert all(np.array_equal(a, b) for a, b in zip(first_params, again_params, strict=True))


def test_a_folder_that_cannot_be_written_keeps_nothing_and_the_run_goes_on(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(programs, "folder", lambda: tmp_path / "a_file" / programs.FOLDER)
    write_corpus(tmp_path / "corpus.txt")
    assert trained(tmp_path, "run")[0]["step"] == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "cache", "corpus.txt", "run"]


def test_the_key_changes_with_the_settings_the_code_the_start_and_the_machine(tmp_path, monkeypatch):
    base = programs.fingerprint("settings")
    assert programs.fingerprint("settings") == base and programs.fingerprint("other settings") != base
    module = tmp_path / "user_math.py"  # a user's own module, imported: its file is part of the key
    module.write_text("SCALE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("user_math")
    with_module = programs.fingerprint("settings")
    assert with_module != base
    module.write_text("SCALE = 2\n")
    os.utime(module, ns=(1, 1))
    assert programs.fingerprint("settings") != with_module
    monkeypatch.delitem(sys.modules, "user_math")
    monkeypatch.setitem(platforms.STARTED_WITH, "XLA_FLAGS", "--xla_backend_optimization_level=1")
    assert programs.fingerprint("settings") != base  # started with other XLA flags
    monkeypatch.undo()
    monkeypatch.setattr(programs, "machine", lambda: ["another machine"])
    assert programs.fingerprint("settings") != base


def test_nothing_is_kept_where_the_compilation_cache_is_off():
    assert programs.folder() is not None
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        assert programs.folder() is None and programs.load("settings") == (None, None)
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
