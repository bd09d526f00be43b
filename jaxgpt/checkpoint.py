"""Checkpoints of the train state with orbax: save (async), keep the last K and the best by
validation loss, restore onto a target that carries the current shardings, fall back from
a damaged checkpoint to the newest intact one."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jaxgpt import programs
from jaxgpt.errors import one_line

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"


def _state_handler() -> ocp.PyTreeCheckpointHandler:
    """The train state's handler: every leaf a jax.Array, each written whole by its first
    replica. (orbax's default splits a replicated array among its replicas, which compiles a
    slicing program per shape and device: 14 programs for the CPU recipe on 2 cores.)"""
    arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=False)
    return ocp.PyTreeCheckpointHandler(
        type_handler_registry=ocp.type_handlers.create_type_handler_registry((jax.Array, arrays)))


def _val_loss(metrics) -> float:
    return metrics["val_loss"]


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was expected."""


class MismatchedCheckpoint(CheckpointError):
    """A checkpoint that holds other tensors, or other shapes, than the state asked for: the
    config asked for another model. The checkpoint is intact and left where it is."""

    def __init__(self, step: int, directory: Path, differences: str):
        super().__init__(f"checkpoint at step {step} in {directory} holds another model than the one asked for "
                         f"({differences}): ask for the model it was written with (its run's config); nothing was "
                         "moved")
        self.step, self.differences = step, differences


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files are missing or unreadable, or whose tensors do not match the
    checksums they were saved with: the only failure that moves a step aside. Anything else
    raised while restoring (a device or sharding problem, a bug) is not the checkpoint's fault
    and propagates as the error it is."""


class NonFiniteState(CheckpointError):
    """A state that holds NaN or ±inf, which is never saved; `path` names the first such tensor."""

    def __init__(self, step: int, path: str):
        super().__init__(f"step {step}: {path} holds NaN or infinite values; not saving it")
        self.step, self.path = step, path


# A checksum is integer arithmetic on the tensors' bits, computed where the tensors are: on the
# devices, by one jitted program over the whole tree (compiled once per tree structure, and
# global over the processes as any jitted program over global arrays is). Three words per
# tensor come to the host, never the tensor. Addition modulo 2^32 is associative, so another
# reduction order (another mesh, a restore onto M devices of what N wrote) gives the same
# sums bit for bit, and the restored sums must equal the recorded ones exactly: no rounding
# tolerance, so a change of one bit of one element is found. (orbax 0.12 has no checksum of
# the array data: its zarr3 crc32c covers only the shard index.)
CHECKSUMS = "tensor_sums"  # the key in a step's custom metadata (earlier float sums were 'checksums')
NON_FINITE = 2  # a tensor's checksum is [Σw, Σ(i+1)·w, holds NaN or ±inf]: see _tensor_sums


def _words(x: jax.Array) -> jax.Array:
    """The bits of x as uint32 words: one per element (narrower ones zero-extended), two per
    64-bit element."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if x.dtype.itemsize >= 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major index modulo 2^32, from iotas: elementwise, so a sharded
    array computes its own shards' indices without moving data."""
    index, stride = jnp.zeros(shape, jnp.uint32), 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def _tensor_sums(x: jax.Array) -> jax.Array:
    """[Σw, Σ(i+1)·w, any non-finite] over the words w of x, in uint32 (sums modulo 2^32).
    Σw changes with any one changed word; the weighted sum also with moved ones (a transposed
    or misplaced shard), unless (i−j)(w_i−w_j) ≡ 0 modulo 2^32. One reduction of three
    operands, one pass over x: XLA's CPU backend splits a lone integer sum into a tree of
    partial sums, slower by 2.5–4× (100–215 ms against 40–57 ms on GPT-2's 50257×768
    embedding, 2 shared Xeon cores)."""
    words = _words(x)
    non_finite = ~jnp.isfinite(x) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.zeros(x.shape, bool)
    if words.ndim > x.ndim:  # two words per element
        non_finite = jnp.broadcast_to(non_finite[..., None], words.shape)
    operands = (words, words * (_flat_index(words.shape) + 1), non_finite.astype(jnp.uint32))
    sums = jax.lax.reduce(operands, (jnp.uint32(0),) * 3, _add_add_or, tuple(range(words.ndim)))
    return jnp.stack(sums)


def _add_add_or(a: tuple, b: tuple) -> tuple:
    return a[0] + b[0], a[1] + b[1], a[2] | b[2]


def _device_checksums(leaves: list[jax.Array]) -> jax.Array:
    """[n_leaves, 3] uint32: the checksums of leaves that share one set of devices."""
    return jnp.stack([_tensor_sums(x) for x in leaves])


_CHECKSUM_PROGRAMS: dict = {}  # description of the leaves (their devices included) → _device_checksums compiled


def _checksum_program(leaves: list[jax.Array]) -> jax.stages.Compiled:
    """_device_checksums compiled for leaves like these, on their devices: once per state structure
    in a process; within programs.keeping (train.py, eval.py) kept and read back untraced, as the
    train step is (a warm 1-step run of the CPU recipe traced it for 0.28 s)."""
    description = repr(("checksums", programs.abstract(leaves)))
    if description not in _CHECKSUM_PROGRAMS:
        _CHECKSUM_PROGRAMS[description] = programs.compiled(description, "checksums", lambda name: jax.jit(
            programs.renamed(_device_checksums, name)).lower(leaves)).result()
    return _CHECKSUM_PROGRAMS[description]


def _device_groups(leaves: list[jax.Array]) -> list[list[int]]:
    """The leaves' indices grouped by the devices they live on (one program runs on one set)."""
    groups: dict[frozenset, list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(frozenset(leaf.sharding.device_set), []).append(i)
    return list(groups.values())


def tree_checksums(tree) -> dict[str, list[int]]:
    """Per leaf, [Σw, Σ(i+1)·w, non-finite] (see _tensor_sums): what a checkpoint records,
    and what its restored arrays must give again. Computed on the devices; only these three
    words per leaf are copied to the host."""
    flat = jax.tree_util.tree_leaves_with_path(tree)
    leaves = [leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf) for _, leaf in flat]
    sums = [[]] * len(leaves)
    for group in _device_groups(leaves):
        chosen = [leaves[i] for i in group]
        with jax.set_mesh(None):  # run where the leaves are, whatever mesh the caller has set
            on_device = _checksum_program(chosen)(chosen)
        for i, row in zip(group, jax.device_get(on_device).tolist(), strict=True):
            sums[i] = row
    return {jax.tree_util.keystr(path): row for (path, _), row in zip(flat, sums, strict=True)}


def first_non_finite(checksums: dict[str, list[int]]) -> str | None:
    """The first tensor that holds a NaN or an infinity, or None."""
    return next((path for path, sums in checksums.items() if sums[NON_FINITE]), None)


def _mismatch(recorded: dict[str, list[int]], restored: dict[str, list[int]]) -> str | None:
    """The first tensor whose restored sums differ from the recorded ones (exact: integer sums
    do not depend on the order of adding)."""
    return next((path for path, sums in restored.items() if path in recorded and recorded[path] != sums), None)


class Checkpoints:
    """run_dir/checkpoints/<step>/state: {'step', 'params', 'opt_state'}, with the validation
    loss of the step as orbax metrics when it was evaluated, and the checksums of every saved
    tensor in the step's metadata: a state with a NaN or an infinity is never saved, and a
    restored state that does not match its checksums counts as damaged."""

    def __init__(self, run_dir, keep: int = 3, async_save: bool = True, read_only: bool = False):
        self.directory = Path(run_dir).absolute() / CHECKPOINT_DIR
        self.read_only = read_only
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory} is a file, not a directory of checkpoints: move it away and run "
                                  "again")
        keep_policy = policies.AnyPreservationPolicy([
            policies.LatestN(n=keep),
            policies.BestN(get_metric_fn=_val_loss, reverse=True, n=1,
                           keep_checkpoints_without_metrics=False),
        ])
        options = ocp.CheckpointManagerOptions(
            preservation_policy=keep_policy,
            best_fn=_val_loss,  # makes orbax write each step's metrics
            best_mode="min",
            enable_async_checkpointing=async_save,
            # A step's directories made before save() returns: made in the background, a failure
            # to make them (checkpoints/ a file, a lost mount) left orbax's writer threads waiting
            # 300 s for them, and the process with them, after the error was reported.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
            create=not read_only,
            read_only=read_only,
            save_interval_steps=0 if read_only else 1,
        )
        if not read_only and self.directory.is_dir():
            _repair_steps(self.directory)
        try:
            with _quiet_read_only_notice():
                self.manager = ocp.CheckpointManager(self.directory, options=options,
                                                    item_handlers={"state": _state_handler()})
        except Exception as error:
            raise CheckpointError(f"cannot read the checkpoints in {self.directory} "
                                  f"({one_line(error, with_type=True)}); move the damaged step aside") from error

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: dict, val_loss: float | None = None) -> None:
        """Save `state` as `step` (asynchronously unless async_save=False); NonFiniteState,
        and nothing written, when a tensor of it holds NaN or ±inf."""
        checksums = tree_checksums(state)
        bad = first_non_finite(checksums)
        if bad is not None:
            raise NonFiniteState(step, bad)
        metrics = None if val_loss is None else {"val_loss": float(val_loss)}
        with self._failed_writes():
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)), metrics=metrics,
                              force=True, custom_metadata={CHECKSUMS: checksums})

    @contextlib.contextmanager
    def _failed_writes(self):
        """A failed write (this one, or an earlier asynchronous one that orbax reports now) as
        one CheckpointError that names the last good checkpoint."""
        try:
            yield
        except Exception as error:
            good = [s for s in self.steps() if (self.directory / str(s)).is_dir()]
            raise CheckpointError(f"writing a checkpoint in {self.directory} failed ({_reason(error)}); the last good "
                                  f"checkpoint is {'step ' + str(good[-1]) if good else 'none'}: free the space (or "
                                  "fix the file system) and run again to resume from it") from None

    def check_saves(self) -> None:
        """Raise CheckpointError (one line) when an asynchronous save has failed since the last
        call (a full disk, a lost mount): called every step, so the run stops at once with its
        last good checkpoint, instead of learning of it at the next save."""
        with self._failed_writes():
            self.manager.check_for_errors()

    def best_step(self) -> int | None:
        """The step with the lowest validation loss; the latest step when none was evaluated."""
        scored = [(m["val_loss"], s) for s in self.steps() if (m := self._metrics(s)) and "val_loss" in m]
        if scored:
            return min(scored)[1]
        return self.manager.latest_step()

    def _metrics(self, step: int) -> dict | None:
        try:
            return self.manager.metrics(step)
        except Exception:  # unreadable metrics cost the step its validation loss, not its place
            return None

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, int]:
        """Restore onto `abstract_state` (ShapeDtypeStructs carrying the target shardings, so a
        checkpoint written on N devices restores on M). Without `step`, the newest intact one:
        a damaged checkpoint is skipped with a warning. Raises CheckpointError if none is usable."""
        candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
        return self._first_intact(candidates, abstract_state, partial=False, explicit=step is not None)

    def restore_params(self, abstract_params: Any, step: int | None = None) -> tuple[Any, int]:
        """Only the params of a checkpoint (for sampling and evaluation), onto the shardings
        of `abstract_params`; by default from the best step, falling back (with a warning) to
        the newest intact one when it is damaged."""
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract_params = jax.tree.map(
            lambda x: x if getattr(x, "sharding", None) else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
            abstract_params,
        )
        if step is None:
            best = self.best_step()
            candidates = [] if best is None else [best, *(s for s in sorted(self.steps(), reverse=True) if s != best)]
        else:
            candidates = [step]
        if not candidates:
            raise CheckpointError(f"no checkpoint in {self.directory}: train first, or check the run directory")
        restored, found = self._first_intact(candidates, {"params": abstract_params}, partial=True,
                                             explicit=step is not None)
        return restored["params"], found

    def _first_intact(self, candidates: list[int], abstract: Any, partial: bool, explicit: bool):
        if not candidates:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        if explicit:
            self._check_step_exists(candidates[0])
        for candidate in candidates:
            try:
                return self._restore_checked(candidate, abstract, partial), candidate
            except DamagedCheckpoint as error:  # anything else is not the checkpoint's fault: it propagates
                message = f"checkpoint at step {candidate} in {self.directory} is unreadable or damaged ({error})"
                if explicit:
                    raise CheckpointError(message) from error
                log.warning("%s; trying an older one", message)
                if not self.read_only:  # kept aside, so that this step can be written again
                    _move_aside(self.directory / str(candidate), self.directory)
                    self.manager.reload()
        if self.read_only:
            raise CheckpointError(f"every checkpoint in {self.directory} is damaged (steps {candidates})")
        raise CheckpointError(f"every checkpoint in {self.directory} is damaged (steps {candidates}; moved to "
                              f"{self.directory.parent / 'damaged_checkpoints'}): run the same command again to start "
                              "from scratch")

    def check_params(self, abstract_params: Any) -> None:
        """MismatchedCheckpoint when the newest checkpoint's params have other names or shapes
        than `abstract_params`; nothing is read but metadata (nothing, without a checkpoint,
        or when the metadata is unreadable: a restore then finds the step damaged)."""
        steps = self.steps()
        if not steps:
            return
        try:
            self._check_shapes(steps[-1], {"params": abstract_params}, partial=True)
        except DamagedCheckpoint:
            log.debug("the metadata of checkpoint step %s is unreadable", steps[-1])

    def _check_step_exists(self, step: int) -> None:
        """CheckpointError naming the steps there are, when `step` is not one of them."""
        steps = self.steps()
        if step not in steps:
            there = f"the steps there are {', '.join(map(str, steps))}" if steps else "there is none: train first"
            raise CheckpointError(f"no checkpoint at step {step} in {self.directory}: {there}")

    def _check_shapes(self, step: int, abstract: Any, partial: bool) -> None:
        """MismatchedCheckpoint, before anything is read, when the state asked for has other
        tensors or other shapes than `step` holds (a partial restore asks for some of them).
        Metadata that cannot be read is left to the restore, which finds the step damaged."""
        with _reading():
            saved = _shapes(self.manager.item_metadata(step)["state"])
        if not saved:
            raise DamagedCheckpoint(f"the metadata of {self.directory / str(step) / 'state'} lists no tensors")
        asked = _shapes(abstract)
        differ = {path: f"saved {saved[path]} against asked {shape}" for path, shape in asked.items()
                  if path in saved and saved[path] != shape}
        differ |= {path: "asked but not saved" for path in asked if path not in saved}
        if not partial:
            differ |= {path: "saved but not asked" for path in saved if path not in asked}
        differ = [f"{'/'.join(path)} {how}" for path, how in sorted(differ.items(), key=_params_first)]
        if differ:
            shown = "; ".join(differ[:3]) + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")
            raise MismatchedCheckpoint(step, self.directory, shown)

    def _restore_checked(self, step: int, abstract: Any, partial: bool) -> Any:
        """The state (or its params) of `step`, checked against the checksums it was saved with
        (checkpoints without them, from before they were recorded, are only checked to be finite)."""
        if not (self.directory / str(step) / "state").is_dir():
            raise DamagedCheckpoint(f"{self.directory / str(step) / 'state'} is missing")
        self._check_shapes(step, abstract, partial)
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        with _reading():
            restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                abstract, restore_args=restore_args, partial_restore=partial)))["state"]
            recorded = (self.manager.metadata(step).custom_metadata or {}).get(CHECKSUMS, {})
        checksums = tree_checksums(restored)
        bad = first_non_finite(checksums) or _mismatch(recorded, checksums)
        if bad is not None:
            raise DamagedCheckpoint(f"{bad} does not match the checksum it was saved with")
        return restored

    def close(self) -> None:
        try:
            with self._failed_writes():
                self.manager.wait_until_finished()
        finally:
            self.manager.close()


def _move_aside(path: Path, checkpoints_dir: Path, name: str | None = None) -> Path:
    """Move a damaged step directory (or part of one) to run_dir/damaged_checkpoints: kept
    for inspection, out of orbax's way."""
    target = checkpoints_dir.parent / "damaged_checkpoints" / (name or path.name)
    target.parent.mkdir(exist_ok=True)
    if target.exists():
        target = target.with_name(f"{target.name}-{len(list(target.parent.iterdir()))}")
    path.rename(target)
    return target


def _repair_steps(directory: Path) -> None:
    """Judge each step on its own before orbax lists them: a step whose own metadata does not
    parse is moved aside whole; a step whose metrics do not parse loses only its metrics (its
    validation loss), never its parameters."""
    for step_dir in sorted(p for p in directory.iterdir() if p.is_dir() and p.name.isdigit()):
        metrics = step_dir / "metrics"
        if (metrics / "metrics").is_file() and not _parses(metrics / "metrics", dict):
            target = _move_aside(metrics, directory, name=f"metrics-of-step-{step_dir.name}")
            log.warning("the metrics of checkpoint step %s are unreadable; moved them to %s (the step is kept, "
                        "without its validation loss)", step_dir.name, target)
        metadata = [step_dir / "_CHECKPOINT_METADATA", *step_dir.glob("*/_METADATA")]
        damaged = next((p for p in metadata if p.is_file() and not _parses(p, dict)), None)
        if damaged is not None:
            target = _move_aside(step_dir, directory)
            log.warning("checkpoint at step %s is unreadable (%s does not parse); moved it to %s", step_dir.name,
                        damaged.relative_to(step_dir), target)


def _shapes(tree) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Each leaf's shape by its path of plain names (a dict's key, a field's name, a sequence's
    index): a state and orbax's metadata of it give the same paths."""
    return {tuple(str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))) for key in path):
            tuple(getattr(leaf, "shape", ())) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _params_first(item: tuple[tuple[str, ...], str]) -> tuple:
    """The parameters' paths before the optimizer state's, which repeats their shapes."""
    path = item[0]
    return path[:1] != ("params",), path


# What the storage layer (tensorstore, through orbax) says of files that are missing, cut short or
# corrupt: a status code before its message. Others (RESOURCE_EXHAUSTED: out of memory;
# UNIMPLEMENTED, CANCELLED, …) are not the files' fault.
_DAMAGE_STATUS = ("DATA_LOSS", "NOT_FOUND", "OUT_OF_RANGE", "FAILED_PRECONDITION", "INVALID_ARGUMENT",
                  "PERMISSION_DENIED")


def _is_damage(error: BaseException | None) -> bool:
    """Whether an error raised while reading a step is the step's damage: missing or unreadable
    files, or a decode error, said by it or by an error it was raised from (orbax wraps the
    storage layer's: 'Encountered error while reading array index …')."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (OSError, UnicodeDecodeError, json.JSONDecodeError)):
            return True
        if isinstance(error, ValueError) and str(error).split(":", 1)[0].strip() in _DAMAGE_STATUS:
            return True
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def _reading():
    """Reading a step: its damage raised as DamagedCheckpoint, anything else as it is."""
    try:
        yield
    except DamagedCheckpoint:
        raise
    except Exception as error:
        if _is_damage(error):
            raise DamagedCheckpoint(one_line(error, with_type=True)) from error
        raise


@contextlib.contextmanager
def _quiet_read_only_notice():
    """orbax logs 'Given directory is read only' whenever it opens checkpoints only to read
    them (sampling, evaluation): a notice of the mode asked for, which reads as a fault of the
    directory. Dropped while the manager opens; every other record passes."""
    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")

    logger = logging.getLogger("absl")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _parses(path: Path, kind: type) -> bool:
    try:
        return isinstance(json.loads(path.read_text(encoding="utf-8")), kind)
    except (ValueError, UnicodeDecodeError, OSError):
        return False


def _reason(error: BaseException) -> str:
    """Why a write failed, briefly: a full disk said as such, else the library's first line."""
    text = str(error)
    if "No space left on device" in text or "os_error_code='28'" in text:
        return "no space left on the device"
    return one_line(error, with_type=True)
