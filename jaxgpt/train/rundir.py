"""A run directory on disk, read: its config.json, tokenizer.json and checkpoints; and the
runs a new run may start from (`init_from`).

    params, config, tokenizer = load_run("runs/default")      # for sampling and evaluation
    config, tokenizer = resolve_init_from(config)             # before a run starts from another
    params = init_params_from(config.init_from, model_cfg)

init_from is 'hf:PATH' (a Hugging Face GPT-2 checkpoint, jaxgpt.convert) or the directory
of a jaxgpt run: the new run takes its model (all of config.model but RUN_FIELDS: block_size,
at most the source's, and the dropout rates), its tokenizer and the params of its best
checkpoint (by validation loss; else the latest), with a fresh optimizer state from step 0:
fine-tuning. How either runs (config.compute) is the caller's own.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import jax

from jaxgpt import convert, data, tokenizers
from jaxgpt.blocks import unstack_layers
from jaxgpt.checkpoint import Checkpoints, MismatchedCheckpoint
from jaxgpt.config import RESUME, ComputeConfig, GPTConfig, TrainConfig
from jaxgpt.errors import ConfigError, TrainingError
from jaxgpt.files import write_json
from jaxgpt.model import GPT, param_shapes
from jaxgpt.model_config import split_model
from jaxgpt.quantize import params_for
from jaxgpt.registries import open_compute, open_model
from jaxgpt.sharding import place

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
HF_SCHEME = "hf:"
# What of the model a run chooses for itself when it starts from another (a shorter context,
# its own dropout: neither changes the function at inference); the source fixes the rest.
RUN_FIELDS = ("block_size", "dropout", "ffn_dropout")


def load_run(run_dir, step: int | None = None, compute: ComputeConfig | None = None):
    """(params, config, tokenizer) of a training run: config.json, tokenizer.json and the
    params of the best checkpoint by validation loss (the latest if none was evaluated), or
    of `step`, in the layout, param dtype and weights of `compute` (default: per layer,
    float32; int8 weights quantised by jaxgpt.quantize), whatever the run was trained with.
    Raises ValueError for a missing or malformed run directory and
    jaxgpt.checkpoint.CheckpointError when it holds no usable checkpoint."""
    run_dir = Path(run_dir)
    saved, config, tokenizer = read_run(run_dir)
    compute = ComputeConfig() if compute is None else compute
    saved_run = saved_compute(saved)  # its checkpoints hold the params in its layout and dtype
    written = GPT(config, ComputeConfig(param_dtype=saved_run.param_dtype, scan_layers=saved_run.scan_layers))
    abstract = param_shapes(written)
    checkpoints = Checkpoints(run_dir, read_only=True)
    try:
        params, _ = checkpoints.restore_params(abstract, step=step)
    finally:
        checkpoints.close()
    # converted on the host, then placed (sharding.place): the restore's one device is no caller's mesh
    return place(params_for(jax.device_get(params), config, compute)), config, tokenizer


def saved_compute(saved: dict) -> ComputeConfig:
    """How a run directory's checkpoints were written: its config's compute section, or in
    a run from before that section, the compute keys of its model section."""
    values = saved.get("compute") or split_model(saved.get("model", {}))[1]
    try:
        return open_compute(values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"the run's config.json has no valid compute section ({err})") from None



def read_run(run_dir: Path) -> tuple[dict[str, Any], GPTConfig, tokenizers.Tokenizer]:
    """(the saved config.json, the model's config, the tokenizer) of a run directory, checked:
    the tokenizer is the one the run pinned and fits the model."""
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist: pass the directory a training run wrote")
    config_path, tokenizer_path = run_dir / CONFIG_FILE, run_dir / TOKENIZER_FILE
    for path in (config_path, tokenizer_path):
        if not path.is_file():
            raise ValueError(f"{run_dir} has no {path.name}, so it is not a complete run directory")
    try:
        saved = json.loads(config_path.read_text(encoding="utf-8"))
        config = open_model(saved["model"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{config_path} does not hold a model config ({type(err).__name__}: {err})") from None
    tokenizer = tokenizers.load(tokenizer_path)
    pinned = saved.get("tokenizer_sha256")
    if pinned and data.tokenizer_hash(tokenizer) != pinned:
        raise ValueError(f"{tokenizer_path} is not the tokenizer this run was trained with (its hash differs from the "
                         f"one in {config_path}): restore the run's own tokenizer.json")
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"{tokenizer_path} has {tokenizer.vocab_size} tokens but the model only "
                         f"{config.vocab_size}: the tokenizer is not the one the run was trained with")
    return saved, config, tokenizer


# --- starting from another run ----------------------------------------------------------------


def resolve_init_from(config) -> tuple[Any, tokenizers.Tokenizer | None]:
    """A training config made to start from its init_from ('hf:PATH' or a run directory), and
    the tokenizer to make its tokens with (None: the one data.tokenizer names). The caller's
    config is left as it was. A data.tokenizer that names a kind to train (char, word, bpe, …)
    gives way to the source's tokenizer; a tokenizer file given by path is kept (its ids must
    be the source's)."""
    spec = str(config.init_from)
    if spec.startswith(HF_SCHEME):
        source_cfg, tokenizer = convert.load_hf_config(_hf_directory(spec)), None
    else:
        source_cfg, tokenizer = _run_source(spec)
    source = spec.removeprefix(HF_SCHEME)
    if config.model.block_size > source_cfg.block_size:
        raise ValueError(f"model.block_size={config.model.block_size} is longer than the context of {source} "
                         f"(n_positions={source_cfg.block_size}): choose at most {source_cfg.block_size}")
    config = copy.deepcopy(config)
    for name, value in source_cfg.to_dict().items():
        if name not in RUN_FIELDS:
            config.model[name] = value
    if tokenizer is not None or config.data.tokenizer not in tokenizers.KINDS:
        return config, tokenizer
    tokenizer = convert.load_hf_tokenizer(source)
    if tokenizer is None:
        raise ValueError(f"{source} has no {convert.VOCAB_FILE} + {convert.MERGES_FILE}: set data.tokenizer to "
                         "the path of the tokenizer file whose ids this checkpoint uses")
    return config, tokenizer


def _hf_directory(spec: str) -> Path:
    if spec == HF_SCHEME:
        raise ValueError(f"init_from={spec!r}: give hf:PATH, PATH a Hugging Face GPT-2 directory")
    return Path(spec[len(HF_SCHEME):]).expanduser()


def _run_directory(spec: str) -> Path:
    source = Path(spec).expanduser()
    if not (source / CONFIG_FILE).is_file():
        raise ValueError(f"init_from={spec!r} is neither hf:PATH nor a jaxgpt run directory (no "
                         f"{CONFIG_FILE}): give hf:PATH or the run_dir of a finished run")
    return source


def _run_source(spec: str) -> tuple[GPTConfig, tokenizers.Tokenizer]:
    _, source_cfg, tokenizer = read_run(_run_directory(spec))
    return source_cfg, tokenizer


def init_params_from(spec: str, cfg: GPTConfig, compute: ComputeConfig | None = None, shardings=None) -> dict:
    """The params a run of `cfg` (running as `compute`) starts from: those of `spec`
    ('hf:PATH', or a run directory's best checkpoint), by fit_params."""
    compute = ComputeConfig() if compute is None else compute
    if str(spec).startswith(HF_SCHEME):
        directory = _hf_directory(spec)
        return fit_params(*convert.load_hf_gpt2(directory), cfg, compute, shardings, f"the checkpoint {directory}")
    params, source_cfg, _ = load_run(_run_directory(spec))
    return fit_params(source_cfg, params, cfg, compute, shardings, f"the run {spec}")


def fit_params(source_cfg: GPTConfig, params, cfg: GPTConfig, compute: ComputeConfig, shardings,
               source: str) -> dict:
    """A source model's params for a run of `cfg`: the same architecture or ValueError, cropped
    to cfg.block_size, in compute's param dtype and layer layout (blocks.layers_as), placed by
    `shardings` (sharding.place)."""
    different = [f"{n}={getattr(cfg, n)!r} (checkpoint: {getattr(source_cfg, n)!r})" for n in source_cfg.to_dict()
                 if n not in RUN_FIELDS and getattr(cfg, n) != getattr(source_cfg, n)]
    if different:
        raise ValueError(f"the model config does not match {source}: {', '.join(different)}; leave the architecture "
                         "to the checkpoint")
    _, params = convert.crop_block_size(source_cfg, unstack_layers(jax.device_get(params)), cfg.block_size)
    return place(params_for(params, cfg, compute), shardings)


# --- continuing the run in a directory ------------------------------------------------------------


def resume_policy(resume: str, checkpoints: Checkpoints) -> bool:
    """Whether to resume: resume='auto' when the directory holds a checkpoint; 'must' and
    'never' insist on one or on none."""
    if resume not in RESUME:
        raise ConfigError(f"resume={resume!r}: must be {', '.join(RESUME)}")
    steps = checkpoints.steps()
    if resume == "must" and not steps:
        raise TrainingError(f"resume='must' but {checkpoints.directory.parent} has no checkpoint to resume from")
    if resume == "never" and steps:
        raise TrainingError(f"resume='never' but {checkpoints.directory.parent} already holds checkpoints (steps "
                            f"{steps}): choose another --config.run_dir or remove that directory")
    return bool(steps)


# The train keys whose value the optimizer state holds (its layout, Muon's coefficients), with their value in
# runs from before them: a resume keeps them
STATE_KEYS = {"optimizer": "adamw", "muon_coeffs": "quintic", "normuon": False}


def check_same_run(directory: Path, cfg: GPTConfig, compute: ComputeConfig,
                   tokenizer: tokenizers.Tokenizer, train: TrainConfig | None = None) -> ComputeConfig | None:
    """A resume continues the run in the directory: the same model, the same tokenizer
    (its checkpoints mean nothing under another mapping of ids to text) and the same
    optimizer (train.optimizer, and the STATE_KEYS its state holds: the checkpoints' other half). How it runs may
    change; each change is said. Returns how the checkpoints were written (None: unknown,
    when config.json is missing: then the newest checkpoint's shapes must be cfg's)."""
    saved_path = directory / CONFIG_FILE
    written = None
    if saved_path.exists():
        try:
            saved = json.loads(saved_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            raise TrainingError(f"{saved_path} does not parse ({err}): restore the run's own {CONFIG_FILE}, or choose "
                                "another --config.run_dir") from None
        different = _model_differences(saved_path, saved.get("model"), cfg)
        if different:
            raise TrainingError(f"{directory} holds a run of another model ({different}, saved → asked); resume it "
                                "with its own config or choose another --config.run_dir")
        for key, before in STATE_KEYS.items():  # a run from before a key: its value then
            value = saved.get("train", {}).get(key, before)
            if train is not None and getattr(train, key) != value:
                raise TrainingError(f"{directory} holds a run trained with train.{key}={value!r}, whose state its "
                                    f"checkpoints keep: resume it with --config.train.{key}={value}, or give "
                                    f"train.{key}={getattr(train, key)!r} another --config.run_dir")
        written = saved_compute(saved)
        changes = [f"{key} {old!r} → {new!r}" for key, old in written.to_dict().items()
                   if (new := getattr(compute, key)) != old]
        if changes:
            print(f"jaxgpt: resuming with other compute settings: {', '.join(changes)}", file=sys.stderr)
    else:
        _check_checkpoint_shapes(directory, cfg, compute)
    pinned_path = directory / TOKENIZER_FILE
    if pinned_path.exists() and tokenizers.load(pinned_path) != tokenizer:
        raise TrainingError(f"the data now makes another tokenizer than {pinned_path}, which this run's checkpoints "
                            f"were trained with: resume with the run's own data, or set --config.data.tokenizer="
                            f"{pinned_path} to read new data with the run's tokenizer, or choose another "
                            "--config.run_dir")
    return written


# Keys config.json records whose change on a resume is not said here: the model and the compute
# settings are said by check_same_run; run_dir, resume and compile_only are how this command runs.
SAID_ELSEWHERE = ("model", "compute", "tokenizer_sha256", "run_dir", "resume", "compile_only")


def write_config(directory: Path, resolved: dict, resumed_at: int | None) -> None:
    """config.json: the resolved config. A resume (from checkpoint step `resumed_at`) whose
    settings differ from the run's says each changed key on a line, and keeps the config the
    earlier steps were trained with as config.step-N.json (the first such record of step N is
    kept: it trained the steps up to N)."""
    path = directory / CONFIG_FILE
    saved = _read_json(path) if resumed_at is not None and path.exists() else None
    changes = config_changes(saved, resolved) if isinstance(saved, dict) else []
    if changes:
        earlier = directory / f"config.step-{resumed_at}.json"
        if not earlier.exists():
            write_json(earlier, saved)
        for change in changes:
            print(f"jaxgpt: changed since step {resumed_at}: {change} (the config of the steps before: {earlier.name})",
                  file=sys.stderr)
    write_json(path, resolved)


def config_changes(saved: dict, resolved: dict) -> list[str]:
    """'key old → new' for each dotted key outside SAID_ELSEWHERE whose value differs as config.json
    keeps it (a tuple is a JSON list; a key the saved config lacks, from an older version, is not a change)."""
    def as_saved(value):
        return [as_saved(item) for item in value] if isinstance(value, (list, tuple)) else value

    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            if not prefix and key in SAID_ELSEWHERE:
                continue
            out |= flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": as_saved(value)}
        return out

    old, new = flat(saved), flat(resolved)
    return [f"{key} {old[key]!r} → {value!r}" for key, value in new.items() if key in old and old[key] != value]


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, OSError):
        return None


def _model_differences(saved_path: Path, saved_values, cfg: GPTConfig) -> str:
    """The fields of a saved model section that differ from cfg, as 'name: saved → asked'
    ('' when none do; fields added since the run began take their defaults). TrainingError
    when the section is not a model's."""
    saved_model = _saved_model(saved_values)
    if saved_model is None:
        raise TrainingError(f"{saved_path} holds no valid model section: restore the run's own {CONFIG_FILE}, or "
                            "choose another --config.run_dir")
    saved, asked = saved_model.to_dict(), cfg.to_dict()
    return ", ".join(f"{name}: {saved[name]!r} → {value!r}" for name, value in asked.items() if saved[name] != value)


def _check_checkpoint_shapes(directory: Path, cfg: GPTConfig, compute: ComputeConfig) -> None:
    """Without config.json, the model the newest checkpoint holds is known only by its shapes:
    they must be those of cfg (in compute's layout, the one the restore asks for). Refused
    before anything of the run directory is written."""
    abstract = param_shapes(GPT(cfg, compute))
    checkpoints = Checkpoints(directory, read_only=True)
    try:
        checkpoints.check_params(abstract)
    except MismatchedCheckpoint as error:
        raise TrainingError(f"{directory} has no {CONFIG_FILE}, and its checkpoint at step {error.step} holds "
                            f"another model ({error.differences}): resume it with the config it was written with, or "
                            "choose another --config.run_dir") from None
    finally:
        checkpoints.close()


def _saved_model(values) -> GPTConfig | None:
    try:
        return open_model(values)
    except (TypeError, ValueError):
        return None
