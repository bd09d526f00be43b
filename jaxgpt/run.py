"""A training run: its directory, resume policy and loop (being restructured)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp

from jaxgpt import tokenizers
from jaxgpt.checkpoint import Checkpoints
from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT


def load_run(run_dir, step: Optional[int] = None):
    """(params, config, tokenizer) of a training run: config.json, tokenizer.json and the
    params of the best checkpoint by validation loss (the latest if none was evaluated), or
    of `step`. Raises ValueError for a missing or malformed run directory and
    jaxgpt.checkpoint.CheckpointError when it holds no usable checkpoint."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist: pass the directory a training run wrote")
    config_path, tokenizer_path = run_dir / "config.json", run_dir / "tokenizer.json"
    for path in (config_path, tokenizer_path):
        if not path.is_file():
            raise ValueError(f"{run_dir} has no {path.name}, so it is not a complete run directory")
    try:
        config = GPTConfig.from_dict(json.loads(config_path.read_text(encoding="utf-8"))["model"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{config_path} does not hold a model config ({type(err).__name__}: {err})") from None
    tokenizer = tokenizers.load(tokenizer_path)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"{tokenizer_path} has {tokenizer.vocab_size} tokens but the model only "
                         f"{config.vocab_size}: the tokenizer is not the one the run was trained with")
    abstract = jax.eval_shape(lambda: GPT(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"])
    checkpoints = Checkpoints(run_dir, read_only=True)
    try:
        params, _ = checkpoints.restore_params(abstract, step=step)
    finally:
        checkpoints.close()
    return params, config, tokenizer
