"""What a run is checked against before its first step (jaxgpt.train.opening.open_run), so that nothing
impossible is found after the data is read, or after the last step:

    check_sections    the sample, data and mesh sections, the batch sizes on the mesh, and the schedules
                      of the batches' shapes against the model and the data
    start_from        init_from resolved: the source fixes the model and the tokenizer; a key the
                      user set that it fixes otherwise is refused, naming it; the config says
                      what the run really uses (config.json describes the run as it is)
    check_unknown     a tokenizer not trained on this data (init_from's, a file's): refused when
                      more than data.max_unknown of the train tokens are <|unk|> (as eval.py does)
    check_memory      the parameters, optimizer state and activations against the memory
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from jaxgpt import data, sharding, tokenizers
from jaxgpt.attention import window_conflict
from jaxgpt.config import ComputeConfig, DataConfig, GPTConfig, SampleConfig, TrainConfig
from jaxgpt.errors import ConfigError, DataError
from jaxgpt.model import param_count
from jaxgpt.optim.tying import check_untie
from jaxgpt.train import micro_batch, rundir
from jaxgpt.train.evaluation import id_share
from jaxgpt.train.rundir import TOKENIZER_FILE


def check_sections(config, train_cfg: TrainConfig) -> Mesh:
    """The mesh of the run, once the sections that the model's vocabulary does not decide are
    checked: the sample (written after the last step), the data, and the mesh with the batch
    sizes it must divide."""
    SampleConfig.from_mapping(config.sample)
    DataConfig.from_mapping(config.data)
    mesh = sharding.make_mesh(config.mesh)
    check_batch_sizes(train_cfg, mesh)
    check_targets_ahead(train_cfg, config.model.block_size)
    check_schedules(train_cfg, config.model, config.data.format == "records")
    check_untie(train_cfg, config.model.tie_embeddings)
    for note in unused_settings(config, train_cfg):
        print(f"jaxgpt: {note}", file=sys.stderr)
    return mesh


def check_targets_ahead(train_cfg: TrainConfig, block_size: int) -> None:
    """Multi-token prediction scores targets up to mtp_tokens − 1 past the next one: never past the block."""
    if train_cfg.mtp_tokens > block_size:
        raise ConfigError(f"train.mtp_tokens={train_cfg.mtp_tokens} predicts past the block of model.block_size="
                          f"{block_size} tokens: choose at most {block_size}")


def check_schedules(train_cfg: TrainConfig, model, records: bool) -> None:
    """train.length_schedule's lengths within the block (and as long as multi-token prediction's targets
    ahead), on a text corpus; train.window_schedule's windows shorter than the block, of a model a
    window can narrow (jaxgpt.attention.window_conflict)."""
    block = model.block_size
    for step, length in train_cfg.length_schedule:
        if length > block:
            raise ConfigError(f"train.length_schedule: rows of {length} tokens before step {step} do not fit "
                              f"model.block_size={block}: choose lengths of at most {block}")
        if length < train_cfg.mtp_tokens:
            raise ConfigError(f"train.length_schedule: rows of {length} tokens before step {step} are shorter than "
                              f"train.mtp_tokens={train_cfg.mtp_tokens} targets ahead: choose at least that")
    if train_cfg.length_schedule and records:
        raise ConfigError("train.length_schedule needs a text corpus: records are packed into rows of "
                          "model.block_size (data.format='records'); drop the schedule")
    for step, window in train_cfg.window_schedule:
        if window >= block:
            raise ConfigError(f"train.window_schedule: a window of {window} before step {step} is the whole block "
                              f"of model.block_size={block} or more: choose windows below {block}, or drop the pair")
    conflict = window_conflict(model) if train_cfg.window_schedule else None
    if conflict:
        raise ConfigError(f"train.window_schedule: {conflict}; drop the schedule")


def unused_settings(config, train_cfg: TrainConfig) -> list[str]:
    """A line for each setting that has nothing to act on in this run, so none is silently ignored."""
    notes = []
    if train_cfg.head_lr is not None and config.model.tie_embeddings:
        notes.append(f"train.head_lr={train_cfg.head_lr!r} is unused: the embeddings are tied "
                     "(model.tie_embeddings=True), so the unembedding is the token embedding and trains at "
                     "train.embed_lr; untie them (--config.model.tie_embeddings=False) for a head of its own")
    defaults = TrainConfig()
    for key in ("mtp_weight", "mtp_fraction"):
        if train_cfg.mtp_tokens == 1 and getattr(train_cfg, key) != getattr(defaults, key):
            notes.append(f"train.{key}={getattr(train_cfg, key)!r} is unused: train.mtp_tokens=1 predicts the next "
                         "token only; set train.mtp_tokens > 1 for the targets ahead")
    return notes


# --- starting from another model ------------------------------------------------------------


def start_from(config, explicit: Collection[str] = ()) -> tuple[Any, tokenizers.Tokenizer | None]:
    """(the config, the tokenizer to make the tokens with; None: the one data.tokenizer names).
    With init_from the source fixes the model (but for rundir.RUN_FIELDS) and the tokenizer,
    and the config returned says so: data.tokenizer is the run's own tokenizer.json, a copy of
    the source's. A key of `explicit` (the dotted keys the user set) that this changes is
    refused in one line, naming it: an explicit setting is never silently ignored."""
    if not config.init_from:
        return config, None
    resolved, tokenizer = rundir.resolve_init_from(config)
    if tokenizer is not None:
        resolved.data.tokenizer = str(Path(config.run_dir) / TOKENIZER_FILE)
        resolved.data.vocab_size = tokenizer.vocab_size
    _refuse_replaced(config, resolved, tokenizer, explicit)
    return resolved, tokenizer


def _refuse_replaced(asked, resolved, tokenizer: tokenizers.Tokenizer | None, explicit: Collection[str]) -> None:
    """ConfigError naming each key of `explicit` whose value the start from init_from replaced."""
    replaced = [key for key in dict.fromkeys(explicit) if _value(asked, key) != _value(resolved, key)]
    if not replaced:
        return
    has = {key: repr(_value(resolved, key)) for key in replaced}
    if "data.tokenizer" in has and tokenizer is not None:
        has["data.tokenizer"] = f"its {tokenizer.kind} tokenizer of {tokenizer.vocab_size} tokens"
    fixed = "; ".join(f"{key}={_value(asked, key)!r} (the source has {has[key]})" for key in replaced)
    raise ConfigError(f"init_from={asked.init_from} fixes what you set: {fixed}. Leave "
                      f"{'it' if len(replaced) == 1 else 'them'} out, or train from scratch without init_from")


def _value(config, dotted: str) -> Any:
    """The value of a dotted key of a ConfigDict, None where there is none."""
    try:
        return functools.reduce(lambda node, name: node[name], dotted.split("."), config)
    except (KeyError, TypeError, AttributeError):
        return None


def check_unknown(config, corpus: data.Corpus) -> None:
    """Refuse a run whose tokenizer was not trained on its data (init_from's, or a tokenizer file)
    when more than data.max_unknown of its train tokens are <|unk|>: the text it has no token
    for, which a model learns to predict cheaply (eval.py refuses such text the same way)."""
    if config.data.tokenizer in tokenizers.KINDS:  # trained on this data: it knows its text
        return
    tokens = corpus.examples["train"].tokens if corpus.records else corpus.train
    share, limit = id_share(tokens, corpus.tokenizer.unk_id), config.data.max_unknown
    if share > limit:
        whose = f"the tokenizer of init_from={config.init_from}" if config.init_from else "data.tokenizer"
        raise DataError(f"{share:.1%} of the train tokens are <|unk|>, text that {whose} has no token for (more "
                        f"than data.max_unknown={limit}), so the model would learn to predict <|unk|>: start from "
                        "a model whose tokenizer covers this data, train a tokenizer on it (without init_from), or "
                        f"set --config.data.max_unknown={math.ceil(share * 100) / 100} to accept them")


# --- resources ------------------------------------------------------------------------------


def check_memory(cfg: GPTConfig, compute: ComputeConfig, train_cfg: TrainConfig) -> None:
    """Refuse, before anything is allocated, a run that cannot fit: the parameters with their
    gradients and optimizer state (micro_batch.state_bytes), plus one micro-batch's
    activations (micro_batch.row_bytes a row), against the devices' memory together, or on a
    CPU 90% of the RAM (train.memory_limit_gib overrides either). An estimate, to stop the
    impossible early; the estimate the micro-batch is chosen by, so a chosen one passes."""
    count = param_count(cfg)
    need = (micro_batch.state_bytes(cfg, compute, train_cfg)
            + micro_batch.chunk_bytes(cfg, compute, train_cfg.batch_size * cfg.block_size)
            + train_cfg.batch_size * micro_batch.row_bytes(cfg, compute))
    limit, where = _memory_limit(train_cfg)
    if limit and need > limit:
        raise ConfigError(f"the run needs about {_size(need)} ({count:,} parameters with their gradients "
                          f"and optimizer state, and the activations of {train_cfg.batch_size} rows of "
                          f"{cfg.block_size} tokens), more than the {_size(limit)} of {where}: make the model "
                          "or the micro-batch smaller (model.vocab_size, n_layer, d_model; train.batch_size with "
                          "train.grad_accum), or set train.memory_limit_gib")


def _size(n: float) -> str:
    """A number of bytes in the unit that shows it best: 812 B, 1.5 KiB, 340 MiB, 12.0 GiB."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while n >= 1024 and power < len(units) - 1:
        n, power = n / 1024, power + 1
    return f"{n:.0f} {units[power]}" if power == 0 or n >= 100 else f"{n:.1f} {units[power]}"


def _memory_limit(train_cfg: TrainConfig) -> tuple[float | None, str]:
    if train_cfg.memory_limit_gib:
        return train_cfg.memory_limit_gib * 2**30, f"train.memory_limit_gib={train_cfg.memory_limit_gib:g}"
    if jax.default_backend() == "cpu":
        return 0.9 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "90% of this machine's RAM"
    stats = [device.memory_stats() or {} for device in jax.devices()]
    limits = [s.get("bytes_limit") for s in stats]
    return (sum(limits), "the devices' memory") if all(limits) else (None, "")


def check_batch_sizes(train_cfg: TrainConfig, mesh: Mesh) -> None:
    """ValueError unless the mesh's data × fsdp divides each batch: the micro-batch (where it is
    chosen to fit, the rows it is made of: rows_per_step, or rows_per_step / grad_accum) and
    the evaluation's."""
    divisor = sharding.batch_size_divisor(mesh)
    rows, accum = train_cfg.rows_per_step, train_cfg.grad_accum
    if train_cfg.batch_size:
        sizes = {"train.batch_size": train_cfg.batch_size}
    else:
        sizes = {"train.rows_per_step / train.grad_accum" if accum else "train.rows_per_step": rows // (accum or 1)}
    sizes["train.eval_batch_size"] = train_cfg.eval_batch_size
    for name, size in sizes.items():
        if size % divisor:
            on_cpu = " (on a CPU, --config.mesh.cpu_devices sets the number of devices)"
            raise ValueError(f"{name}={size} must be divisible by the mesh's data×fsdp size {divisor}"
                             + (on_cpu if jax.default_backend() == "cpu" else ""))
