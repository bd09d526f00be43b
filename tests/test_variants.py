"""Issue #19's model variants: grouped-query attention, head_dim, the logits bias, the FFN forms
and the initialisations. The float64 reference forward of each is in test_model.VARIANTS; here
the invariants of each: decode equals forward, shapes, equivalences, the init formulas."""

import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from processes import xla_flags
from test_model import (
    RECIPE,
    decodes_as_forward,
    forward,
    init_params,
    random_params,
    tiny,
    tokens,
)

from jaxgpt import GPT, ComputeConfig, GPTConfig, flops_per_token, init_cache, layout
from jaxgpt.model import param_layout
from jaxgpt.registries import check_model

CACHED = [
    {"n_head": 4, "n_kv_head": 2},
    {"n_head": 4, "n_kv_head": 1, "positions": "rope"},
    {"n_head": 4, "n_kv_head": 2, "positions": "alibi"},
    {"n_head": 4, "n_kv_head": 1, "kernel": "xla"},  # a compute setting: the fused kernel
    {"n_head": 4, "n_kv_head": 2, "attention": "local", "window": 3},
    {"head_dim": 12, "positions": "rope"},
    {"logits_bias": True},
    {"ffn_layers": 3, "activation": "silu"},
    {"activation": "glu"},
    {"attention": "linear"},
    {"attention": "linear", "positions": "rope", "linear_feature": "relu", "n_head": 4, "n_kv_head": 2},
    {**RECIPE, "n_head": 4, "n_kv_head": 2},
]


def name(changes):
    return ",".join(f"{k}={v}" for k, v in changes.items())


@pytest.mark.parametrize("changes", CACHED, ids=name)
def test_kv_cache_reproduces_full_forward(changes):
    changes = dict(changes)
    compute = ComputeConfig(kernel=changes.pop("kernel", "explicit"))
    decodes_as_forward(tiny(**changes), compute=compute)


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_kv_cache_holds_n_kv_head_heads(n_kv_head):
    cfg = tiny(n_head=4, n_kv_head=n_kv_head, head_dim=6)
    cache = init_cache(cfg, 3, 10)
    assert all(k.shape == (3, 10, n_kv_head, 6) for k in cache.keys + cache.values)
    _, cache = forward(cfg, random_params(cfg), tokens(cfg, 3, 4), cache)
    assert all(k.shape == (3, 10, n_kv_head, 6) for k in cache.keys + cache.values)
    mha_bytes = 2 * cfg.n_layer * 3 * 10 * 4 * 6 * 4  # K and V, layers, rows, slots, heads, D, float32
    assert sum(k.nbytes for k in cache.keys + cache.values) * (4 // n_kv_head) == mha_bytes


def test_multi_head_layout_is_gpt2s():
    cfg = tiny(n_head=4)
    assert cfg.n_kv_head == 4 and cfg.head_dim == 4
    attn = jax.eval_shape(lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32)))["params"]["h_0"]
    assert set(attn["attn"]) == {"c_attn", "c_proj"}
    assert attn["attn"]["c_attn"]["kernel"].shape == (16, 3, 4, 4)
    grouped = tiny(n_head=4, n_kv_head=2, head_dim=6)
    attn = jax.eval_shape(lambda: GPT(grouped).init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32)))["params"]
    attn = attn["h_0"]["attn"]
    assert {k: v["kernel"].shape for k, v in attn.items()} == {
        "q_proj": (16, 4, 6), "kv_proj": (16, 2, 2, 6), "c_proj": (4, 6, 16)}


@pytest.mark.parametrize("positions", ["learned", "rope", "alibi"])
def test_grouped_query_with_duplicated_heads_equals_multi_head(positions):
    """A GQA model equals the MHA model whose K and V heads repeat each of its kv heads for the
    query heads of its group (query head h reads kv head ⌊h/2⌋ here)."""
    gqa = tiny(n_head=4, n_kv_head=2, positions=positions)
    mha = gqa.replace(n_kv_head=4)
    params = random_params(gqa)
    converted = jax.tree.map(lambda a: a, params)
    for layer in range(gqa.n_layer):
        attn = params[f"h_{layer}"]["attn"]
        kv_kernel = np.repeat(np.asarray(attn["kv_proj"]["kernel"]), 2, axis=2)  # (d, 2, H, D)
        kv_bias = np.repeat(np.asarray(attn["kv_proj"]["bias"]), 2, axis=1)  # (2, H, D)
        converted[f"h_{layer}"]["attn"] = {
            "c_attn": {"kernel": np.concatenate([np.asarray(attn["q_proj"]["kernel"])[:, None], kv_kernel], 1),
                       "bias": np.concatenate([np.asarray(attn["q_proj"]["bias"])[None], kv_bias], 0)},
            "c_proj": attn["c_proj"]}
    x = tokens(gqa, 2, 9)
    np.testing.assert_allclose(np.asarray(forward(mha, converted, x)), np.asarray(forward(gqa, params, x)),
                               atol=1e-5, rtol=1e-5)


def test_head_dim_sets_the_attention_flops():
    cfg = tiny(head_dim=12, n_head=4)
    # QKᵀ and AV: 2·2·n_head·head_dim FLOPs per key, forward; ×3 with the backward pass
    per_key = 12 * cfg.n_layer * 4 * 12
    assert flops_per_token(cfg, 9) - flops_per_token(cfg, 4) == 5 * per_key


@pytest.mark.parametrize("changes, message", [
    (dict(n_head=4, n_kv_head=3), r"n_kv_head=3 does not divide n_head=4"),
    (dict(n_head=4, n_kv_head=0), r"n_kv_head=0: must be a positive integer"),
    (dict(head_dim=5, positions="rope"), r"needs an even head size, but head_dim = 5"),
    (dict(head_dim=0), r"head_dim=0: must be a positive integer"),
    (dict(ffn_layers=2, activation="swiglu"), r"ffn_layers=2 with the gated activation 'swiglu'"),
    (dict(ffn_layers=0), r"ffn_layers=0: must be a positive integer"),
    (dict(ffn_dropout=1.0), r"ffn_dropout=1.0: must be in \[0, 1\)"),
    (dict(logits_bias=1), r"logits_bias=1: must be True or False"),
    (dict(init="xavier"), r"init='xavier': must be one of gpt2, he, small"),
    (dict(attention="linear", positions="alibi"), r"attention='linear' with positions='alibi'"),
    (dict(attention="linear", linear_feature="softmax"), r"linear_feature='softmax': must be one of elu\+1, relu"),
])
def test_impossible_variants_raise(changes, message):
    """Refused where the config is opened: the schema's own checks, the registries' names and what each
    form and scheme can serve (registries.check_model)."""
    with pytest.raises(ValueError, match=message):
        check_model(tiny(**changes))


def test_head_dim_frees_d_model_from_n_head():
    cfg = GPTConfig(d_model=18, n_head=4, head_dim=5, vocab_size=11, block_size=8, n_layer=1)
    assert cfg.head_dim == 5
    x = tokens(cfg, 1, 6)
    assert forward(cfg, random_params(cfg), x).shape == (1, 6, 11)


def test_ffn_dropout_drops_only_when_asked():
    cfg = tiny(ffn_dropout=0.5)
    params, x = random_params(cfg), tokens(cfg, 2, 9)

    def run(key=None):
        rngs = {} if key is None else {"dropout": key}
        return jax.jit(lambda: GPT(cfg).apply({"params": params}, x, deterministic=key is None, rngs=rngs))()

    clean = run()
    same_model_without_dropout = forward(tiny(), params, x)
    np.testing.assert_allclose(clean, same_model_without_dropout, atol=1e-5, rtol=1e-5)
    noisy = run(jax.random.key(1))
    assert float(jnp.abs(noisy - clean).max()) > 1e-2
    np.testing.assert_array_equal(run(jax.random.key(1)), noisy)


def std_of(tree):
    return float(np.std(np.asarray(tree)))


@pytest.mark.parametrize("init", ["gpt2", "he", "small"])
def test_initialisation_stds(init):
    L, d, f = 8, 128, 512
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=L, n_head=4, d_model=d, d_ff=f, ffn_layers=2,
                    tie_embeddings=False, init=init)
    params = init_params(cfg)
    block = params["h_3"]
    fan_in = {"c_attn": d, "attn_proj": d, "c_fc": d, "c_fc_2": f, "mlp_proj": f, "lm_head": d}
    residual = {"attn_proj", "mlp_proj"}

    def want(name):
        if init == "he":
            return math.sqrt(2 / fan_in[name])
        base = 0.02 if init == "gpt2" else math.sqrt(2 / (5 * d))
        return base / math.sqrt(2 * L) if name in residual else base

    got = {"c_attn": block["attn"]["c_attn"]["kernel"], "attn_proj": block["attn"]["c_proj"]["kernel"],
           "c_fc": block["mlp"]["c_fc"]["kernel"], "c_fc_2": block["mlp"]["c_fc_2"]["kernel"],
           "mlp_proj": block["mlp"]["c_proj"]["kernel"], "lm_head": params["lm_head"]["kernel"]}
    for key, matrix in got.items():
        assert std_of(matrix) == pytest.approx(want(key), rel=0.05), key
    embedding = math.sqrt(2 / (5 * d)) if init == "small" else 0.02
    assert std_of(params["wte"]["embedding"]) == pytest.approx(embedding, rel=0.05)
    assert std_of(params["wpe"]["embedding"]) == pytest.approx(embedding, rel=0.05)


def test_logits_bias_starts_at_zero_and_adds_to_every_position():
    cfg = tiny(logits_bias=True)
    assert not np.asarray(init_params(cfg)["logits_bias"]).any()
    params = random_params(cfg)
    without = {k: v for k, v in params.items() if k != "logits_bias"}
    x = tokens(cfg, 2, 5)
    got = forward(cfg, params, x) - forward(tiny(), without, x)
    np.testing.assert_allclose(np.asarray(got), np.broadcast_to(params["logits_bias"], got.shape), atol=1e-5)


MESH = AbstractMesh((1, 1, 2), ("data", "fsdp", "tensor"))


def attention_layout(n_kv_head: int, n_head: int = 4) -> dict:
    """The declarations of h_0's attention: d 16, n_head query heads, n_kv_head key/value heads, head_dim 8."""
    declared = param_layout(tiny(n_head=n_head, n_kv_head=n_kv_head, head_dim=8))["h_0"]["attn"]
    assert declared["kv_proj"]["kernel"].value.shape == (16, 2, n_kv_head, 8)
    assert declared["q_proj"]["kernel"].value.shape == (16, n_head, 8)
    return declared


def test_grouped_query_params_split_over_the_tensor_axis():
    attn = attention_layout(n_kv_head=2)
    assert layout.spec(attn["kv_proj"]["kernel"], MESH) == P(None, None, "tensor", None)
    assert layout.spec(attn["kv_proj"]["bias"], MESH) == P(None, "tensor", None)
    assert layout.spec(attn["q_proj"]["kernel"], MESH) == P(None, "tensor", None)
    assert layout.spec(attention_layout(n_kv_head=1)["kv_proj"]["kernel"], AbstractMesh((2, 1, 1), MESH.axis_names)) \
        == P(None, None, None, None)
    # one key/value head (multi-query attention) is whole on every device, the query heads still split
    multi_query = attention_layout(n_kv_head=1)
    assert layout.spec(multi_query["kv_proj"]["kernel"], MESH) == P(None, None, None, None)
    assert layout.spec(multi_query["q_proj"]["kernel"], MESH) == P(None, "tensor", None)


def test_kv_heads_that_do_not_split_over_the_tensor_axis_are_refused():
    with pytest.raises(ValueError, match=r"^kv_heads=3 is not divisible by the mesh's tensor axis \(2\): choose a "
                                         r"multiple of mesh.tensor, or a mesh.tensor that divides it$") as raised:
        layout.spec(attention_layout(n_kv_head=3, n_head=6)["kv_proj"]["kernel"], MESH)
    assert "\n" not in str(raised.value)


GQA_ON_TWO_DEVICES = """
import jax, jax.numpy as jnp, numpy as np
from jaxgpt import GPT, GPTConfig, layout
from jaxgpt.model import param_layout
from jaxgpt.sharding import make_mesh
cfg = GPTConfig(vocab_size=23, block_size=16, n_layer=2, n_head=4, n_kv_head=2, d_model=16)
params = GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 2})
shardings = layout.param_shardings(param_layout(cfg), mesh)
assert shardings["h_0"]["attn"]["kv_proj"]["kernel"].spec[2] == "tensor"
x = jax.random.randint(jax.random.key(1), (2, 9), 0, 23)
apply = jax.jit(lambda p: GPT(cfg).apply({"params": p}, x))
sharded = apply(jax.device_put(params, shardings))
np.testing.assert_allclose(np.asarray(sharded), np.asarray(apply(params)), atol=1e-5, rtol=1e-5)
print("ok")
"""


def test_grouped_query_attention_runs_tensor_parallel():
    """On 2 fake CPU devices, K and V heads split over the tensor axis: the same logits."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "XLA_FLAGS": xla_flags(2), "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", GQA_ON_TWO_DEVICES], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
