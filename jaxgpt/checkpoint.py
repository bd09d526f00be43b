"""Checkpoints of the train state with orbax: save (async), keep the last K and the best by
validation loss, restore onto a target that carries the current shardings, fall back from
a damaged checkpoint to the newest intact one."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jaxgpt.errors import one_line

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"


def _val_loss(metrics) -> float:
    return metrics["val_loss"]


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was expected."""


class Checkpoints:
    """run_dir/checkpoints/<step>/state: {'step', 'params', 'opt_state'}, with the validation
    loss of the step as orbax metrics when it was evaluated."""

    def __init__(self, run_dir, keep: int = 3, async_save: bool = True, read_only: bool = False):
        self.directory = Path(run_dir).absolute() / CHECKPOINT_DIR
        self.read_only = read_only
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
            create=not read_only,
            read_only=read_only,
            save_interval_steps=0 if read_only else 1,
        )
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state",))
        except Exception as error:  # a step whose metadata cannot be read stops orbax from listing any
            if read_only or not _set_aside_unreadable_steps(self.directory, error):
                reason = one_line(error, with_type=True)
                raise CheckpointError(f"cannot read the checkpoints in {self.directory} ({reason})") from error
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state",))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: dict, val_loss: float | None = None) -> None:
        metrics = None if val_loss is None else {"val_loss": float(val_loss)}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)), metrics=metrics,
                          force=True)

    def best_step(self) -> int | None:
        """The step with the lowest validation loss; the latest step when none was evaluated."""
        scored = [(m["val_loss"], s) for s in self.steps() if (m := self.manager.metrics(s)) and "val_loss" in m]
        if scored:
            return min(scored)[1]
        return self.manager.latest_step()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, int]:
        """Restore onto `abstract_state` (ShapeDtypeStructs carrying the target shardings, so a
        checkpoint written on N devices restores on M). Without `step`, the newest intact one:
        a damaged checkpoint is skipped with a warning. Raises CheckpointError if none is usable."""
        candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
        if not candidates:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        for candidate in candidates:
            try:
                restored = self.manager.restore(
                    candidate, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                        abstract_state, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state)))
                )
                return restored["state"], candidate
            except Exception as error:  # orbax raises many kinds for a damaged directory
                reason = one_line(error, with_type=True)
                message = f"checkpoint at step {candidate} in {self.directory} is unreadable ({reason})"
                if step is not None:
                    raise CheckpointError(message) from error
                log.warning("%s; trying an older one", message)
                if not self.read_only:  # kept aside, so that this step can be written again
                    _move_aside(self.directory / str(candidate))
                    self.manager.reload()
        raise CheckpointError(f"every checkpoint in {self.directory} is damaged (steps {candidates})")

    def restore_params(self, abstract_params: Any, step: int | None = None) -> tuple[Any, int]:
        """Only the params of a checkpoint (for sampling and evaluation), onto the shardings
        of `abstract_params`; by default from the best step."""
        step = self.best_step() if step is None else step
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract_params = jax.tree.map(
            lambda x: x if getattr(x, "sharding", None) else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
            abstract_params,
        )
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}: train first, or check the run directory")
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item={"params": abstract_params}, partial_restore=True,
                    restore_args=ocp.checkpoint_utils.construct_restore_args({"params": abstract_params}))))
        except Exception as error:
            raise CheckpointError(
                f"checkpoint at step {step} in {self.directory} is unreadable ({one_line(error, with_type=True)})"
            ) from error
        return restored["state"]["params"], step

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _move_aside(step_dir: Path) -> Path:
    """Move a damaged step directory to ../damaged_checkpoints: kept for inspection, out of
    orbax's way."""
    target = step_dir.parent.parent / "damaged_checkpoints" / step_dir.name
    target.parent.mkdir(exist_ok=True)
    if target.exists():
        target = target.with_name(f"{step_dir.name}-{len(list(target.parent.iterdir()))}")
    step_dir.rename(target)
    return target


def _set_aside_unreadable_steps(directory: Path, error: Exception) -> bool:
    """Move aside the step directories whose JSON metadata does not parse, so the intact
    ones can be listed and restored."""
    moved = False
    for step_dir in sorted(p for p in directory.iterdir() if p.is_dir() and p.name.isdigit()):
        metadata = [p for p in step_dir.rglob("*")
                    if p.is_file() and ("METADATA" in p.name or p.parent.name == "metrics")]
        for meta in metadata:
            try:
                json.loads(meta.read_text() or "null")
            except (ValueError, UnicodeDecodeError):
                target = _move_aside(step_dir)
                log.warning("checkpoint at step %s is unreadable (%s); moved it to %s", step_dir.name,
                            one_line(error, with_type=True),
                            target)
                moved = True
                break
    return moved
