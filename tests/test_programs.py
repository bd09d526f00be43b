"""Compiled programs kept with what they were lowered from (jaxgpt.programs): a repeated
run loads its train step, init and eval step instead of tracing the model, and ends bit for
bit where a run that traced and compiled them ends; anything its lowering reads, changed, lowers
it again, and keeps it (though JAX's cache holds its code); a kept program that cannot be read
back is compiled again."""

import os
import sys

import jax
import numpy as np
import pytest
from runs import tiny_config, write_corpus

from jaxgpt import checkpoint, platforms, programs
from jaxgpt.train import evaluation
from jaxgpt.train import run as run_module


@pytest.fixture
def kept_in(tmp_path, monkeypatch):
    """Programs kept under tmp_path/xla/programs for this test, and the names of the programs
    lowered (train_step, init, eval_step), in order."""
    monkeypatch.setattr(programs, "folder", lambda: tmp_path / "xla" / programs.FOLDER)
    monkeypatch.setattr(evaluation, "_EVAL_STEPS", {})  # eval steps and checksums this process made for other tests
    monkeypatch.setattr(checkpoint, "_CHECKSUM_PROGRAMS", {})
    lowered = []
    original = programs.compiled

    def counting(description, name, lower, compiler=None):
        return original(description, name, lambda renamed: lowered.append(name) or lower(renamed), compiler)

    monkeypatch.setattr(programs, "compiled", counting)
    return tmp_path / "xla" / programs.FOLDER, lowered


def trained(tmp_path, name, **changes):
    """A tiny run whose train step no other test compiles (its learning rate)."""
    changes = {"train.lr": 1.23e-3, **changes}
    result = run_module.train(tiny_config(tmp_path, tmp_path / "corpus.txt", name, **changes), keep_programs=True)
    params = run_module.load_run(tmp_path / name)[0]
    return result, jax.tree.leaves(params)


# and the checksums of the state saved and of the params load_run restores (that one outside keeping)
EVERY = ["train_step", "init", "eval_step", "checksums", "checksums"]


def test_a_repeated_run_loads_its_programs_without_tracing_and_ends_bit_for_bit(tmp_path, kept_in):
    folder, lowered = kept_in
    write_corpus(tmp_path / "corpus.txt")
    first, first_params = trained(tmp_path, "first")
    assert sorted(lowered) == sorted(EVERY) and len(list(folder.glob("*.pickle"))) == 4
    again, again_params = trained(tmp_path, "again")
    assert sorted(lowered) == sorted(EVERY)  # nothing traced: the kept programs ran
    assert again["train_loss"] == first["train_loss"] and again["val_loss"] == first["val_loss"]
    assert all(np.array_equal(a, b) for a, b in zip(first_params, again_params, strict=True))
    seeded, _ = trained(tmp_path, "seeded", **{"train.seed": 7, "train.eval_every": 2})  # no program reads these
    assert sorted(lowered) == sorted(EVERY) and seeded["train_loss"] != first["train_loss"]
    other, _ = trained(tmp_path, "other", **{"train.lr": 3.21e-3})  # another setting: another step and init
    assert sorted(lowered[5:]) == ["init", "train_step"] and len(list(folder.glob("*.pickle"))) == 6
    assert other["train_loss"] != first["train_loss"]


def test_programs_whose_key_changed_are_compiled_and_kept_though_jax_cache_holds_their_code(tmp_path, kept_in,
                                                                                            monkeypatch):
    """A run started otherwise (here another environment; or jaxgpt's files touched) lowers the
    same code as before, which JAX's cache holds, and a program JAX reads from its cache cannot be
    kept: each kept program's name carries its key, so XLA compiles it, and the next run so
    started traces nothing."""
    folder, lowered = kept_in
    write_corpus(tmp_path / "corpus.txt")
    alone = {"train.lr": 1.41e-3, "train.eval_batch_size": 5, "model.d_ff": 40}  # programs no other test compiles
    trained(tmp_path, "first", **alone)
    monkeypatch.setitem(platforms.STARTED_WITH, "JAXGPT_TEST_START", "another")
    trained(tmp_path, "second", **alone)
    # the eval step and the checksums, which this process holds already, are not made again
    assert sorted(lowered) == sorted([*EVERY, "train_step", "init"]) and len(list(folder.glob("*.pickle"))) == 6
    trained(tmp_path, "third", **alone)
    assert len(lowered) == 7


def test_a_kept_program_that_cannot_be_read_is_compiled_again(tmp_path, kept_in):
    folder, lowered = kept_in
    write_corpus(tmp_path / "corpus.txt")
    _, first_params = trained(tmp_path, "first", **{"train.lr": 1.37e-3})
    kept = list(folder.glob("*.pickle"))
    for path in kept:
        path.write_bytes(b"\0not a program")
    _, again_params = trained(tmp_path, "again", **{"train.lr": 1.37e-3})
    # lowered again (but the eval step this process holds), and read from JAX's cache: not keepable
    assert sorted(lowered) == sorted([*EVERY, "train_step", "init"])
    assert all(path.read_bytes() == b"\0not a program" for path in kept)  # so nothing was kept in their place
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
    lowered = []
    assert programs.folder() is not None
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        assert programs.folder() is None
        with programs.keeping():
            assert programs.compiled("settings", "program", lambda name: lowered.append(name) or jax.jit(
                lambda x: x + 1).lower(1)).result()(1) == 2 and lowered == [None]  # lowered, unnamed, not kept
    finally:
        jax.config.update("jax_enable_compilation_cache", True)


def test_the_code_in_the_key_is_jaxgpts_files_and_the_modules_imported():
    """jaxgpt's own files, each; not the rest of the checkout it sits in (a virtualenv there made
    every key take 0.3 s): the bench scripts and train.py are in a key only where a process imports
    or names them."""
    from pathlib import Path

    files = {entry[0] for entry in programs.code_state() if len(entry) == 3}
    own = Path(programs.__file__).resolve().parent
    assert {str(path) for path in own.rglob("*.py")} <= files
    assert not {str(own.parent / "train.py"), str(own.parent / "bench" / "bench_startup.py")} & files
