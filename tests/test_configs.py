"""Every preset loads, validates, and builds the model it describes."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxgpt import GPT, param_count
from jaxgpt.config import load_config
from jaxgpt.train.run import model_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.py"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_builds_its_model(path):
    config = load_config(path)
    cfg = model_config(config, vocab_size=config.data.vocab_size or 65)
    shapes = jax.eval_shape(lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    assert sum(x.size for x in jax.tree.leaves(shapes)) == param_count(cfg)
    assert config.train.batch_size > 0 or config.train.rows_per_step > 0  # rows_per_step: chosen to fit
    assert config.train.steps > config.train.warmup_steps


def test_presets_match_their_recipes():
    configs = {p.stem: load_config(p) for p in CONFIGS}
    assert {"default", "shakespeare_char_cpu", "shakespeare_char", "gpt2_124m"} <= set(configs)
    cpu = configs["shakespeare_char_cpu"]
    assert (cpu.model.n_layer, cpu.model.n_head, cpu.model.d_model, cpu.model.block_size) == (4, 4, 128, 64)
    train = cpu.train
    assert (train.batch_size, train.steps, train.lr, train.min_lr, train.b2) == (12, 2000, 1e-3, 1e-4, 0.99)
    assert not cpu.model.bias and cpu.model.dropout == 0.0
    gpt2 = configs["gpt2_124m"]
    assert gpt2.train.rows_per_step * gpt2.model.block_size == 524_288  # the micro-batch chosen to fit (micro_batch)
    assert gpt2.compute.dtype == "bfloat16" and gpt2.compute.param_dtype == "float32"


@pytest.mark.parametrize("name", ["speedrun_cpu", "speedrun_cpu_plus", "speedrun_cpu_every"])
def test_the_cpu_speedrun_has_no_more_parameters_and_no_longer_context_than_nanogpts_cpu_recipe(name):
    """nanoGPT's CPU recipe (4 layers, 4 heads, 128 wide, block 64, no biases, tied, 65 characters):
    per layer 3d² + d² (attention) + 2·4d² (MLP) and two LayerNorm gains, a final gain, the
    65 × d token table and the 64 × d position table."""
    from jaxgpt import tokenizers

    d, layers, block = 128, 4, 64
    nanogpt = layers * (12 * d * d + 2 * d) + d + 65 * d + block * d
    chars = tokenizers.train_tokenizer("char", ["".join(chr(33 + i) for i in range(65))])  # jaxgpt's 65 + specials
    config = load_config(CONFIGS[0].parent / f"{name}.py")
    cfg = model_config(config, vocab_size=chars.vocab_size)
    assert param_count(cfg) <= nanogpt == 804_096 and cfg.block_size <= block
    assert (cfg.qk_norm, cfg.activation, cfg.zero_init_out, cfg.tie_embeddings) == (True, "relu2", True, False)
    assert cfg.logit_softcap and config.train.optimizer == "muon" and config.train.schedule == "wsd"
