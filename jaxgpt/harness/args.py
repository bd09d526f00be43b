"""model_args of the harness's model "jaxgpt", checked: by the model when it is built, and by
`python -m jaxgpt.harness` on its command line before the harness imports and indexes its tasks
(so a bad run_dir, key or batch_size is a one-line error at once, not after the tasks are built).

Nothing here imports JAX or the harness's tasks: the command line's check costs milliseconds.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

DEFAULT_BATCH_SIZE = 16
HARNESS_ARGS = ("max_batch_size", "device")  # what the harness passes every model: JAX chooses its own device
KNOWN = ("run_dir", "step", "batch_size", "stride", "seed")


class ModelArgsError(ValueError):
    """model_args that name no usable run or setting; the message says what to give."""


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """What a command line asks of jaxgpt, checked as far as can be without loading the run."""

    run_dir: str
    step: int | None
    stride: int | None
    batch_size: int


def check_args(run_dir, step, stride, seed, others: dict) -> None:
    """ModelArgsError for model_args jaxgpt cannot use (the run itself is checked when it loads)."""
    unknown = sorted(set(others) - set(HARNESS_ARGS))
    if unknown:
        raise ModelArgsError(f"model_args {', '.join(unknown)}: jaxgpt takes {', '.join(KNOWN)} "
                             "(run_dir=RUN is required)")
    if run_dir is None or run_dir == "":
        raise ModelArgsError("model_args needs run_dir=RUN, the directory a jaxgpt training run wrote")
    for name, value, least in (("step", step, 0), ("stride", stride, 1), ("seed", seed, 0)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise ModelArgsError(f"model_args {name}={value!r}: must be an integer ≥ {least}")


def parse_batch_size(value) -> int:
    """An integer ≥ 1; None and the harness's 'auto' (which jaxgpt does not search) give DEFAULT_BATCH_SIZE."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return DEFAULT_BATCH_SIZE
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 1 or isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ModelArgsError(f"batch_size={value!r}: must be a positive integer (or auto: {DEFAULT_BATCH_SIZE})")
    return size


def check_run_dir(run_dir) -> None:
    """ModelArgsError unless run_dir is a directory (its files are checked when the run loads)."""
    if not Path(run_dir).is_dir():
        raise ModelArgsError(f"model_args run_dir={run_dir}: run directory {run_dir} does not exist: pass the "
                             "directory a training run wrote")


def checked(model_args: dict, harness_batch_size=None) -> ModelArgs:
    """The model_args a command line gives "jaxgpt" (as the harness parsed them), checked as
    the model will check them; the batch size is model_args', else the harness's --batch_size
    (as the model gets it: `JaxGPT.create_from_arg_obj`)."""
    values = dict(model_args)
    run_dir, step, stride = values.pop("run_dir", None), values.pop("step", None), values.pop("stride", None)
    batch_size, seed = values.pop("batch_size", None), values.pop("seed", None)
    check_args(run_dir, step, stride, seed, values)
    size = parse_batch_size(harness_batch_size if batch_size is None else batch_size)
    check_run_dir(run_dir)
    return ModelArgs(str(run_dir), step, stride, size)


def harness_default_batch_size():
    """The batch size the harness passes every model when its command line gives none."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    return EvaluatorConfig.__dataclass_fields__["batch_size"].default


def from_command_line(argv: list[str]) -> ModelArgs | None:
    """The checked model_args of a harness command line that evaluates --model jaxgpt, or None
    for any other command (another model, a subcommand without a model, model and model_args
    given in a --config file: the model checks those when it is built). The harness's own
    parser reads the line, so its syntax and errors are the harness's."""
    from lm_eval._cli import HarnessCLI  # the parser alone: no tasks are imported or indexed

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        args = HarnessCLI().parse_args()
    finally:
        sys.argv = saved
    if getattr(args, "model", None) != "jaxgpt" or getattr(args, "config", None):
        return None
    model_args = args.model_args or {}
    if "batch_size" not in model_args and getattr(args, "batch_size", None) is None:
        checked(model_args)  # its errors first, then what the harness will pass
        return checked(model_args, harness_default_batch_size())
    return checked(model_args, getattr(args, "batch_size", None))
