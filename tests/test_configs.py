"""Every preset loads, validates, and builds the model it describes."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxgpt import GPT, param_count
from jaxgpt.config import load_config
from jaxgpt.run import model_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.py"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_builds_its_model(path):
    config = load_config(path)
    cfg = model_config(config, vocab_size=config.data.vocab_size or 65)
    shapes = jax.eval_shape(lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    assert sum(x.size for x in jax.tree.leaves(shapes)) == param_count(cfg)
    assert config.train.batch_size > 0 and config.train.steps > config.train.warmup_steps


def test_presets_match_their_recipes():
    configs = {p.stem: load_config(p) for p in CONFIGS}
    assert {"default", "shakespeare_char_cpu", "shakespeare_char", "gpt2_124m"} <= set(configs)
    cpu = configs["shakespeare_char_cpu"]
    assert (cpu.model.n_layer, cpu.model.n_head, cpu.model.d_model, cpu.model.block_size) == (4, 4, 128, 64)
    train = cpu.train
    assert (train.batch_size, train.steps, train.lr, train.min_lr, train.b2) == (12, 2000, 1e-3, 1e-4, 0.99)
    assert not cpu.model.bias and cpu.model.dropout == 0.0
    gpt2 = configs["gpt2_124m"]
    assert gpt2.train.batch_size * gpt2.train.grad_accum * gpt2.model.block_size == 524_288
    assert gpt2.compute.dtype == "bfloat16" and gpt2.compute.param_dtype == "float32"
