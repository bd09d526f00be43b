"""Checkpoints: a state with NaN or ±inf is never saved; a restored state must match the
checksums it was saved with, which are computed on the devices (only three words per tensor
reach the host) and are the same on any mesh; a step with damaged metrics keeps its parameters."""

import json
import logging
import shutil
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from processes import finished, free_port, with_devices

from jaxgpt import checkpoint
from jaxgpt.checkpoint import (
    CHECKSUMS,
    CheckpointError,
    Checkpoints,
    MismatchedCheckpoint,
    NonFiniteState,
    tree_checksums,
)

ROOT = Path(__file__).resolve().parents[1]


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


def reference_sums(x: np.ndarray) -> list[int]:
    """[Σw, Σ(i+1)·w, non-finite] of x's bits as 32-bit words w (narrower elements zero-extended),
    in Python integers, modulo 2^32."""
    words = [int(w) for w in np.ascontiguousarray(x).view(f"uint{8 * x.itemsize}").ravel()]
    non_finite = x.dtype.kind not in "biu" and not np.isfinite(x.astype(np.float64)).all()
    return [sum(words) % 2**32, sum((i + 1) * w for i, w in enumerate(words)) % 2**32, int(non_finite)]


def test_checksums_are_the_sums_of_each_tensors_words():
    tree = {**state(2.0), "half": jnp.linspace(-3, 3, 10, dtype=jnp.bfloat16).reshape(2, 5),
            "mask": jnp.array([True, False, True]), "bad": jnp.array([1.0, jnp.inf, 2.0], jnp.bfloat16)}
    sums = tree_checksums(tree)
    assert sums == {jax.tree_util.keystr(path): reference_sums(np.asarray(leaf))
                    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
    assert sums["['step']"] == [2, 2, 0] and sums["['bad']"][2] == 1 and sums["['half']"][2] == 0


def test_one_changed_bit_or_two_swapped_elements_change_the_checksum():
    w = jnp.arange(6.0).reshape(2, 3) + 0.5
    flipped = jax.lax.bitcast_convert_type(w, jnp.uint32).at[1, 1].add(1)
    swapped = w.at[0, 0].set(w[1, 2]).at[1, 2].set(w[0, 0])
    original = tree_checksums(w)[""]  # a bare array: the empty path
    assert tree_checksums(jax.lax.bitcast_convert_type(flipped, jnp.float32))[""] != original
    assert tree_checksums(swapped)[""][0] == original[0] and tree_checksums(swapped)[""] != original
    assert tree_checksums(w.T)[""] != original  # the same values, transposed


def test_checksums_copy_no_tensor_to_the_host():
    """No host copy of the state (the earlier float64 sums made an 8 MB one of this 4 MB
    tensor); on an accelerator the guard also refuses any implicit read of a tensor (on a CPU,
    NumPy reads a jax.Array's memory in place, which no guard sees)."""
    tree = {**state(2.0), "big": jnp.full((1024, 1024), 0.5)}
    tree_checksums(tree)  # compiled first: compiling allocates on the host
    tracemalloc.start()
    try:
        with jax.transfer_guard_device_to_host("disallow"):
            sums = tree_checksums(tree)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024 and sums["['big']"] == reference_sums(np.asarray(tree["big"]))


def test_the_checksum_program_is_compiled_once_per_state_structure(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=5, async_save=False)
    checkpoints.save(1, state(1.0))
    compiled = len(checkpoint._CHECKSUM_PROGRAMS)  # the programs compiled for it
    for step in (2, 3):
        checkpoints.save(step, state(float(step)))
    checkpoints.close()
    assert len(checkpoint._CHECKSUM_PROGRAMS) == compiled


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
    metadata["custom_metadata"][CHECKSUMS]["['params']['w']"][0] += 1  # the smallest change
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


def test_tensors_replaced_by_another_steps_intact_files_are_found(tmp_path, caplog):
    """Files that orbax reads without complaint, holding other values than the ones saved."""
    directory = saved(tmp_path)
    shutil.rmtree(directory / "3" / "state")
    shutil.copytree(directory / "2" / "state", directory / "3" / "state")
    caplog.set_level(logging.WARNING)
    checkpoints = Checkpoints(tmp_path, keep=5, async_save=False)
    restored, step = checkpoints.restore(abstract())
    assert step == 2 and float(restored["params"]["b"][0]) == -2.0
    assert "checkpoint at step 3" in caplog.text and "does not match the checksum" in caplog.text
    checkpoints.close()


def reshaped(tree: dict, path: tuple[str, ...], shape: tuple[int, ...]) -> dict:
    """`tree` (of ShapeDtypeStructs) with the leaf at `path` given another shape."""
    *parents, name = path
    node = tree
    for key in parents:
        node = node[key]
    node[name] = jax.ShapeDtypeStruct(shape, node[name].dtype, sharding=node[name].sharding)
    return tree


def test_asking_for_another_models_shapes_moves_nothing_and_names_them(tmp_path, caplog):
    """Intact checkpoints asked for with other shapes or other tensors (a config that changed):
    the caller is told which tensors differ, saved against asked (state() saves w as 2×3 and
    b as 3), and every step stays where it is."""
    directory = saved(tmp_path)
    caplog.set_level(logging.WARNING)
    checkpoints = Checkpoints(tmp_path, keep=5, async_save=False)
    asked = reshaped(reshaped(abstract(), ("opt_state", "mu"), (2, 4)), ("params", "w"), (2, 4))
    with pytest.raises(MismatchedCheckpoint, match=r"step 3 .* holds another model than the one asked for "
                       r"\(params/w saved \(2, 3\) against asked \(2, 4\); opt_state/mu saved \(2, 3\) against "
                       r"asked \(2, 4\)\).*nothing was moved"):
        checkpoints.restore(asked)
    more = abstract()
    more["params"]["extra"] = jax.ShapeDtypeStruct((3,), jnp.float32)
    with pytest.raises(MismatchedCheckpoint, match=r"params/extra asked but not saved"):
        checkpoints.restore_params(more["params"])
    fewer = abstract()
    del fewer["opt_state"]
    with pytest.raises(MismatchedCheckpoint, match=r"opt_state/mu saved but not asked"):
        checkpoints.restore(fewer)
    assert checkpoints.steps() == [1, 2, 3] and not (tmp_path / "damaged_checkpoints").exists()
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2", "3"] and "damaged" not in caplog.text
    restored, step = checkpoints.restore(abstract())  # the model they hold restores as before
    assert step == 3 and float(restored["params"]["b"][0]) == -3.0
    checkpoints.close()


def test_asking_for_a_step_that_is_not_there_names_the_steps_that_are(tmp_path):
    saved(tmp_path, steps=(10, 20))
    checkpoints = Checkpoints(tmp_path, read_only=True)
    for restore in (checkpoints.restore, checkpoints.restore_params):
        with pytest.raises(CheckpointError, match=r"^no checkpoint at step 999 in .*: the steps there are 10, 20$"):
            restore(abstract() if restore == checkpoints.restore else abstract()["params"], step=999)
    checkpoints.close()


EIGHT_DEVICES = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxgpt.checkpoint import Checkpoints, tree_checksums
values = {"step": jnp.int32(5), "params": {"w": jnp.arange(64.0).reshape(8, 8) - 30.5,
          "b": jnp.linspace(-1, 1, 8)}, "opt_state": {"mu": jnp.full((8, 8), 0.25)}}

def placed(mesh_shape, matrix, vector):
    mesh = jax.make_mesh(mesh_shape, ("a", "b"))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    return {"step": put(values["step"], P()), "params": {"w": put(values["params"]["w"], matrix),
            "b": put(values["params"]["b"], vector)}, "opt_state": {"mu": put(values["opt_state"]["mu"], matrix)}}

checkpoints = Checkpoints(sys.argv[1], async_save=False)
checkpoints.save(5, placed((4, 2), P("a", "b"), P("a")))
for target in (placed((2, 4), P("b", "a"), P()), placed((8, 1), P(None, "a"), P("a")), values):
    assert tree_checksums(target) == tree_checksums(values)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target)
    restored, step = checkpoints.restore(abstract, step=5)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
        assert got.sharding == want.sharding and np.array_equal(got, want)
# under a run's mesh of all 8 devices (jax.set_mesh), leaves on one device restore and check
# where they are (init_from reads its source's checkpoints so)
with jax.set_mesh(jax.make_mesh((8,), ("data",))):
    single = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                          sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])), values)
    restored, step = checkpoints.restore(single, step=5)
    assert tree_checksums(restored) == tree_checksums(values)
checkpoints.close()
# within programs.keeping (train.py, eval.py) the checksum program is kept, and read back only for leaves
# on the devices it was compiled for
from pathlib import Path
from jaxgpt import checkpoint, programs
jax.config.update("jax_compilation_cache_dir", str(Path(sys.argv[1]) / "xla"))
expected = tree_checksums(values)
with programs.keeping():
    for device in jax.devices()[:3] * 2:
        checkpoint._CHECKSUM_PROGRAMS.clear()  # what this process compiled: only kept ones are left
        assert tree_checksums(jax.device_put(values, device)) == expected, device
    sharded = placed((4, 2), P("a", "b"), P("a"))
    checkpoint._CHECKSUM_PROGRAMS.clear()
    assert tree_checksums(sharded) == expected
assert len(list((Path(sys.argv[1]) / "xla" / programs.FOLDER).glob("*.pickle"))) == 4
print("ok")
"""


def test_a_checkpoint_saved_on_one_mesh_restores_intact_onto_others(tmp_path):
    """Checksums of a tensor sharded over 8 devices (4×2) equal those on other meshes and on
    one device, so its restore onto each passes the check, also under a mesh of other devices; a
    kept checksum program is read back only for leaves on the devices it was compiled for."""
    assert finished(with_devices(EIGHT_DEVICES, tmp_path, devices=8)) == "ok"


TWO_PROCESSES = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
process, port = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process)
from jaxgpt.checkpoint import tree_checksums
values = np.arange(48, dtype=np.float32).reshape(8, 6) - 20.5
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
def global_array(spec):
    return jax.make_array_from_callback(values.shape, NamedSharding(mesh, spec), lambda index: values[index])
sums = tree_checksums({"sharded": global_array(P("a", "b")), "replicated": global_array(P())})
assert sums["['sharded']"] == sums["['replicated']"] == tree_checksums(jnp.asarray(values))[""], sums
jax.distributed.shutdown()
print("ok")
"""


def test_checksums_over_two_processes_count_each_element_once():
    port = free_port()
    workers = [with_devices(TWO_PROCESSES, process, port, devices=2) for process in (0, 1)]
    assert [finished(worker).splitlines()[-1] for worker in workers] == ["ok", "ok"]  # after gloo's lines


def test_an_error_that_is_not_damage_propagates_and_moves_nothing(tmp_path, monkeypatch):
    """Only missing, unreadable or mismatched files are damage: any other error while restoring
    (a device or sharding problem, a bug) is raised as it is, and every step stays in place."""
    directory = saved(tmp_path)
    checkpoints = Checkpoints(tmp_path)

    def fails(*args, **kwargs):
        raise ValueError("Received incompatible devices for jitted computation")

    monkeypatch.setattr(checkpoints.manager, "restore", fails)
    with pytest.raises(ValueError, match="incompatible devices"):
        checkpoints.restore(abstract())
    with pytest.raises(ValueError, match="incompatible devices"):
        checkpoints.restore_params(abstract()["params"])
    assert checkpoints.steps() == [1, 2, 3] and sorted(p.name for p in directory.iterdir()) == ["1", "2", "3"]
    assert not (tmp_path / "damaged_checkpoints").exists()
    checkpoints.close()


@pytest.mark.parametrize("damage", ["no state directory", "no tensor metadata"])
def test_missing_files_are_damage_and_the_previous_step_is_used(tmp_path, damage, caplog):
    directory = saved(tmp_path)
    if damage == "no state directory":
        shutil.rmtree(directory / "3" / "state")
    else:
        (directory / "3" / "state" / "_METADATA").unlink()
    caplog.set_level(logging.WARNING)
    checkpoints = Checkpoints(tmp_path)
    restored, step = checkpoints.restore(abstract())
    assert step == 2 and float(restored["params"]["b"][0]) == -2.0
    assert "checkpoint at step 3" in caplog.text and (tmp_path / "damaged_checkpoints" / "3").is_dir()
    checkpoints.close()


def test_opening_checkpoints_to_read_says_nothing_of_a_read_only_directory(tmp_path, caplog):
    """orbax's notice of the mode (read only) reads as a fault of a writable directory."""
    saved(tmp_path)
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="absl")  # whatever an earlier test in this process set it to
    checkpoints = Checkpoints(tmp_path, read_only=True)
    checkpoints.restore_params(abstract()["params"])
    checkpoints.close()
    assert "read only" not in caplog.text
    logging.getLogger("absl").warning("Given directory is read only=%s", "elsewhere")  # only while opening
    assert "read only=elsewhere" in caplog.text
