"""Opening a run, in the order it happens: `open_run` reads as these steps, top to bottom.

    the directory   made and locked for this process; resume or not (config.resume, its checkpoints)
    the config      init_from fixes the model and the tokenizer (preflight.start_from)
    the checks      every section before the data is read, the model's shapes, the compute settings
    the mesh        made by those checks, with the batch sizes it must divide (preflight.check_sections)
    the data        prepared with the tokenizer, which fixes the vocabulary; a tokenizer that does not
                    know the text refused (preflight.check_unknown); the micro-batch per device, where
                    train.rows_per_step leaves it to the memory (micro_batch.resolved); the memory
                    (preflight.check_memory);
                    a resume held to the run the directory holds (rundir.check_same_run)
    the record      config.json (the config as resolved) and tokenizer.json, by the lead process
    the state       init_or_restore: the newest intact checkpoint, init_from's params, or fresh

jaxgpt.train.run calls open_run, then init_or_restore while XLA compiles the train step; sweep.py asks
check_config, the part that needs no data, of every cell before it trains the first. The checks
live in jaxgpt.train.preflight; reading run directories and init_from's sources in jaxgpt.train.rundir.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh
from ml_collections import ConfigDict

from jaxgpt import data
from jaxgpt.blocks import layers_as
from jaxgpt.checkpoint import CHECKPOINT_DIR, Checkpoints
from jaxgpt.config import ComputeConfig, GPTConfig, TrainConfig
from jaxgpt.errors import ConfigError, TrainingError
from jaxgpt.lock import LOCK_FILE, LockHeld, RunLock
from jaxgpt.model import GPT, param_layout
from jaxgpt.optim import make_optimizer, open_train
from jaxgpt.registries import check_kernel, open_compute, open_model
from jaxgpt.train import micro_batch, rundir
from jaxgpt.train.preflight import check_memory, check_sections, check_unknown, start_from
from jaxgpt.train.rundir import TOKENIZER_FILE
from jaxgpt.train.step import TrainState, abstract_state, initialise_into


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
    before: frozenset[str] | None = frozenset()  # the directory's entries before the run (None: it did not exist)
    stepped: bool = False  # a step has run: the directory holds the run, whatever stops it

    @property
    def gpt(self) -> GPT:
        """The model as it runs here."""
        return GPT(self.model, self.compute)

    @property
    def lead(self) -> bool:
        """The process that writes the run directory's files."""
        return jax.process_index() == 0


def open_run(config, explicit: Collection[str] = ()) -> Run:
    """Open (or start) the run directory of `config`, locked for this process, in the order of
    this module's docstring. `explicit`: the dotted keys the user set (train.py's overrides),
    which init_from may not replace. The caller releases the lock when the run ends (run.train);
    a step that fails releases it here."""
    train_cfg = open_train(config.train)
    before = entries(Path(config.run_dir))
    directory = make_run_dir(config.run_dir)  # the directory, locked
    lock = lock_run(directory)
    try:
        checkpoints = Checkpoints(directory, keep=train_cfg.keep_checkpoints, async_save=train_cfg.async_checkpoints)
        resuming = rundir.resume_policy(config.resume, checkpoints)
        config, tokenizer, mesh, compute = check_config(config, explicit)  # init_from, every section, the mesh
        corpus = read_corpus(config, tokenizer)  # the data: its tokenizer fixes the vocabulary
        cfg = model_config(config, corpus.tokenizer.vocab_size)
        config = micro_batch.resolved(config, mesh, cfg, compute)  # the micro-batch per device, where it is chosen
        train_cfg = open_train(config.train)
        check_memory(cfg, compute, train_cfg)
        saved = rundir.check_same_run(directory, cfg, compute, corpus.tokenizer, train_cfg) if resuming else None
        resolved = {**config.to_dict(), "model": cfg.to_dict(), "compute": compute.to_dict(),
                    "tokenizer_sha256": data.tokenizer_hash(corpus.tokenizer)}
        if jax.process_index() == 0:  # the record
            write_record(directory, resolved, corpus.tokenizer, checkpoints, train_cfg, resuming)
        return Run(ConfigDict(resolved), train_cfg, cfg, compute, directory, corpus, checkpoints, resuming, mesh, lock,
                   row_layouts(config, corpus, cfg.block_size), saved_compute=saved, before=before)
    except BaseException:
        lock.release()
        leave_nothing(directory, before)
        raise


# --- the directory --------------------------------------------------------------------------


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


def entries(directory: Path) -> frozenset[str] | None:
    """The names in `directory`, None when it does not exist."""
    return frozenset(p.name for p in directory.iterdir()) if directory.is_dir() else None


def leave_nothing(directory: Path, before: frozenset[str] | None) -> None:
    """After a run refused before its first step, the directory as it was (by the lead process): gone
    when the run made it or found it empty; else without the lock and the empty checkpoints/ the run
    added (a resume's files are never touched)."""
    if jax.process_index() != 0:
        return
    if not before:
        shutil.rmtree(directory, ignore_errors=True)
        return
    for added in {LOCK_FILE, CHECKPOINT_DIR} - before:
        path = directory / added
        with contextlib.suppress(OSError):
            path.rmdir() if path.is_dir() else path.unlink(missing_ok=True)


def lock_run(directory: Path) -> RunLock:
    """The run directory's lock, taken by the lead process (one lock per run, however many
    processes share it); a note when it takes over a dead process's lock."""
    lock = RunLock(directory)
    if jax.process_index() != 0:
        return lock
    try:
        note = lock.acquire()
    except LockHeld as error:
        raise TrainingError(str(error)) from None
    except OSError as error:  # a read-only file system, a directory without write permission
        raise ConfigError(f"cannot write in run_dir {lock.path.parent} ({error.strerror}): choose a writable "
                          "--config.run_dir") from None
    if note:
        print(f"jaxgpt: {note}", file=sys.stderr)
    return lock


# --- the config, its checks and the mesh ----------------------------------------------------


def check_config(config, explicit: Collection[str] = ()) -> tuple[Any, Any, Mesh, ComputeConfig]:
    """(the config as the run uses it, init_from's tokenizer or None, the mesh, the compute
    settings) once every check that needs no data has passed: init_from fixes the architecture
    and the tokenizer (refusing a key of `explicit` it replaces), then every section is checked
    before the data is read; the model's vocabulary comes with the tokenizer."""
    config, tokenizer = start_from(config, explicit)
    mesh = check_sections(config, open_train(config.train))
    model_config(config, vocab_size=1)
    return config, tokenizer, mesh, compute_config(config)


def model_config(config, vocab_size: int) -> GPTConfig:
    """The GPTConfig of a run: the config's model section, the vocabulary from the tokenizer."""
    values = dict(config.model)
    if not values["vocab_size"]:
        values["vocab_size"] = vocab_size
    elif values["vocab_size"] < vocab_size:
        raise ValueError(f"model.vocab_size={values['vocab_size']} is smaller than the tokenizer's {vocab_size}")
    return open_model(values)


def compute_config(config, platform: str | None = None,
                   capability: tuple[int, int] | None = None) -> ComputeConfig:
    """The compute section on `platform` (default: here), its kernel checked for training (registries.check_kernel)
    and its FP8 matmuls against the devices (check_fp8): `capability` is the compute capability of the GPUs a
    program compiles for (default: with no platform named, the devices here's)."""
    here = platform is None  # the devices here: theirs is the capability (asking JAX starts its backends)
    compute, platform = open_compute(config.compute), platform or jax.default_backend()
    cfg, packed = model_config(config, vocab_size=1), config.data.format == "records"
    try:
        compute = compute.replace(kernel=check_kernel(compute.kernel, cfg, platform, dtype=compute.dtype,
                                                      training=True, packed=packed))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if compute.weights != "float":
        raise ConfigError(f"compute.weights={compute.weights!r} is weight-only quantisation for inference (sample.py "
                          "--weights int8): train with compute.weights='float'")
    if capability is None and here and platform == "gpu":
        capability = gpu_capability(jax.devices()[0])
    check_fp8(compute, platform, capability)
    return compute


FP8_CAPABILITY = (8, 9)  # the oldest NVIDIA GPUs with FP8 matrix units: Ada (8.9), then Hopper (9.0) and later
FP8_GPUS = "H100, H200, L4, L40S, RTX 40…"


def gpu_capability(device) -> tuple[int, int] | None:
    """A CUDA device's compute capability (major, minor); None where the device does not say."""
    major, _, minor = str(getattr(device, "compute_capability", "")).partition(".")
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None


def check_fp8(compute: ComputeConfig, platform: str, capability: tuple[int, int] | None) -> None:
    """A one-line ConfigError when compute.fp8 names matmuls and the devices have no FP8 GEMMs: a CPU, a
    TPU, or an NVIDIA GPU of compute capability below FP8_CAPABILITY. A GPU whose capability is not
    known (None: named without its devices) is not refused here; the devices a program compiles for are."""
    if not compute.fp8_matmuls:
        return
    needs = (f"compute.fp8={compute.fp8!r} needs FP8 matrix units (an NVIDIA GPU of compute capability ≥ "
             f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}: {FP8_GPUS})")
    if platform != "gpu":
        raise ConfigError(f"{needs}; on {platform} drop compute.fp8 (--config.compute.fp8='')")
    if capability is not None and tuple(capability) < FP8_CAPABILITY:
        raise ConfigError(f"{needs}; these GPUs are of compute capability {capability[0]}.{capability[1]}: "
                          "drop compute.fp8 (--config.compute.fp8='')")


# --- the data and the record ----------------------------------------------------------------


def read_corpus(config, tokenizer) -> data.Corpus:
    """The corpus prepared (init_from's tokenizer, or the one data.tokenizer names), with a
    validation split to evaluate on and a tokenizer that knows its text."""
    corpus = data.prepare(config.data, tokenizer=tokenizer)
    if len(corpus.val) < 2:
        raise ValueError(f"the validation split of {config.data.source!r} is empty: raise data.val_fraction "
                         "or give data.val_source")
    check_unknown(config, corpus)
    return corpus


def write_record(directory: Path, resolved: dict, tokenizer, checkpoints: Checkpoints, train_cfg: TrainConfig,
                 resuming: bool) -> None:
    """config.json, unless the run is past its steps (it keeps its own record), and
    tokenizer.json, pinned from the first step on: never rewritten."""
    if max(checkpoints.steps(), default=0) <= train_cfg.steps:
        rundir.write_config(directory, resolved, max(checkpoints.steps()) if resuming else None)
    if not (directory / TOKENIZER_FILE).exists():
        tokenizer.save(directory / TOKENIZER_FILE)


def row_layouts(config, corpus: data.Corpus, block_size: int) -> dict[str, data.Layout] | None:
    """A records corpus's rows of examples, per split: every example must fit (or be cut to) a
    row before the first step. None for text."""
    if not corpus.records:
        return None
    records = config.data.records
    return {split: data.plan(corpus.examples[split], block_size, records.packing, records.truncate)
            for split in ("train", "val")}


# --- the state ------------------------------------------------------------------------------


def init_or_restore(run: Run, optimizer, key, abstract: TrainState | None = None, init=None
                    ) -> tuple[TrainState, TrainState, int]:
    """(state, its shardings, the step to start at): restored from the newest intact
    checkpoint when resuming, else fresh (with a GPT-2 checkpoint's params for init_from).
    `key` is a PRNG key or an integer seed; `abstract` the state's abstract_state, when the
    caller has it already; `init` the init program on its way (programs.Pending), if any."""
    abstract = abstract_state(run.gpt, optimizer, run.mesh) if abstract is None else abstract
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    if run.resuming:  # restored onto the shapes and shardings alone: nothing is initialised first
        state, step = _restore(run, abstract)
        return state, shardings, step
    state = initialise_into(run.gpt, optimizer, key, shardings, init.result() if init is not None else None)
    if run.config.init_from:  # AdamW's fresh state is zeros whatever the params: only they change
        state = state.replace(params=rundir.init_params_from(run.config.init_from, run.model, run.compute,
                                                             shardings.params))
    return state, shardings, 0


def _restore(run: Run, abstract: TrainState) -> tuple[TrainState, int]:
    """The newest intact checkpoint, onto `abstract`'s shapes, dtypes and shardings; one written in the other
    layer layout (compute.scan_layers) is restored in its own, then converted (blocks.layers_as) and placed."""
    saved = run.saved_compute
    if saved is None or saved.scan_layers == run.compute.scan_layers:
        restored, step = run.checkpoints.restore(abstract.to_dict())
        return TrainState.from_dict(restored), step
    written = GPT(run.model, run.compute.replace(scan_layers=saved.scan_layers))
    written_state = abstract_state(written, make_optimizer(run.train, param_layout(written)), run.mesh)
    restored, step = run.checkpoints.restore(written_state.to_dict())
    shardings = jax.tree.map(lambda a: a.sharding, abstract.to_dict())
    return TrainState.from_dict(jax.device_put(layers_as(restored, run.compute.scan_layers), shardings)), step
