"""compute.scan_layers: the blocks as one nn.scan over stacked params compute the loop's function:
the same logits, loss, gradients and KV-cache decode (within 1e-6) from the same params in the
other layout, and the layouts convert both ways (params and the optimizer state)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_model import RECIPE, decode_step_by_step, forward, random_params, tiny, tokens
from test_run import corpus  # noqa: F401, F811  (the fixture)

from jaxgpt import GPT, ComputeConfig, ops
from jaxgpt.blocks import layers_as, stack_layers, unstack_layers
from jaxgpt.config import TrainConfig
from jaxgpt.model import param_layout

CASES = [  # 2 and 3 layers, every positions option, linear and local attention, remat, GQA, the recipe
    {"positions": "learned", "n_layer": 2, "n_head": 4, "n_kv_head": 2},
    # and the dense skips (scan carries h_0, h_1), paired heads on one layer of three (the scan's nn.cond)
    {"positions": "sinusoidal", "n_layer": 3, "dense_skips": 4, "paired_heads": (1,)},
    # the modern recipe's switches, RoPE, the attention gate and the key offset (the ring's)
    {**RECIPE, "n_layer": 2, "attention": "local", "window": 3, "attn_gate": 5, "key_offset": True},
    {"positions": "alibi", "n_layer": 3},
    {"positions": "none", "n_layer": 3, "attention": "linear"},
]
SCAN = ComputeConfig(scan_layers=True)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-6)


def loss(cfg, compute, params, x):
    logits = GPT(cfg, compute).apply({"params": params}, x[:, :-1])
    return ops.cross_entropy(logits, x[:, 1:])


@pytest.mark.parametrize("changes", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_scan_computes_the_loop(changes):
    cfg = tiny(**changes)
    loop, scan = ComputeConfig(remat=cfg.n_layer == 2), SCAN
    params = random_params(cfg)
    stacked = layers_as(params, True)
    x = tokens(cfg, 2, 11)
    close(forward(cfg, stacked, x, compute=scan), forward(cfg, params, x, compute=loop))

    grad = lambda compute, p: jax.jit(jax.value_and_grad(lambda q: loss(cfg, compute, q, x)))(p)  # noqa: E731
    (loop_loss, loop_grads), (scan_loss, scan_grads) = grad(loop, params), grad(scan, stacked)
    close(scan_loss, loop_loss)
    jax.tree.map(close, unstack_layers(scan_grads), loop_grads)

    for prompt_length in (5,):
        close(decode_step_by_step(cfg, stacked, x, prompt_length, cfg.block_size, compute=scan),
              decode_step_by_step(cfg, params, x, prompt_length, cfg.block_size, compute=loop))


def test_scan_initialises_stacked_params_of_the_loops_shapes():
    cfg = tiny(n_layer=3)
    init = jax.eval_shape(lambda: GPT(cfg, SCAN).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    assert "h" in init and not any(key.startswith("h_") for key in init)
    params = random_params(cfg)
    want = jax.eval_shape(lambda: stack_layers(params))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), init) == jax.tree.map(lambda a: (a.shape, a.dtype), want)


@pytest.mark.parametrize("changes", [{}, {**RECIPE, "value_embeds": ((0, -1),), "unet_skips": True, "smear": True,
                                      "bigram_table": 8, "trigram_table": 8, "attn_gate": 4, "dense_skips": 4,
                                      "key_offset": True, "paired_heads": (0, 2), "n_layer": 4}],
                         ids=["gpt2", "every_switch"])
def test_a_seed_initialises_the_same_weights_in_either_layout(changes):
    """The layout is how the model runs: a run from scratch with scan_layers starts from the per-layer run's
    weights (the train state's params, as train.py initialises them), stacked."""
    from jaxgpt.optim import make_optimizer
    from jaxgpt.train.step import init_state

    cfg = tiny(**{"n_layer": 3, **changes})
    loop, scanned = (init_state(model, make_optimizer(TrainConfig(), param_layout(model)), 7).params
                     for model in (GPT(cfg), GPT(cfg, SCAN)))
    assert "h" in scanned and "h_0" in loop
    jax.tree.map(np.testing.assert_array_equal, scanned, stack_layers(loop))
    assert not np.array_equal(loop["h_0"]["attn"]["c_attn"]["kernel"], loop["h_1"]["attn"]["c_attn"]["kernel"])


def test_layouts_convert_both_ways_params_and_optimizer_state():
    cfg = tiny(n_layer=3)
    params = random_params(cfg)
    state = optax.adamw(1e-3).init(params)
    stacked = stack_layers(state)
    assert jax.tree.structure(stacked[0].mu) == jax.tree.structure(stack_layers(params))
    np.testing.assert_array_equal(stacked[0].mu["h"]["attn"]["c_attn"]["kernel"].shape[0], 3)
    jax.tree.map(np.testing.assert_array_equal, unstack_layers(stack_layers(params)), params)
    jax.tree.map(np.testing.assert_array_equal, layers_as(layers_as(params, True), False), params)


def test_stacked_blocks_shard_as_the_loops_with_the_layer_axis_whole():
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from jaxgpt import layout
    from jaxgpt.model import param_layout

    mesh = AbstractMesh((1, 2, 2), ("data", "fsdp", "tensor"))
    cfg = tiny(n_layer=3, n_head=4, d_model=16)
    loop = jax.tree_util.tree_flatten_with_path(param_layout(cfg)["h_0"], is_leaf=layout.is_declared)[0]
    stacked = dict(jax.tree_util.tree_flatten_with_path(param_layout(GPT(cfg, ComputeConfig(scan_layers=True)))["h"],
                                                        is_leaf=layout.is_declared)[0])
    specs = 0
    for path, leaf in loop:
        name = "/".join(k.key for k in path)
        spec = layout.spec(leaf, mesh)
        specs += spec != P()
        assert stacked[path].value.shape == (3, *leaf.value.shape), name
        assert layout.spec(stacked[path], mesh) == P(None, *spec), name
    assert specs >= 4  # the rules did place the matrices


def test_a_scanned_run_resumes_in_either_layout(tmp_path, corpus):  # noqa: F811
    """Stacked checkpoints resume stacked, and (a compute setting like any other) per layer."""
    from test_run import assert_trees_close, final_params, tiny_config

    from jaxgpt.train.run import train

    scanned = {"compute.scan_layers": True, "model.n_layer": 2}
    train(tiny_config(tmp_path, corpus, "split", **scanned, **{"train.steps": 3}))
    resumed = train(tiny_config(tmp_path, corpus, "split", **scanned, **{"train.steps": 5}))
    whole = train(tiny_config(tmp_path, corpus, "whole", **scanned, **{"train.steps": 8}))
    assert resumed["step"] == 5
    per_layer = train(tiny_config(tmp_path, corpus, "split", **{**scanned, "compute.scan_layers": False,
                                                                  "train.steps": 8}))
    assert per_layer["step"] == whole["step"] == 8
    assert_trees_close(final_params(tmp_path / "split"), final_params(tmp_path / "whole"), atol=1e-6)
