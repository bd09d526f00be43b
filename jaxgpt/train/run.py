"""A training run: the loop.

    python train.py  →  run.train(config):
        open_run        the directory, the config, its checks, the mesh, the data (jaxgpt.train.opening)
        init_or_restore the train state (a checkpoint, init_from's params, or fresh), while XLA
                        compiles the train step
        for each step: train, log, evaluate, save          (stops cleanly on SIGINT/SIGTERM)
        finish          the last checkpoint stands; say how to resume if stopped
    write_sample        train.py's last act: the best model continues sample.prompt (sample.txt)

A run directory holds everything about one run: config.json (the resolved config),
tokenizer.json, checkpoints/, metrics.jsonl, and what the CLIs add (loss.png, sample.txt).
It alone is enough to resume (train.py with the same --config.run_dir) or to sample
(`load_run`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import sys
import time
import warnings
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from jaxgpt import batch_schedule, data, metrics, programs, sharding
from jaxgpt.checkpoint import NonFiniteState, first_non_finite, tree_checksums
from jaxgpt.config import SampleConfig, TrainConfig
from jaxgpt.decode.sampling import SamplingOptions, generate
from jaxgpt.decode.text import encode_prompt
from jaxgpt.errors import TrainingError, one_line
from jaxgpt.model import GPT, flops_per_token, param_layout
from jaxgpt.optim import learning_rate_schedule, make_optimizer
from jaxgpt.score.completions import RUN_TEMPLATE, record_prompt, templates_named
from jaxgpt.train import evaluation
from jaxgpt.train.evaluation import evaluate_examples, evaluate_tokens
from jaxgpt.train.opening import Run, compute_config, init_or_restore, leave_nothing, model_config, open_run
from jaxgpt.train.rundir import CONFIG_FILE, TOKENIZER_FILE, load_run
from jaxgpt.train.step import (
    TrainState,
    abstract_state,
    ahead_weights,
    batch_fields,
    lower_init,
    make_train_step,
    seeded,
)

# open_run, init_or_restore, Run, compute_config and model_config are jaxgpt.train.opening's, named here too
__all__ = ["CONFIG_FILE", "TOKENIZER_FILE", "Run", "TrainingError", "compute_config", "init_or_restore", "load_run",
           "model_config", "open_run", "train", "write_sample"]


# --- the step and its batches --------------------------------------------------------------


def lower_train_step(gpt: GPT, train_cfg: TrainConfig, mesh: Mesh, optimizer, abstract: TrainState, packed: bool,
                     grad_accum: int | None = None, name: str | None = None, length: int | None = None,
                     window: int | None = None):
    """train_step(state, batch, seed) lowered for the state `abstract` (shapes, dtypes and
    shardings) and batches of train_cfg's rows (packed: records' rows, else text windows),
    ready to compile; train.py and jaxgpt.compile both build it here. The step's dropout key,
    fold_in(key(seed), state.step), is made inside it: the loop runs one program per step.
    `grad_accum`: micro-batches of train.batch_size rows a step (None: train.grad_accum), `length`
    the tokens of a row (None: model.block_size), `window` how far back attention reaches (None: the
    whole row): a scheduled step's (batch_schedule.Shape). `name`: the program's (programs.renamed)."""
    accum = train_cfg.grad_accum if grad_accum is None else grad_accum
    batches = sharding.batch_sharding(mesh)
    fields = batch_fields(accum * train_cfg.batch_size, length or gpt.cfg.block_size, packed)
    batch = tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=batches) for shape, dtype in fields)
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    step = make_train_step(gpt, optimizer, learning_rate_schedule(train_cfg), accum, shardings.params,
                           ahead_weights(train_cfg), window=window)
    jitted = jax.jit(programs.renamed(seeded(step), name), in_shardings=(shardings, (batches,) * len(batch), None),
                     out_shardings=(shardings, None), donate_argnums=0,
                     compiler_options=sharding.compiler_options(mesh))
    with jax.set_mesh(mesh):  # the activations keep their rows on their devices (axes.rows_split)
        return jitted.lower(abstract, batch, train_cfg.seed)


def shape_at(run: Run):
    """step ↦ the shape of its batch (batch_schedule.Shape): the schedules', then the run's own."""
    return lambda step: batch_schedule.shape_at(run.train, run.model.block_size, step)


def _batch_maker(run: Run):
    """make_batch(step, rows): the rows of step's training batch, on the host: rows(step) windows
    of length(step) + 1 tokens, or packed records' rows (no length schedule: preflight)."""
    tc, shape_of = run.train, shape_at(run)

    def make_batch(step: int, part: slice):
        shape = shape_of(step)
        if run.corpus.records:
            before = batch_schedule.rows_before(tc.batch_schedule, tc.step_rows, step)
            return data.packed_batch(run.corpus.examples["train"], run.layouts["train"], seed=tc.seed, step=step,
                                     batch_size=shape.rows, rows=part, loss_on=run.config.data.records.loss_on,
                                     drawn_before=before)
        return data.train_batch(run.corpus.train, seed=tc.seed, step=step, batch_size=shape.rows,
                                block_size=shape.length, rows=part)

    return make_batch


def train_batches(run: Run, start_step: int) -> data.DeviceBatches:
    """The training batches from start_step on, made ahead and laid out on the mesh."""
    shape_of = shape_at(run)
    return data.DeviceBatches(_batch_maker(run), start_step=start_step, end_step=run.train.steps,
                              batch_size=lambda step: shape_of(step).rows, sharding=sharding.batch_sharding(run.mesh))


def evaluate(run: Run, params) -> dict:
    """Validation loss, perplexity and bits per byte (train.eval_max_batches batches at most);
    of a records corpus, over the completions."""
    if run.corpus.records:
        return evaluate_examples(run.gpt, params, run.corpus.examples["val"], run.layouts["val"],
                                 run.corpus.bytes_per_token["val"], batch_size=run.train.eval_batch_size,
                                 max_batches=run.train.eval_max_batches,
                                 batch_sharding=sharding.batch_sharding(run.mesh))
    return evaluate_tokens(run.gpt, params, run.corpus.val, run.corpus.bytes_per_token["val"],
                           batch_size=run.train.eval_batch_size, stride=run.config.data.eval_stride,
                           max_batches=run.train.eval_max_batches, batch_sharding=sharding.batch_sharding(run.mesh))


# --- the loop -------------------------------------------------------------------------------


class StopRequested:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each step, so the run saves a
    checkpoint and exits cleanly instead of dying mid-step. A second signal stops at once."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal_name is not None:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        print(f"jaxgpt: {self.signal_name}: stopping at the next safe point (again to stop at once)", file=sys.stderr)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def train(config, explicit: Collection[str] = (), keep_programs: bool = False) -> dict:
    """Run training as the config says (jaxgpt.config.default_config() lists every key);
    returns the final metrics, the step reached and what stopped it early, if anything.
    `explicit`: the dotted keys the user set (open_run). `keep_programs`: keep the compiled
    programs (init, train and eval step) and the params' declarations with a
    fingerprint of what made them, and read back, untraced, what a run with the same fingerprint
    kept (jaxgpt.programs); train.py asks for it, a notebook, which can change a function in
    memory where no file shows it, should not. Call
    sharding.start_jax(config) first for one CPU device per core or several hosts.

    SIGINT/SIGTERM at any moment (preparing data, compiling, training) stop the run at the
    next safe point with the last checkpoint written; a second signal stops at once."""
    with StopRequested() as stop, programs.keeping(keep_programs):  # the params' declarations kept too
        run = open_run(config, explicit)
        failed = True
        try:
            with jax.set_mesh(run.mesh):  # every program traced here lays its activations out by the mesh (axes)
                result = _train(run, stop)
            failed = False
            return result
        finally:
            run.checkpoints.close()
            run.lock.release()
            if failed and not run.stepped:  # a run refused before its first step leaves nothing behind
                leave_nothing(run.directory, run.before)


def _state_and_steps(run: Run, optimizer) -> tuple[TrainState, int, dict[batch_schedule.Shape, Any]]:
    """(the state, the step to start at, the compiled train step of each batch's shape: one, or
    one per distinct shape of the schedules from the start on; none when no step is left).
    XLA compiles the steps and the init in threads (or they are read back, programs.keeping)
    while the state is made or restored: a first run waits for the longest, not their sum."""
    tc = run.train
    abstract = abstract_state(run.gpt, optimizer, run.mesh)
    saved = max(run.checkpoints.steps(), default=0) if run.resuming else 0
    shapes = batch_schedule.shapes(tc, run.model.block_size, saved)
    with ThreadPoolExecutor(2, thread_name_prefix="jaxgpt-compile") as compiler:
        compiling = {s: _train_step(run, optimizer, abstract, s, compiler) for s in shapes} if saved < tc.steps else {}
        init = None if run.resuming or run.config.init_from else _init_program(run, optimizer, abstract, compiler)
        if saved < tc.steps:  # the run's evaluations
            evaluation.prepare(run.gpt, abstract.params, tc.eval_batch_size, run.corpus.records,
                               sharding.batch_sharding(run.mesh), compiler)
        state, _, start_step = init_or_restore(run, optimizer, tc.seed, abstract, init=init)
    if start_step >= tc.steps:
        return state, start_step, {}
    needed = batch_schedule.shapes(tc, run.model.block_size, start_step)
    return state, start_step, {s: (compiling[s] if s in compiling else _train_step(run, optimizer, abstract, s, None)
                                   ).result() for s in needed}


# The train settings no compiled program reads (the seed is an argument of the train step and the
# init; a train step's description names its own shape instead of the schedules): left out of their
# descriptions, so that runs which differ only there (a sweep's seeds) share their kept programs.
OUTSIDE_PROGRAMS = frozenset({"seed", "eval_every", "eval_batch_size", "eval_max_batches", "log_every", "ckpt_every",
                              "keep_checkpoints", "async_checkpoints", "peak_flops", *batch_schedule.SCHEDULES})


def _in_programs(tc: TrainConfig) -> dict:
    return {field.name: getattr(tc, field.name) for field in dataclasses.fields(tc)
            if field.name not in OUTSIDE_PROGRAMS}


def _init_program(run: Run, optimizer, abstract: TrainState, compiler: ThreadPoolExecutor) -> programs.Pending:
    """The program that makes a fresh state in `abstract`'s shardings (step.lower_init), as
    programs.compiled gives it."""
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    description = repr(("init", run.gpt.cfg, run.gpt.compute, _in_programs(run.train),
                        [d.id for d in run.mesh.devices.flat], programs.abstract(abstract)))
    return programs.compiled(description, "init", lambda name: lower_init(run.gpt, optimizer, shardings, name),
                             compiler)


def _train_step(run: Run, optimizer, abstract: TrainState, shape: batch_schedule.Shape,
                compiler: ThreadPoolExecutor | None) -> programs.Pending:
    """The train step for batches of `shape`: kept, or lowered here and compiled on `compiler`'s
    thread (None: now), as programs.compiled does."""
    tc, accum = run.train, shape.rows // run.train.batch_size
    description = repr(("train_step", run.gpt.cfg, run.gpt.compute, _in_programs(tc), run.corpus.records, accum,
                        shape.length, shape.window, sharding.compiler_options(run.mesh), dict(run.mesh.shape),
                        [d.id for d in run.mesh.devices.flat], programs.abstract(abstract)))
    return programs.compiled(description, "train_step", lambda name: lower_train_step(
        run.gpt, tc, run.mesh, optimizer, abstract, run.corpus.records, accum, name=name, length=shape.length,
        window=shape.window), compiler)


def _train(run: Run, stop: StopRequested) -> dict:
    """The loop: init or restore, then for each step train, log, evaluate and save.

    A log step's metrics are read once the next step is dispatched, so the devices never
    wait for the host; the steps that evaluate or save read theirs at once (they need that
    step's state, which the next step consumes), and never save before every step's loss so
    far was found finite."""
    tc = run.train
    optimizer = make_optimizer(tc, param_layout(run.gpt))
    state, start_step, train_steps = _state_and_steps(run, optimizer)
    tokens_per_step = tc.step_rows * run.model.block_size
    tokens_before = lambda step: batch_schedule.tokens_before(tc, run.model.block_size, step)  # noqa: E731
    shape_of = shape_at(run)
    meter = metrics.Meter(tokens_per_step, flops_per_token(run.model, run.model.block_size), metrics.peak_flops(
        tc.peak_flops), measured=not tc.peak_flops, tokens_before=tokens_before)
    log = metrics.MetricsLog(run.directory, tc.steps, start_step, enabled=run.lead)
    log.message(_announcement(run, start_step, tokens_per_step, meter.peak))
    if run.corpus.meta.get("source_description"):  # what the run's figures depend on (the stdlib: which Python's)
        log.message(f"jaxgpt: data, {run.corpus.meta['source_description']}")
    for split, layout in (run.layouts or {}).items():
        log.message(f"jaxgpt: records, {layout.summary(split)}")
    step, last_val, interrupted, deferred = start_step, None, stop.signal_name, None  # a signal while starting: no step
    with train_batches(run, start_step if not interrupted else tc.steps) as batches:
        try:
            for _, batch in batches:
                state, step_metrics = train_steps[shape_of(step)](state, batch, tc.seed)
                run.checkpoints.check_saves()
                step, run.stepped = step + 1, True
                meter.add(step, step_metrics)
                if deferred:  # the last log step's record, read while this step runs
                    log.write(_fetched_record(run, meter, deferred, state), progress=True)
                    deferred = None
                stopping = stop.signal_name  # read once: a signal arriving later is seen next step
                do_eval = step == tc.steps or step % tc.eval_every == 0
                if do_eval or step % tc.ckpt_every == 0 or stopping:
                    last_val = _evaluate_and_save(run, log, meter, step, state, do_eval) or last_val
                elif step % tc.log_every == 0:
                    deferred = step
                if stopping:
                    interrupted = stopping
                    break
        except KeyboardInterrupt:  # a second signal: stop at once, the last checkpoint stands
            interrupted = "a second signal"
        finally:
            log.close()
    if interrupted and run.lead:
        run.checkpoints.manager.wait_until_finished()
        print(_stopped_line(run, interrupted, step), file=sys.stderr)
    return {"step": step, "train_loss": meter.last["loss"], "interrupted": interrupted,
            "run_dir": str(run.directory), **(last_val or {})}


def _fetched_record(run: Run, meter: metrics.Meter, step: int, state: TrainState) -> dict:
    """The record of `step`, its metrics and those before it fetched and found finite."""
    _check_finite(meter.fetch(through=step), run, state)
    return meter.record(step)


def _evaluate_and_save(run: Run, log: metrics.MetricsLog, meter: metrics.Meter, step: int, state: TrainState,
                       do_eval: bool) -> dict | None:
    """At a step that saves (and perhaps evaluates): its record, with the seconds evaluation
    and saving held the loop (eval_seconds, checkpoint_seconds), which count in no interval's
    tokens/s. Returns the validation metrics when it evaluated."""
    record = _fetched_record(run, meter, step, state)
    val = None
    if do_eval:
        start = time.perf_counter()
        val = evaluate(run, state.params)
        record.update(val, eval_seconds=time.perf_counter() - start)
    start = time.perf_counter()
    try:
        _save(run, step, state, val["val_loss"] if val else None)
        record["checkpoint_seconds"] = time.perf_counter() - start
        if do_eval:
            log.message(_evaluation_line(step, record))
    finally:  # written even when the save refuses a non-finite state
        log.write(record, progress=True)
    meter.restart_clock()
    return val


def _check_finite(fetched: list[tuple[int, dict]], run: Run, state: TrainState) -> None:
    """Stop on the first non-finite loss or gradient norm, naming the step, the first tensor of
    the state that went bad (if any), and the last good checkpoint."""
    for step, values in fetched:
        if math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"]):
            continue
        bad = first_non_finite(tree_checksums(state.to_dict()))
        if bad is not None:
            cause = (f"the first tensor of the train state to hold NaN or ±inf is {bad}: the updates diverged "
                     "(lower train.lr, raise train.warmup_steps, keep train.clip and train.eps > 0)")
        else:
            cause = (f"the parameters and optimizer state are still finite, so the batch of step {step} or the "
                     "model's arithmetic made it (check the data; float16 overflows where bfloat16 does not)")
        raise TrainingError(f"non-finite loss ({values['loss']}) or gradient norm ({values['grad_norm']}) at step "
                            f"{step}: stopping; {cause}. {_last_good(run)}")


def _save(run: Run, step: int, state: TrainState, val_loss: float | None) -> None:
    """Save a checkpoint; a state that holds NaN or ±inf is never saved and stops the run."""
    try:
        run.checkpoints.save(step, state.to_dict(), val_loss=val_loss)
    except NonFiniteState as error:
        raise TrainingError(f"{error}: the updates diverged (lower train.lr, raise train.warmup_steps, keep "
                            f"train.clip and train.eps > 0). {_last_good(run)}") from None


def _last_good(run: Run) -> str:
    run.checkpoints.manager.wait_until_finished()
    good = run.checkpoints.steps()
    return (f"The last good checkpoint is {'step ' + str(good[-1]) if good else 'none'} in {run.directory}; change "
            "the setting at fault and run again to resume from it")


def _announcement(run: Run, start_step: int, tokens_per_step: int, peak: float | None) -> str:
    cfg = run.model
    mfu = metrics.peak_line(peak, run.train.peak_flops)
    scheduled = "; ".join(f"train.{key}'s {what}s {list(getattr(run.train, key))}"
                          for key, (what, _) in batch_schedule.SCHEDULES.items() if getattr(run.train, key))
    scheduled = f" (before that, {scheduled})" if scheduled else ""
    return (f"jaxgpt: {cfg.n_layer} layers, d_model {cfg.d_model}, {jax.device_count()} {jax.default_backend()} "
            f"device(s), mesh {dict(run.mesh.shape)}, {tokens_per_step} tokens/step{scheduled}, "
            f"{_start(run, start_step)}; {mfu}")


def _start(run: Run, start_step: int) -> str:
    if start_step > run.train.steps:
        return (f"at step {start_step}, past train.steps={run.train.steps}: nothing to train, and config.json keeps "
                "the run's own settings (raise train.steps to go on; a shorter run needs another --config.run_dir)")
    if start_step:
        return f"resuming at step {start_step}"
    return f"starting from {run.config.init_from}" if run.config.init_from else "from scratch"


def _evaluation_line(step: int, record: dict[str, Any]) -> str:
    return (f"step {step}: train loss {record['train_loss']:.4f}, val loss {record['val_loss']:.4f}, "
            f"val ppl {record['val_ppl']:.2f}, val bpb {record['val_bpb']:.3f}; {record['tokens_per_sec']:,.0f} "
            f"tokens/s, evaluation {record['eval_seconds']:.2f} s, checkpoint {record['checkpoint_seconds']:.2f} s")


def _stopped_line(run: Run, interrupted: str, step: int) -> str:
    saved = run.checkpoints.steps()
    last = f"the last checkpoint is step {saved[-1]}" if saved else "there is no checkpoint yet"
    return f"stopped by {interrupted} at step {step}; {last} in {run.directory}. Run the same command again to resume."


# --- the end --------------------------------------------------------------------------------


def sample_prompt(config, tokenizer) -> tuple[str, list[int]]:
    """(the text the final sample starts with, its ids): sample.prompt; in a records run with
    sample.record, that record's prompt as the run's own templates made its examples' prompts."""
    if _from_record(config):
        return record_prompt(templates_named(RUN_TEMPLATE, config.data.to_dict()), json.loads(config.sample.record),
                             tokenizer)
    return config.sample.prompt, encode_prompt(tokenizer, config.sample.prompt)


def _from_record(config) -> bool:
    return config.data.format == "records" and config.sample.record is not None


def write_sample(config) -> str | None:
    """The sample a finished run ends with (train.py): its best model continuing its prompt
    (sample_prompt), written to sample.txt and returned. A prompt the run's tokenizer cannot
    encode or its templates cannot make (known only once the data is read) is a warning, and the
    model starts a document instead, as after each <|eos|> of its corpus (no sample, None, for a
    tokenizer without <|eos|>)."""
    params, cfg, tokenizer = load_run(config.run_dir)
    options = SampleConfig.from_mapping(config.sample)
    try:
        prompt, ids = sample_prompt(config, tokenizer)
    except ValueError as error:
        instead = "the sample starts a new document (after <|eos|>) instead" if tokenizer.eos_id is not None \
            else "no sample"
        what = "sample.record's prompt cannot be made" if _from_record(config) else "sample.prompt cannot be encoded"
        warnings.warn(f"{what} ({one_line(error)}): {instead}", stacklevel=2)
        if tokenizer.eos_id is None:
            return None
        ids, prompt = [tokenizer.eos_id], ""
    drawing = SamplingOptions(options.max_new_tokens, temperature=options.temperature, top_k=options.top_k or None,
                              eos_id=tokenizer.eos_id)
    sample = prompt + tokenizer.decode(generate(params, cfg, [ids], config.train.seed, drawing).new_tokens()[0])
    (Path(config.run_dir) / "sample.txt").write_text(sample)
    return sample
