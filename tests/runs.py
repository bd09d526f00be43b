"""Tiny runs for the tests. A run directory as training writes it, either made without training
(`write_run`: config.json, tokenizer.json and a checkpoint of random params, for the tests of
what reads one: sample.py, eval.py, export, viz, circuits), or trained (`trained_run`: a few
steps of `tiny_config` on `write_corpus`'s text, once per distinct setting in a test session,
shared by every test that reads it); and the tiny config itself, as a ConfigDict for
jaxgpt.train.run.train or as train.py's arguments."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxgpt.checkpoint import Checkpoints

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the a king queen lord lady speaks comes goes to from with and but now then here there".split()


def write_corpus(path: Path) -> Path:
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, size=rng.integers(4, 12))).capitalize() + "." for _ in range(400)]
    path.write_text("\n".join(lines) + "\n")
    return path


TINY_OVERRIDES = {
    "data.tokenizer": "char", "data.val_fraction": 0.2,
    "model.n_layer": 1, "model.n_head": 2, "model.d_model": 16, "model.block_size": 16,
    "train.steps": 6, "train.batch_size": 4, "train.eval_batch_size": 4, "train.warmup_steps": 1,
    "train.decay_steps": 12, "train.eval_every": 3, "train.ckpt_every": 3, "train.log_every": 1,
    "train.eval_max_batches": 2, "train.peak_flops": 1e9, "sample.max_new_tokens": 0,
}


def tiny_config(tmp_path, corpus, run="run", preset=None, **changes):
    """default_config(), or configs/<preset>.py as train.py loads it, with TINY_OVERRIDES."""
    from jaxgpt.config import default_config, load_config

    config = load_config(ROOT / "configs" / f"{preset}.py") if preset else default_config()
    for key, value in {**TINY_OVERRIDES, **changes}.items():
        *section, name = key.split(".")
        (config[section[0]] if section else config)[name] = value
    config.data.source = str(corpus)
    config.data.cache_dir = str(tmp_path / "cache")
    config.run_dir = str(tmp_path / run)
    return config


def cli_args(tmp_path, corpus, run="run", **changes):
    values = {**TINY_OVERRIDES, **changes, "data.source": str(corpus), "data.cache_dir": str(tmp_path / "cache")}
    return [f"--config.{k}={v}" for k, v in values.items()] + [f"--config.run_dir={tmp_path / run}"]


_TRAINED: dict[str, tuple[Path, dict]] = {}  # the settings → (the run directory, what train returned)


def trained_run(tmp_path_factory, **changes) -> tuple[Path, dict]:
    """(the run directory, jaxgpt.train.run.train's result) of tiny_config with `changes`, on
    write_corpus's text: trained at the first call with these settings in the session, shared by
    the later ones. Its readers leave it as it is (copy it to change it, or resume from it)."""
    key = json.dumps(sorted(changes.items()), default=repr)
    if key not in _TRAINED:
        from jaxgpt.train.run import train

        where = tmp_path_factory.mktemp("trained")
        _TRAINED[key] = where / "run", train(tiny_config(where, write_corpus(where / "corpus.txt"), **changes))
    return _TRAINED[key]


def write_run(path: Path, cfg, tokenizer, step: int | None = 1, params=None, **sections) -> Path:
    """A run directory as training writes it, without the training: config.json (the model's
    section and `sections`), tokenizer.json and, unless step is None, a checkpoint at `step` of
    `params` (default: test_model.random_params(cfg))."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model": cfg.to_dict(), **sections}))
    tokenizer.save(path / "tokenizer.json")
    if step is not None:
        if params is None:
            from test_model import random_params

            params = random_params(cfg)
        save_params(path, step, params)
    return path


def save_params(path: Path, step: int, params) -> None:
    """A checkpoint at `step` in the run directory `path` holding `params` (no optimizer state)."""
    checkpoints = Checkpoints(path)
    checkpoints.save(step, {"step": jnp.int32(step), "params": params, "opt_state": ()})
    checkpoints.close()
