"""The one schema of a run: every key a run reads, its default and its check.

    GPTConfig     the model's identity: the function it computes (config.model; jaxgpt.model_config)
    ComputeConfig how it runs here: kernel, remat, dtypes, scan_layers (config.compute)
    DataConfig    where the text comes from and how it becomes tokens (config.data;
                  jaxgpt.data_config): the keys every source shares, and a section per source
                  kind (data.tfds, data.hf, ...)
    TrainConfig   the optimizer, schedule, batches, logging and checkpoints (config.train)
    SampleConfig  the sample train.py writes at the end of a run (config.sample)
    default_config()   the whole run as an ml_collections ConfigDict: the sections above, plus
                  mesh, distributed, init_from, run_dir and resume

Defaults live here and nowhere else: configs/*.py start from default_config(), the command
line overrides any key (`--config.KEY=None` sets a key whose default is None back to None:
`none_keys`), and each section is checked by its dataclass when a run starts. The schema names
no implementation: the names a key may take (model.positions, compute.kernel, train.optimizer, …)
are the registries' where their entries are defined, checked where a config is opened
(jaxgpt.registries).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import os
import traceback
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ml_collections import ConfigDict, config_dict

from jaxgpt import batch_schedule
from jaxgpt.data_config import (
    FLAT_DATA_KEYS,
    DataConfig,
    FilesConfig,
    HfConfig,
    OcrConfig,
    RecordsConfig,
    TfdsConfig,
    checked_section,
)
from jaxgpt.errors import ConfigError, is_int, is_number, one_line
from jaxgpt.model_config import COMPUTE_KEYS, ComputeConfig, GPTConfig

__all__ = ["FLAT_DATA_KEYS", "GROUP_LRS", "MOVED_KEYS", "RESUME", "ComputeConfig",
           "DataConfig", "FilesConfig", "GPTConfig", "HfConfig", "OcrConfig", "RecordsConfig", "SampleConfig",
           "TfdsConfig", "TrainConfig", "default_config", "load_config", "none_keys", "unknown_key"]

RESUME = ("auto", "never", "must")
GROUP_LRS = ("embed_lr", "head_lr", "scalar_lr")  # each parameter group's own peak learning rate
# Muon's switches and their values when off: any other value needs train.optimizer='muon'
MUON_SWITCHES = {"muon_coeffs": "quintic", "normuon": False}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The train section: the optimizer and its schedule, batches, evaluation, logging and
    checkpoints (jaxgpt.optim and jaxgpt.train.run read it).

    optimizer: 'adamw' (every parameter), or 'muon' (the blocks' weight matrices through Muon,
    the rest through AdamW). schedule: 'cosine' (linear warmup, cosine decay to min_lr) or 'wsd'
    (linear warmup, constant, a linear cooldown to min_lr over the last cooldown_fraction of
    the schedule's steps). embed_lr, head_lr, scalar_lr: the peak learning rates of the
    embedding tables, the untied unembedding and the biases and gains (None: lr);
    each group follows lr's schedule scaled to its own peak. muon_*: Muon's momentum β, its
    Newton–Schulz steps, and Nesterov momentum."""

    seed: int = 0
    steps: int = 2000
    batch_size: int = 12  # rows per micro-batch, over all devices; 0: chosen from the memory (rows_per_step)
    grad_accum: int = 1  # micro-batches per optimizer step; 0: rows_per_step / batch_size
    # the rows of one optimizer step (over all devices and micro-batches); 0: batch_size × grad_accum. With
    # batch_size or grad_accum 0, the micro-batch per device is chosen to fit it (jaxgpt.train.micro_batch)
    rows_per_step: int = 0
    optimizer: str = "adamw"  # adamw | muon
    lr: float = 1e-3  # the peak learning rate (under muon: of the blocks' weight matrices)
    min_lr: float = 1e-4
    embed_lr: float | None = None  # the embedding tables' peak; None: lr
    head_lr: float | None = None  # the untied unembedding's peak; None: lr
    scalar_lr: float | None = None  # biases' and norm gains' peak; None: lr
    schedule: str = "cosine"  # cosine | wsd (warmup, stable, linear cooldown)
    warmup_steps: int = 100
    decay_steps: int | None = None  # None: the run's steps
    cooldown_fraction: float = 0.2  # wsd: the last fraction of the schedule's steps that decays to min_lr
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_embeddings: bool = True
    clip: float = 1.0  # global-norm clipping threshold; 0: none
    muon_momentum: float = 0.95  # Muon's momentum β
    muon_ns_steps: int = 5  # Newton–Schulz iterations per update
    muon_nesterov: bool = True  # Nesterov momentum for Muon
    eval_every: int = 250
    eval_batch_size: int = 32
    eval_max_batches: int | None = None  # None: the whole validation split
    log_every: int = 10
    ckpt_every: int = 250
    keep_checkpoints: int = 3
    # True: training goes on while a checkpoint is written (a kill -9 during the write loses up
    # to 2·ckpt_every steps); False: each save finishes first (at most ckpt_every)
    async_checkpoints: bool = True
    peak_flops: float | None = None  # per device (a CPU: per host); None: measured on a CPU
    # the most memory the parameters, gradients and AdamW state may take; None: the devices'
    # memory (on a CPU, 90% of the machine's RAM)
    memory_limit_gib: float | None = None
    # Muon's Newton–Schulz coefficients: 'quintic' (one (a, b, c) every step), 'polar_express' (a row per
    # step, 5 steps), or rows 'a,b,c; a,b,c; …', one per step (jaxgpt.optim.ns_coefficients)
    muon_coeffs: str = "quintic"
    normuon: bool = False  # NorMuon: Muon's update normalised per output neuron (optim.muon.scale_by_neuron_norm)
    normuon_beta2: float = 0.95  # NorMuon's second-moment decay
    cautious_weight_decay: bool = False  # the decay only where the update and the parameter agree in sign
    # ((until_step, rows), …): the rows of the steps before each until_step; after the last, the run's rows
    # (train.rows_per_step, or batch_size × grad_accum). Each a multiple of train.batch_size (jaxgpt.batch_schedule)
    batch_schedule: tuple = ()
    # ((until_step, length), …): rows of `length` tokens (the context trained on) before each until_step; after the
    # last, model.block_size. Needs a text corpus (jaxgpt.batch_schedule)
    length_schedule: tuple = ()
    # ((until_step, window), …): every layer's attention reaches `window` positions back (itself and window − 1
    # before) before each until_step; after the last, the whole context. Evaluation and sampling always see it whole
    window_schedule: tuple = ()
    # multi-token prediction (jaxgpt.loss.multi_token): each position's logits also predict the tokens 2…K ahead,
    # K = mtp_tokens (1: the next token only), token k weighted mtp_weight^(k−1), fading linearly to 0 by
    # mtp_fraction of the schedule's steps (train.decay_steps, else train.steps)
    mtp_tokens: int = 1
    mtp_weight: float = 0.5
    mtp_fraction: float = 0.5
    # the token embedding and the untied unembedding one table (W_U = Eᵀ, the embed group's) for the steps before
    # round(untie_at · the schedule's steps: decay_steps, else steps), then two (jaxgpt.optim.tying); None: two all
    # along. Needs model.tie_embeddings=False
    untie_at: float | None = None

    def __post_init__(self):
        positive = ("steps", "eval_every", "eval_batch_size", "log_every", "ckpt_every",
                    "keep_checkpoints", "muon_ns_steps")
        for key in positive:
            _check_train(self, is_int(getattr(self, key)) and getattr(self, key) > 0, key, "a positive integer")
        for key in ("seed", "warmup_steps"):
            _check_train(self, is_int(getattr(self, key)) and getattr(self, key) >= 0, key, "an integer ≥ 0")
        for key in ("batch_size", "grad_accum", "rows_per_step"):
            _check_train(self, is_int(getattr(self, key)) and getattr(self, key) >= 0, key,
                         "a positive integer, or 0 (chosen to fit train.rows_per_step)" if key != "rows_per_step"
                         else "an integer ≥ 0 (0: train.batch_size × train.grad_accum)")
        for key in ("decay_steps", "eval_max_batches"):
            value = getattr(self, key)
            _check_train(self, value is None or (is_int(value) and value > 0), key, "None or a positive integer")
        for key in ("lr", "min_lr", "weight_decay", "clip", "eps"):
            _check_train(self, is_number(getattr(self, key)) and getattr(self, key) >= 0, key, "a number ≥ 0")
        for key in ("b1", "b2", "muon_momentum", "normuon_beta2"):
            value = getattr(self, key)
            _check_train(self, is_number(value) and 0 <= value < 1, key, "a number in [0, 1)")
        for key in ("decay_embeddings", "async_checkpoints", "muon_nesterov", "normuon", "cautious_weight_decay"):
            _check_train(self, isinstance(getattr(self, key), bool), key, "True or False")
        for key in ("peak_flops", "memory_limit_gib"):
            value = getattr(self, key)
            _check_train(self, value is None or (is_number(value) and value > 0), key, "None or a positive number")
        _check_train(self, is_int(self.mtp_tokens) and self.mtp_tokens > 0, "mtp_tokens",
                     "a positive integer, the tokens each position predicts (1: the next one only)")
        _check_train(self, is_number(self.mtp_weight) and self.mtp_weight >= 0, "mtp_weight", "a number ≥ 0")
        _check_train(self, is_number(self.mtp_fraction) and 0 < self.mtp_fraction <= 1, "mtp_fraction",
                     "a number in (0, 1]: the share of the schedule's steps over which the extra targets fade out")
        self._check_batch()
        self._check_optimizer()
        self._check_muon()
        self._check_schedule()
        self._check_untie()

    def _check_batch(self) -> None:
        """A 0 (chosen) batch_size or grad_accum needs rows_per_step; the one set must divide it."""
        rows, batch, accum = self.rows_per_step, self.batch_size, self.grad_accum
        if not rows and not (batch and accum):
            zero = "batch_size" if not batch else "grad_accum"
            raise ConfigError(f"train.{zero}=0 (chosen to fit) needs train.rows_per_step, the rows of one optimizer "
                              f"step: set it (e.g. --config.train.rows_per_step=512) or give train.{zero}")
        if rows and bool(batch) != bool(accum):
            key, value = ("batch_size", batch) if batch else ("grad_accum", accum)
            if rows % value:
                raise ConfigError(f"train.rows_per_step={rows} is not a multiple of train.{key}={value}: choose a "
                                  f"divisor of {rows}, or set both train.batch_size and train.grad_accum")
        self._check_batch_schedule()

    def _check_batch_schedule(self) -> None:
        """Each schedule a tuple of (until_step, value) pairs; each rows of batch_schedule a multiple of
        the micro-batch, where it is known (their fit to the model: preflight.check_schedules)."""
        for key in batch_schedule.SCHEDULES:
            object.__setattr__(self, key, batch_schedule.checked(getattr(self, key), key))
        micro = self.batch_size or (self.rows_per_step // self.grad_accum if self.grad_accum else None)
        batch_schedule.check_rows(self.batch_schedule, micro)

    @property
    def step_rows(self) -> int:
        """The rows of a step after batch_schedule's last pair: batch_size × grad_accum, or rows_per_step."""
        return self.batch_size * self.grad_accum if self.batch_size and self.grad_accum else self.rows_per_step

    def _check_muon(self) -> None:
        """Muon's switches need Muon (the coefficients' names and rows: registries.check_train)."""
        switches = [f"train.{key}={getattr(self, key)!r}" for key, off in MUON_SWITCHES.items()
                    if getattr(self, key) != off]
        if switches and self.optimizer != "muon":
            raise ConfigError(f"{', '.join(switches)} needs train.optimizer='muon' (the setting changes Muon's "
                              f"update; it is {self.optimizer!r}): set --config.train.optimizer=muon, or drop it")

    def _check_optimizer(self) -> None:
        _check_train(self, isinstance(self.optimizer, str), "optimizer", "a name of jaxgpt.optim.OPTIMIZERS")
        for key in GROUP_LRS:
            value = getattr(self, key)
            _check_train(self, value is None or (is_number(value) and value >= 0), key,
                         "None (train.lr) or a number ≥ 0")
            if value is not None and self.lr == 0:
                raise ConfigError(f"train.{key}={value!r} needs train.lr > 0: each group's schedule is train.lr's "
                                  "scaled to its own peak")

    def _check_schedule(self) -> None:
        _check_train(self, isinstance(self.schedule, str), "schedule", "a schedule's name (jaxgpt.optim.SCHEDULES)")
        fraction = self.cooldown_fraction
        _check_train(self, is_number(fraction) and 0 < fraction <= 1, "cooldown_fraction", "a number in (0, 1]")
        if self.schedule_steps <= self.warmup_steps:
            raise ConfigError(f"{self.schedule_key}={self.schedule_steps} must exceed train.warmup_steps="
                              f"{self.warmup_steps}: the decay needs at least one step after the warmup (raise "
                              f"{self.schedule_key} or lower train.warmup_steps)")
        if self.schedule != "wsd":
            return
        if self.cooldown_steps < 1:
            raise ConfigError(f"train.cooldown_fraction={fraction!r} gives no cooldown step out of "
                              f"{self.schedule_key}={self.schedule_steps}: raise it to at least "
                              f"{1 / self.schedule_steps:.3g}")
        if self.schedule_steps - self.cooldown_steps < self.warmup_steps:
            raise ConfigError(f"train.cooldown_fraction={fraction!r}: its cooldown of {self.cooldown_steps} steps "
                              f"would start at step {self.schedule_steps - self.cooldown_steps}, inside the warmup of "
                              f"{self.warmup_steps}: lower it, or train.warmup_steps")

    @property
    def schedule_steps(self) -> int:
        """The step at which the schedule reaches min_lr: decay_steps, else the run's steps."""
        return self.decay_steps or self.steps

    @property
    def schedule_key(self) -> str:
        """The key that sets schedule_steps: the one a message about it names."""
        return "train.steps" if self.decay_steps is None else "train.decay_steps"

    @property
    def cooldown_steps(self) -> int:
        """wsd's cooldown: round(cooldown_fraction · schedule_steps) steps, ending at schedule_steps."""
        return round(self.cooldown_fraction * self.schedule_steps)

    def _check_untie(self) -> None:
        """untie_at a fraction in (0, 1) that leaves the schedule at least one tied step and one untied step."""
        fraction, steps = self.untie_at, self.schedule_steps
        if fraction is None:
            return
        _check_train(self, is_number(fraction) and 0 < fraction < 1, "untie_at", "None or a number in (0, 1): the "
                     "share of the schedule's steps whose embedding and unembedding are one table")
        if not 0 < self.untie_step < steps:
            raise ConfigError(f"train.untie_at={fraction!r} unties at step {self.untie_step} of {self.schedule_key}="
                              f"{steps}, which leaves no {'tied' if self.untie_step == 0 else 'untied'} step: "
                              f"choose it in [{1 / steps:.3g}, {(steps - 1) / steps:.3g}]")

    @property
    def untie_step(self) -> int | None:
        """The first step whose embedding and unembedding are two tables: round(untie_at · schedule_steps), as
        multi-token prediction's fade and the learning rate are fractions of the schedule, so a run extended past
        train.steps (decay_steps set) keeps it; None: never tied."""
        return None if self.untie_at is None else round(self.untie_at * self.schedule_steps)

    def group_lr(self, group: str) -> float:
        """The peak learning rate of a parameter group: 'matrix' (lr), 'embed', 'head' or 'scalar'
        (their own key, or lr when it is None)."""
        own = None if group == "matrix" else getattr(self, f"{group}_lr")
        return self.lr if own is None else own

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> TrainConfig:
        return checked_section(cls, values, "train")


def _check_train(config: TrainConfig, ok: bool, key: str, expected: str) -> None:
    if not ok:
        raise ConfigError(f"train.{key}={getattr(config, key)!r}: must be {expected}")


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """The sample section: what train.py writes to sample.txt at the end of a run, the run's best
    model continuing `prompt` (jaxgpt.train.run.write_sample). Checked when the run starts, so a bad
    setting stops it before the first step, not after the last.

    prompt: the text to continue, at least one character. record: in a records run, a record (a
    JSON object of fields) whose prompt, made by the run's own templates, the sample continues in
    place of `prompt` (None: `prompt`). max_new_tokens: how many tokens to draw (0: no sample).
    temperature: τ ≥ 0 (0: greedy). top_k: keep the k likeliest (0: all).
    """

    prompt: str = "\n"
    record: str | None = None
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 40

    def __post_init__(self):
        checks = (("prompt", isinstance(self.prompt, str) and bool(self.prompt), "a non-empty string"),
                  ("record", self.record is None or _json_object(self.record), "a JSON object of a record's fields"),
                  ("max_new_tokens", is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "an integer ≥ 0"),
                  ("temperature", is_number(self.temperature) and 0 <= self.temperature < float("inf"),
                   "a finite number ≥ 0 (0: greedy)"),
                  ("top_k", is_int(self.top_k) and self.top_k >= 0, "an integer ≥ 0 (0: every token)"))
        for key, ok, expected in checks:
            if not ok:
                raise ConfigError(f"sample.{key}={getattr(self, key)!r}: must be {expected}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SampleConfig:
        return checked_section(cls, values, "sample")


def _json_object(text) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (TypeError, ValueError):
        return False


def _section(cls, **overrides: Any) -> dict[str, Any]:
    """A config section from a dataclass's fields: their defaults, and for a field whose
    default is None a typed ml_collections placeholder, so an override is type-checked."""
    hints = typing.get_type_hints(cls)
    section = {}
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(field.default_factory):  # a nested section (data.ocr): its own keys
            section[field.name] = _section(field.default_factory)
            continue
        value = field.default
        if value is None:
            kinds = [t for t in typing.get_args(hints[field.name]) if t is not type(None)]
            value = config_dict.placeholder(kinds[0])
        section[field.name] = value
    section.update(overrides)
    return section


def default_config() -> ConfigDict:
    """Every key a run reads, with its default; configs/*.py start from this and change what
    their preset needs, and the command line overrides any of it."""
    return ConfigDict({
        # vocab_size 0: the tokenizer's vocabulary size
        "model": _section(GPTConfig, vocab_size=0),
        # how the model runs here: any of it may change on a resume or for sampling
        "compute": _section(ComputeConfig),
        "data": _section(DataConfig),
        "train": _section(TrainConfig),
        "sample": _section(SampleConfig),
        # cpu_devices: on a CPU, one JAX device per core (-1: as many as divide the batches; 0: one)
        "mesh": {"data": -1, "fsdp": 1, "tensor": 1, "cpu_devices": -1},
        "distributed": {
            "coordinator_address": config_dict.placeholder(str),
            "num_processes": config_dict.placeholder(int),
            "process_id": config_dict.placeholder(int),
            "auto": False,  # let jax.distributed detect a cluster (SLURM, TPU pods)
            "cpu_collectives": "gloo",  # collectives between CPU processes
            "timeout_s": 300,  # how long a process waits for every other one to join before it gives up
        },
        # start from another model: 'hf:PATH' (a GPT-2 checkpoint, jaxgpt.convert) or a jaxgpt run directory
        "init_from": config_dict.placeholder(str),
        "run_dir": config_dict.placeholder(str),  # None: runs/<config file name>
        # compiled programs kept between runs (jaxgpt.sharding.use_compilation_cache): 'auto'
        # (~/.cache/jaxgpt/xla, or $JAX_COMPILATION_CACHE_DIR), 'off', or a directory
        "compilation_cache": "auto",
        # a named set of XLA's flags added to XLA_FLAGS before JAX starts (jaxgpt.platforms.xla_flags.PRESETS):
        # 'default' adds none, which measured fastest on an H100; 'cublas', 'cublaslt', 'cudnn_norms'
        "xla_flags": "default",
        "resume": "auto",  # auto | never | must
        # compile the steps for the local devices and report their memory and cost, then exit (jaxgpt.compile)
        "compile_only": False,
    })


# keys that moved to a section: an override of the old name is told the new one
MOVED_KEYS = {f"data.{old}": " or ".join(f"'data.{key}'" for key in new) for old, new in FLAT_DATA_KEYS.items()}
MOVED_KEYS.update({f"model.{key}": f"'compute.{key}' (how the model runs, not what it is)" for key in COMPUTE_KEYS})


def unknown_key(config: ConfigDict, dotted: str) -> str | None:
    """None when `dotted` (e.g. 'train.lr') names a key of `config`; else a one-line message
    naming the first missing part and the nearest existing key."""
    node, walked = config, []
    for part in dotted.split("."):
        if not isinstance(node, ConfigDict) or part not in node:
            siblings = list(node.keys()) if isinstance(node, ConfigDict) else []
            near = difflib.get_close_matches(part, siblings, n=1)
            where = ".".join([*walked, part])
            if where in MOVED_KEYS:
                return f"no key '{where}'; it is now {MOVED_KEYS[where]}"
            hint = f"; did you mean '{'.'.join([*walked, near[0]])}'?" if near else ""
            return f"no key '{where}'{hint}"
        walked.append(part)
        node = node[part]
    return None


def none_keys() -> list[str]:
    """The dotted keys whose default is None (e.g. 'data.records.template'): the ones
    `--config.KEY=None` sets back to None, whatever a preset chose (jaxgpt.cli)."""

    def walk(section: dict, prefix: str) -> list[str]:
        found = []
        for key, value in section.items():
            if isinstance(value, dict):
                found += walk(value, f"{prefix}{key}.")
            elif value is None:
                found.append(prefix + key)
        return found

    return walk(default_config().to_dict(), "")


def load_config(path: str | os.PathLike) -> ConfigDict:
    """get_config() of a configs/*.py file (what train.py's --config loads, without overrides);
    a one-line ConfigError, naming the file and line, for a file that is missing, does not
    run, defines no get_config or returns no ConfigDict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config={path}: no such file: give a config file such as configs/default.py")
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not callable(getattr(module, "get_config", None)):
            raise ConfigError(f"{path} defines no get_config(): a config file's get_config() returns the run's "
                              "ConfigDict, starting from jaxgpt.config.default_config() (see configs/default.py)")
        config = module.get_config()
    except ConfigError:
        raise
    except SyntaxError as error:
        raise ConfigError(f"{error.filename}:{error.lineno}: {error.msg} (a syntax error in the config file)") \
            from None
    except Exception as error:  # the user's code: say where it failed, in one line
        lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
                 if Path(frame.filename).resolve() == path.resolve()]
        where = f"{path}:{lines[-1]}" if lines else str(path)
        raise ConfigError(f"{where}: {one_line(error, with_type=True)} (raised by the config file)") from None
    if not isinstance(config, ConfigDict):
        raise ConfigError(f"{path}: get_config() returned {type(config).__name__}, not a ConfigDict: return the "
                          "config it builds from jaxgpt.config.default_config()")
    return config
