"""Checkpoints: a state with NaN or ±inf is never saved; a restored state must match the
checksums it was saved with; a step with damaged metrics keeps its parameters."""

import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.checkpoint import CheckpointError, Checkpoints, NonFiniteState, tree_checksums


def state(seed: float) -> dict:
    return {"step": jnp.asarray(int(seed), jnp.int32),
            "params": {"w": jnp.arange(6.0).reshape(2, 3) * seed, "b": jnp.full((3,), -seed)},
            "opt_state": {"mu": jnp.ones((2, 3)) * seed}}


def abstract() -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state(1.0))


def saved(tmp_path, steps=(1, 2, 3), losses=None) -> Path:
    checkpoints = Checkpoints(tmp_path, keep=5, async_save=False)
    for i, step in enumerate(steps):
        checkpoints.save(step, state(float(step)), val_loss=None if losses is None else losses[i])
    checkpoints.close()
    return tmp_path / "checkpoints"


def test_checksums_are_float64_sums_of_each_tensor():
    sums = tree_checksums(state(2.0))
    w = np.arange(6.0) * 2.0
    assert sums["['params']['w']"] == [w.sum(), np.abs(w).sum()]
    assert sums["['params']['b']"] == [-6.0, 6.0]
    assert sums["['step']"] == [2.0, 2.0]


def test_a_non_finite_state_is_never_saved_and_the_tensor_is_named(tmp_path):
    bad = state(1.0)
    bad["opt_state"]["mu"] = bad["opt_state"]["mu"].at[1, 2].set(jnp.nan)
    checkpoints = Checkpoints(tmp_path, async_save=False)
    checkpoints.save(1, state(1.0))
    with pytest.raises(NonFiniteState, match=r"step 2: \['opt_state'\]\['mu'\] holds NaN or infinite values"):
        checkpoints.save(2, bad)
    assert checkpoints.steps() == [1]
    checkpoints.close()
    assert not (tmp_path / "checkpoints" / "2").exists()


def test_a_state_that_does_not_match_its_checksums_falls_back_to_the_previous(tmp_path, caplog):
    directory = saved(tmp_path)
    # What a flipped bit in an array file amounts to once orbax has read it: other values than
    # the ones saved. Recording other sums for step 3 makes its true arrays that mismatch.
    metadata_file = directory / "3" / "_CHECKPOINT_METADATA"
    metadata = json.loads(metadata_file.read_text())
    metadata["custom_metadata"]["checksums"]["['params']['w']"][0] += 1e-6
    metadata_file.write_text(json.dumps(metadata))
    caplog.set_level(logging.WARNING)
    checkpoints = Checkpoints(tmp_path, keep=5, async_save=False)
    restored, step = checkpoints.restore(abstract())
    assert step == 2 and float(restored["params"]["b"][0]) == -2.0
    assert "step 3" in caplog.text and "['params']['w'] does not match the checksum" in caplog.text
    assert (tmp_path / "damaged_checkpoints" / "3").is_dir() and checkpoints.steps() == [1, 2]
    checkpoints.close()
    (tmp_path / "damaged_checkpoints" / "3").rename(directory / "3")  # asked for by its step: refused
    with pytest.raises(CheckpointError, match=r"step 3 .* does not match the checksum"):
        Checkpoints(tmp_path, read_only=True).restore(abstract(), step=3)


def test_garbage_metrics_cost_that_step_its_validation_loss_not_its_parameters(tmp_path, caplog):
    directory = saved(tmp_path, losses=[3.0, 1.0, 2.0])
    (directory / "3" / "metrics" / "metrics").write_bytes(b"\x00garbage")
    caplog.set_level(logging.WARNING)
    checkpoints = Checkpoints(tmp_path, keep=5, async_save=False)
    assert checkpoints.steps() == [1, 2, 3]
    restored, step = checkpoints.restore(abstract())
    assert step == 3 and float(restored["params"]["b"][0]) == -3.0
    assert checkpoints.best_step() == 2
    aside = sorted(p.name for p in (tmp_path / "damaged_checkpoints").iterdir())
    assert aside == ["metrics-of-step-3"] and "metrics of checkpoint step 3 are unreadable" in caplog.text
    checkpoints.close()


def test_sampling_falls_back_from_a_damaged_best_checkpoint(tmp_path, caplog):
    directory = saved(tmp_path, losses=[3.0, 1.0, 2.0])
    for f in (directory / "2" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(b"\0garbage")
    caplog.set_level(logging.WARNING)
    checkpoints = Checkpoints(tmp_path, read_only=True)
    params, step = checkpoints.restore_params(abstract()["params"])
    assert step == 3 and float(params["b"][0]) == -3.0  # the best (2) is damaged: the newest intact
    assert "checkpoint at step 2" in caplog.text
    with pytest.raises(CheckpointError, match="checkpoint at step 2 .* is unreadable or damaged"):
        checkpoints.restore_params(abstract()["params"], step=2)
    assert (directory / "2").is_dir()  # read-only: nothing moved
