"""The run of the model "jaxgpt", loaded and its scoring programs compiled on a thread of its own.

`python -m jaxgpt.harness` starts this as soon as its model_args are checked, so that the run
loads and `jaxgpt.score.likelihood.prepare` compiles the programs (two at most, whatever the lengths)
while the harness imports itself and indexes and builds its tasks; the model, when the harness
builds it, takes the loaded run, and its first requests wait for the compiles. A run that
cannot be loaded (a bad step, a broken checkpoint, a stride past the block) interrupts the
command at once, before the tasks are built, unless the model already waits for it.

A model built from Python (lm_eval.simple_evaluate) loads its run itself, then compiles on
such a thread while the harness builds its tasks.
"""

from __future__ import annotations

import _thread
import dataclasses
import json
import logging
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxgpt.harness.args import ModelArgs, ModelArgsError

if TYPE_CHECKING:  # the preload imports no JAX until it runs
    from jaxgpt.model_config import GPTConfig

log = logging.getLogger("jaxgpt.harness")


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A run as the model uses it."""

    params: Any
    config: GPTConfig
    tokenizer: Any
    model: Any
    stride: int | None


def load(run_dir, step: int | None, stride: int | None) -> Loaded:
    """The run's params (the checkpoint at `step`, else the best), config, tokenizer, model and
    rolling stride; ModelArgsError for a run, step or stride that cannot be used."""
    from jaxgpt.checkpoint import CheckpointError
    from jaxgpt.model import GPT
    from jaxgpt.train import rundir

    try:
        params, config, tokenizer = rundir.load_run(run_dir, step=step)
    except CheckpointError as err:
        raise ModelArgsError(f"model_args step={step}: {err}") from None
    except ValueError as err:
        raise ModelArgsError(f"model_args run_dir={run_dir}: {err}") from None
    return Loaded(params, config, tokenizer, GPT(config), run_stride(run_dir, stride, config.block_size))


def run_stride(run_dir, stride: int | None, block_size: int) -> int | None:
    """The stride of loglikelihood_rolling's windows: model_args', else the run's data.eval_stride."""
    if stride is None:
        saved = json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
        stride = saved.get("data", {}).get("eval_stride")
    if stride is not None and stride > block_size:
        raise ModelArgsError(f"model_args stride={stride}: must be at most the model's block_size={block_size}")
    return stride


class Background:
    """Loading a run (unless it is given) and then compiling its scoring programs for
    batch_size rows, on a thread of their own. `loaded()` waits for the run; `wait()` for the
    compiles too."""

    def __init__(self, batch_size: int, *, args: ModelArgs | None = None, loaded: Loaded | None = None,
                 interrupt_main: bool = False):
        import jaxgpt.model
        import jaxgpt.score.likelihood
        import jaxgpt.train.rundir  # noqa: F401  imported here: two threads importing at once can deadlock on a cycle

        self.args, self._loaded, self.error, self.claimed = args, loaded, None, False
        self._ready, self._lock, self._waited = threading.Event(), threading.Lock(), False
        self._heard = threading.Event()  # set when the main thread waits for this one
        # not a daemon: the process waits for its compiles before it exits (JAX's backends are torn down then)
        self._thread = threading.Thread(target=self._run, args=(batch_size, interrupt_main), name="jaxgpt-preload")
        self._thread.start()

    def _run(self, batch_size: int, interrupt_main: bool) -> None:
        try:
            if self._loaded is None:
                self._loaded = load(self.args.run_dir, self.args.step, self.args.stride)
        except BaseException as err:  # noqa: BLE001  raised again where the model waits for the run
            self.error = err
            self._ready.set()
            if interrupt_main:  # nobody waits yet: the main thread learns of it now, whatever it is doing
                self._interrupt_until_heard()
            return
        self._ready.set()
        try:
            from jaxgpt.score import likelihood

            likelihood.prepare(self._loaded.model, self._loaded.params, batch_size)
        except Exception as err:  # noqa: BLE001  the programs then compile when first used, and fail there
            log.warning("jaxgpt: compiling ahead failed (%s); the scoring programs compile when first used", err)

    def _interrupt_until_heard(self) -> None:
        """KeyboardInterrupt in the main thread, sent again each second until the main thread waits for
        this one: an interrupt that lands while the main thread runs a callback (JAX's after a garbage
        collection) cannot be raised there, and Python drops it (quietly: _quiet_dropped_interrupts)."""
        while True:
            with self._lock:
                if self._waited:
                    return
                _thread.interrupt_main()
            if self._heard.wait(INTERRUPT_AGAIN_S):
                return

    def matches(self, run_dir, step, stride) -> bool:
        args = self.args
        return (args is not None and (args.step, args.stride) == (step, stride)
                and Path(args.run_dir).resolve() == Path(run_dir).resolve())

    def loaded(self) -> Loaded:
        with self._lock:
            self._waited = True
            self._heard.set()
        self._ready.wait()
        if self.error is not None:
            raise self.error
        return self._loaded

    def wait(self) -> None:
        self._thread.join()

    def settle(self) -> None:
        """Wait for the thread, which from now on interrupts nobody."""
        with self._lock:
            self._waited = True
            self._heard.set()
        self.wait()


_started: list[Background] = []
INTERRUPT_AGAIN_S = 1.0


def _quiet_dropped_interrupts(hook):
    """sys.unraisablehook that passes over a KeyboardInterrupt a failed preload sent (it sends it again)."""
    def unraisable(event):
        if not (issubclass(event.exc_type, KeyboardInterrupt) and any(b.error is not None for b in _started)):
            hook(event)

    unraisable.quiets_preload = True
    return unraisable


def start(args: ModelArgs, compilation_cache: str | None = None) -> Background:
    """Load the run args name and compile its programs while the caller goes on, with JAX's
    persistent compilation cache in `compilation_cache` (jaxgpt.sharding.compilation_cache_dir;
    None leaves JAX's settings alone). A run that fails to load interrupts the main thread
    (KeyboardInterrupt; the Background's error says why) unless the model waits for it."""
    if compilation_cache is not None:
        from jaxgpt.sharding import use_compilation_cache

        use_compilation_cache(compilation_cache)
    if not getattr(sys.unraisablehook, "quiets_preload", False):
        sys.unraisablehook = _quiet_dropped_interrupts(sys.unraisablehook)
    background = Background(args.batch_size, args=args, interrupt_main=True)
    _started.append(background)
    return background


def take(run_dir, step, stride) -> Background | None:
    """The started preload of this run, step and stride, handed over once; None if there is none."""
    for background in _started:
        if not background.claimed and background.matches(run_dir, step, stride):
            background.claimed = True
            return background
    return None


def finish(background: Background) -> None:
    """Forget a started preload, once its thread is done."""
    if background in _started:
        _started.remove(background)
    background.settle()
