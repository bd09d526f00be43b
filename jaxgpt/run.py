"""A training run: its directory, the resume policy and the loop.

    python train.py  →  run.train(config):
        open_run      the run directory, resume or not, the data, the model config, the mesh
        init or restore the train state (a checkpoint, a GPT-2 checkpoint, or fresh)
        for each step: train, log, evaluate, save          (stops cleanly on SIGINT/SIGTERM)
        finish        the last checkpoint stands; say how to resume if stopped
    write_sample      train.py's last act: the best model continues sample.prompt (sample.txt)

A run directory holds everything about one run: config.json (the resolved config),
tokenizer.json, checkpoints/, metrics.jsonl, and what the CLIs add (loss.png, sample.txt).
It alone is enough to resume (train.py with the same --config.run_dir) or to sample
(`load_run`).
"""

from __future__ import annotations

import dataclasses
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
from ml_collections import ConfigDict

from jaxgpt import data, metrics, rundir, sharding
from jaxgpt.checkpoint import Checkpoints, NonFiniteState, first_non_finite, tree_checksums
from jaxgpt.config import ComputeConfig, GPTConfig, SampleConfig, TrainConfig
from jaxgpt.errors import ConfigError, TrainingError, one_line
from jaxgpt.evaluation import evaluate_examples, evaluate_tokens
from jaxgpt.lock import LockHeld, RunLock
from jaxgpt.model import GPT, flops_per_token, layers_as, param_layout
from jaxgpt.model_config import check_kernel
from jaxgpt.optim import learning_rate_schedule, make_optimizer
from jaxgpt.preflight import check_memory, check_sections, check_unknown, start_from
from jaxgpt.rundir import CONFIG_FILE, TOKENIZER_FILE, load_run
from jaxgpt.sampling import SamplingOptions, generate
from jaxgpt.text import encode_prompt
from jaxgpt.training import TrainState, abstract_state, batch_fields, initialise_into, make_train_step, seeded

__all__ = ["CONFIG_FILE", "TOKENIZER_FILE", "TrainingError", "load_run", "model_config", "open_run", "train",
           "write_sample"]


# --- the run directory ----------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """What a run works with once its directory is open."""

    config: ConfigDict  # as resolved: the model section holds the model's config
    train: TrainConfig
    model: GPTConfig  # what the model computes
    compute: ComputeConfig  # how it runs here
    directory: Path
    corpus: data.Corpus
    checkpoints: Checkpoints
    resuming: bool
    mesh: Mesh
    lock: RunLock
    layouts: dict[str, data.Layout] | None = None  # a records corpus's rows of examples, per split
    saved_compute: ComputeConfig | None = None  # how the checkpoints were written, when resuming

    @property
    def gpt(self) -> GPT:
        """The model as it runs here."""
        return GPT(self.model, self.compute)

    @property
    def lead(self) -> bool:
        """The process that writes the run directory's files."""
        return jax.process_index() == 0


def model_config(config, vocab_size: int) -> GPTConfig:
    """The GPTConfig of a run: the config's model section, the vocabulary from the tokenizer."""
    values = dict(config.model)
    if not values["vocab_size"]:
        values["vocab_size"] = vocab_size
    elif values["vocab_size"] < vocab_size:
        raise ValueError(f"model.vocab_size={values['vocab_size']} is smaller than the tokenizer's {vocab_size}")
    return GPTConfig.from_dict(values)


def compute_config(config, platform: str | None = None) -> ComputeConfig:
    """The compute section on `platform` (default: here), its kernel checked for training: model_config.check_kernel."""
    compute, platform = ComputeConfig.from_dict(dict(config.compute)), platform or jax.default_backend()
    cfg, packed = model_config(config, vocab_size=1), config.data.format == "records"
    try:
        compute = compute.replace(kernel=check_kernel(compute.kernel, cfg, platform, dtype=compute.dtype,
                                                      training=True, packed=packed))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if compute.weights != "float":
        raise ConfigError(f"compute.weights={compute.weights!r} is weight-only quantisation for inference (sample.py "
                          "--weights int8): train with compute.weights='float'")
    return compute


def open_run(config, explicit: Collection[str] = ()) -> Run:
    """Open (or start) the run directory of `config` and lock it for this process: decide
    whether to resume, check every section of the config (jaxgpt.preflight), prepare the data,
    fix the model config, write config.json and tokenizer.json, and make the mesh. `explicit`:
    the dotted keys the user set (train.py's overrides), which init_from may not replace.
    `train` releases the lock when the run ends."""
    train_cfg = TrainConfig.from_mapping(config.train)
    directory = make_run_dir(config.run_dir)
    lock = RunLock(directory)
    if jax.process_index() == 0:  # one lock per run, however many processes share it
        note = _acquire(lock)
        if note:
            print(f"jaxgpt: {note}", file=sys.stderr)
    try:
        return _open_locked(config, train_cfg, directory, lock, explicit)
    except BaseException:
        lock.release()
        raise


def make_run_dir(run_dir: str) -> Path:
    """The run directory, made if needed; a one-line ConfigError when it cannot be."""
    directory = Path(run_dir)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"run_dir={run_dir!r} is a file, not a directory: choose another --config.run_dir")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot make run_dir={run_dir!r} ({error.strerror}): choose another --config.run_dir") \
            from None
    return directory


def check_config(config, explicit: Collection[str] = ()) -> tuple[Any, Any, Mesh, ComputeConfig]:
    """(the config as the run uses it, init_from's tokenizer or None, the mesh, the compute
    settings) once every check that needs no data has passed: init_from fixes the architecture
    and the tokenizer (refusing a key of `explicit` it replaces), then every section is checked
    before the data is read; the model's vocabulary comes with the tokenizer."""
    config, tokenizer = start_from(config, explicit)
    mesh = check_sections(config, TrainConfig.from_mapping(config.train))
    model_config(config, vocab_size=1)
    return config, tokenizer, mesh, compute_config(config)


def _acquire(lock: RunLock) -> str | None:
    try:
        return lock.acquire()
    except LockHeld as error:
        raise TrainingError(str(error)) from None
    except OSError as error:  # a read-only file system, a directory without write permission
        raise ConfigError(f"cannot write in run_dir {lock.path.parent} ({error.strerror}): choose a writable "
                          "--config.run_dir") from None


def _open_locked(config, train_cfg: TrainConfig, directory: Path, lock: RunLock, explicit: Collection[str]) -> Run:
    checkpoints = Checkpoints(directory, keep=train_cfg.keep_checkpoints, async_save=train_cfg.async_checkpoints)
    resuming = rundir.resume_policy(config.resume, checkpoints)
    config, tokenizer, mesh, compute = check_config(config, explicit)
    corpus = data.prepare(config.data, tokenizer=tokenizer)
    if len(corpus.val) < 2:
        raise ValueError(f"the validation split of {config.data.source!r} is empty: raise data.val_fraction "
                         "or give data.val_source")
    check_unknown(config, corpus)
    cfg = model_config(config, corpus.tokenizer.vocab_size)
    check_memory(cfg, compute, train_cfg)
    saved_compute = rundir.check_same_run(directory, cfg, compute, corpus.tokenizer, train_cfg) if resuming else None
    resolved = {**config.to_dict(), "model": cfg.to_dict(), "compute": compute.to_dict(),
                "tokenizer_sha256": data.tokenizer_hash(corpus.tokenizer)}
    if jax.process_index() == 0:
        if max(checkpoints.steps(), default=0) <= train_cfg.steps:  # a run past its steps keeps its own record
            rundir.write_config(directory, resolved, max(checkpoints.steps()) if resuming else None)
        if not (directory / TOKENIZER_FILE).exists():  # pinned from the first step on: never rewritten
            corpus.tokenizer.save(directory / TOKENIZER_FILE)
    layouts = None
    if corpus.records:  # every example must fit (or be cut to) a row before the first step
        records = config.data.records
        layouts = {split: data.plan(corpus.examples[split], cfg.block_size, records.packing, records.truncate)
                   for split in ("train", "val")}
    return Run(ConfigDict(resolved), train_cfg, cfg, compute, directory, corpus, checkpoints, resuming, mesh, lock,
               layouts, saved_compute)


# --- the state ------------------------------------------------------------------------------


def init_or_restore(run: Run, optimizer, key, abstract: TrainState | None = None) -> tuple[TrainState, TrainState, int]:
    """(state, its shardings, the step to start at): restored from the newest intact
    checkpoint when resuming, else fresh (with a GPT-2 checkpoint's params for init_from).
    `key` is a PRNG key or an integer seed; `abstract` the state's abstract_state, when the
    caller has it already."""
    abstract = abstract_state(run.gpt, optimizer, run.mesh) if abstract is None else abstract
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    if run.resuming:  # restored onto the shapes and shardings alone: nothing is initialised first
        state, step = _restore(run, abstract)
        return state, shardings, step
    state = initialise_into(run.gpt, optimizer, key, shardings)
    if run.config.init_from:  # AdamW's fresh state is zeros whatever the params: only they change
        state = state.replace(params=rundir.init_params_from(run.config.init_from, run.model, run.compute,
                                                             shardings.params))
    return state, shardings, 0


def _restore(run: Run, abstract: TrainState) -> tuple[TrainState, int]:
    """The newest intact checkpoint, onto `abstract`'s shapes, dtypes and shardings; one written in the other
    layer layout (compute.scan_layers) is restored in its own, then converted (model.layers_as) and placed."""
    saved = run.saved_compute
    if saved is None or saved.scan_layers == run.compute.scan_layers:
        restored, step = run.checkpoints.restore(abstract.to_dict())
        return TrainState.from_dict(restored), step
    written = GPT(run.model, run.compute.replace(scan_layers=saved.scan_layers))
    written_state = abstract_state(written, make_optimizer(run.train, param_layout(written)), run.mesh)
    restored, step = run.checkpoints.restore(written_state.to_dict())
    shardings = jax.tree.map(lambda a: a.sharding, abstract.to_dict())
    return TrainState.from_dict(jax.device_put(layers_as(restored, run.compute.scan_layers), shardings)), step


def lower_train_step(gpt: GPT, train_cfg: TrainConfig, mesh: Mesh, optimizer, abstract: TrainState, packed: bool):
    """train_step(state, batch, seed) lowered for the state `abstract` (shapes, dtypes and
    shardings) and batches of train_cfg's rows (packed: records' rows, else text windows),
    ready to compile; train.py and jaxgpt.compile both build it here. The step's dropout key,
    fold_in(key(seed), state.step), is made inside it: the loop runs one program per step."""
    batches = sharding.batch_sharding(mesh)
    fields = batch_fields(train_cfg.grad_accum * train_cfg.batch_size, gpt.cfg.block_size, packed)
    batch = tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=batches) for shape, dtype in fields)
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    step = make_train_step(gpt, optimizer, learning_rate_schedule(train_cfg), train_cfg.grad_accum, shardings.params)
    jitted = jax.jit(seeded(step), in_shardings=(shardings, (batches,) * len(batch), None),
                     out_shardings=(shardings, None), donate_argnums=0,
                     compiler_options=sharding.compiler_options(mesh))
    with jax.set_mesh(mesh):  # the activations keep their rows on their devices (axes.rows_split)
        return jitted.lower(abstract, batch, train_cfg.seed)


def _batch_maker(run: Run):
    """make_batch(step, rows): the rows of step's training batch, on the host."""
    rows = run.train.grad_accum * run.train.batch_size

    def make_batch(step: int, part: slice):
        if run.corpus.records:
            return data.packed_batch(run.corpus.examples["train"], run.layouts["train"], seed=run.train.seed,
                                     step=step, batch_size=rows, rows=part, loss_on=run.config.data.records.loss_on)
        return data.train_batch(run.corpus.train, seed=run.train.seed, step=step, batch_size=rows,
                                block_size=run.model.block_size, rows=part)

    return make_batch


def train_batches(run: Run, start_step: int) -> data.DeviceBatches:
    """The training batches from start_step on, made ahead and laid out on the mesh."""
    return data.DeviceBatches(_batch_maker(run), start_step=start_step, end_step=run.train.steps,
                              batch_size=run.train.grad_accum * run.train.batch_size,
                              sharding=sharding.batch_sharding(run.mesh))


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


def train(config, explicit: Collection[str] = ()) -> dict:
    """Run training as the config says (jaxgpt.config.default_config() lists every key);
    returns the final metrics, the step reached and what stopped it early, if anything.
    `explicit`: the dotted keys the user set (open_run). Call sharding.start_jax(config)
    first for one CPU device per core or several hosts.

    SIGINT/SIGTERM at any moment (preparing data, compiling, training) stop the run at the
    next safe point with the last checkpoint written; a second signal stops at once."""
    with StopRequested() as stop:
        run = open_run(config, explicit)
        try:
            with jax.set_mesh(run.mesh):  # every program traced here lays its activations out by the mesh (axes)
                return _train(run, stop)
        finally:
            run.checkpoints.close()
            run.lock.release()


def _state_and_step(run: Run, optimizer) -> tuple[TrainState, int, Any]:
    """(the state, the step to start at, the compiled train step, or None when no step is
    left). XLA compiles the step in a thread while the state is made or restored: a first
    run waits for the longer of the two, not their sum."""
    abstract = abstract_state(run.gpt, optimizer, run.mesh)
    lowered = lower_train_step(run.gpt, run.train, run.mesh, optimizer, abstract, run.corpus.records)
    finished = run.resuming and max(run.checkpoints.steps(), default=0) >= run.train.steps
    with ThreadPoolExecutor(1, thread_name_prefix="jaxgpt-compile") as compiler:
        compiling = None if finished else compiler.submit(lowered.compile)
        state, _, start_step = init_or_restore(run, optimizer, run.train.seed, abstract)
    if start_step >= run.train.steps:
        return state, start_step, None
    return state, start_step, compiling.result() if compiling else lowered.compile()


def _train(run: Run, stop: StopRequested) -> dict:
    """The loop: init or restore, then for each step train, log, evaluate and save.

    A log step's metrics are read once the next step is dispatched, so the devices never
    wait for the host; the steps that evaluate or save read theirs at once (they need that
    step's state, which the next step consumes), and never save before every step's loss so
    far was found finite."""
    tc = run.train
    optimizer = make_optimizer(tc, param_layout(run.gpt))
    state, start_step, train_step = _state_and_step(run, optimizer)
    tokens_per_step = tc.grad_accum * tc.batch_size * run.model.block_size
    meter = metrics.Meter(tokens_per_step, flops_per_token(run.model, run.model.block_size), metrics.peak_flops(
        tc.peak_flops), measured=not tc.peak_flops)
    log = metrics.MetricsLog(run.directory, tc.steps, start_step, enabled=run.lead)
    log.message(_announcement(run, start_step, tokens_per_step, meter.peak))
    for split, layout in (run.layouts or {}).items():
        log.message(f"jaxgpt: records, {layout.summary(split)}")
    step, last_val, interrupted, deferred = start_step, None, stop.signal_name, None  # a signal while starting: no step
    with train_batches(run, start_step if not interrupted else tc.steps) as batches:
        try:
            for _, batch in batches:
                state, step_metrics = train_step(state, batch, tc.seed)
                run.checkpoints.check_saves()
                step += 1
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
    mfu = f"MFU against a peak of {peak / 1e9:.0f} GFLOP/s" if peak else "MFU not reported (set train.peak_flops)"
    return (f"jaxgpt: {cfg.n_layer} layers, d_model {cfg.d_model}, {jax.device_count()} {jax.default_backend()} "
            f"device(s), mesh {dict(run.mesh.shape)}, {tokens_per_step} tokens/step, "
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


def write_sample(config) -> str | None:
    """The sample a finished run ends with (train.py): its best model continuing
    config.sample.prompt, written to sample.txt and returned. A prompt the run's tokenizer
    cannot encode (known only once the data is read) is a warning, and the model starts a
    document instead, as after each <|eos|> of its corpus (no sample, None, for a tokenizer
    without <|eos|>)."""
    params, cfg, tokenizer = load_run(config.run_dir)
    options, prompt = SampleConfig.from_mapping(config.sample), config.sample.prompt
    try:
        ids = encode_prompt(tokenizer, prompt)
    except ValueError as error:
        instead = "the sample starts a new document (after <|eos|>) instead" if tokenizer.eos_id is not None \
            else "no sample"
        warnings.warn(f"sample.prompt cannot be encoded ({one_line(error)}): {instead}", stacklevel=2)
        if tokenizer.eos_id is None:
            return None
        ids, prompt = [tokenizer.eos_id], ""
    drawing = SamplingOptions(options.max_new_tokens, temperature=options.temperature, top_k=options.top_k or None,
                              eos_id=tokenizer.eos_id)
    sample = prompt + tokenizer.decode(generate(params, cfg, [ids], config.train.seed, drawing).new_tokens()[0])
    (Path(config.run_dir) / "sample.txt").write_text(sample)
    return sample
