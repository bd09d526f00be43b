"""The composed model: reference forward, causality, KV cache, sizes, variants, precision."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

from jaxgpt import GPT, ComputeConfig, GPTConfig, flops_per_token, init_cache, param_count

POSITIONS = ["learned", "sinusoidal", "rope", "alibi", "none"]
# configs/speedrun_*.py's model switches together: QK-norm, ReLU², soft-capped logits, zero-initialised
# output projections and an untied unembedding, on RoPE and RMSNorm without biases
RECIPE = {"qk_norm": True, "activation": "relu2", "logit_softcap": 3.0, "zero_init_out": True,
          "tie_embeddings": False, "positions": "rope", "norm": "rmsnorm", "bias": False}
VARIANTS = [
    {},
    *({"positions": p} for p in POSITIONS[1:]),
    {"norm_position": "post"},
    {"parallel_block": True},
    {"norm": "rmsnorm", "bias": False},
    {"activation": "gelu_exact"},
    {"activation": "relu"},
    {"activation": "swiglu", "d_ff": 24},
    {"activation": "geglu"},
    {"tie_embeddings": False},
    # issue #19's variants (tests/test_variants.py has their own invariants)
    {"n_head": 4, "n_kv_head": 2},
    {"n_head": 4, "n_kv_head": 1, "positions": "rope"},
    {"n_head": 4, "n_kv_head": 2, "positions": "alibi", "bias": False},
    {"head_dim": 12},
    {"head_dim": 6, "positions": "rope", "n_head": 4, "n_kv_head": 2},
    {"logits_bias": True},
    {"logits_bias": True, "tie_embeddings": False},
    {"activation": "silu"},
    {"activation": "glu"},
    {"ffn_layers": 3},
    {"ffn_layers": 2, "activation": "relu", "bias": False, "d_ff": 12},
    {"attention": "linear"},
    {"attention": "linear", "positions": "rope", "linear_feature": "relu", "n_head": 4, "n_kv_head": 2},
    {"attention": "linear", "positions": "none", "head_dim": 6},
    {"attention": "local", "window": 3},
    {"attention": "local", "window": 4, "positions": "rope", "n_head": 4, "n_kv_head": 2},
    # the modern recipe's switches, alone and together
    {"qk_norm": True},
    {"qk_norm": True, "positions": "rope", "n_head": 4, "n_kv_head": 2},
    {"activation": "relu2"},
    {"logit_softcap": 2.0},
    RECIPE,
]


DEFAULT = ComputeConfig()  # float32, the explicit kernel, per-layer blocks


def tiny(**changes):
    base = dict(vocab_size=23, block_size=16, n_layer=2, n_head=2, d_model=16)
    return GPTConfig(**{**base, **changes})


def init_params(cfg, seed=0):
    """GPT-2 initialisation, jitted: one compile instead of one per initialiser."""
    return jax.jit(lambda: GPT(cfg).init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"])()


@functools.cache
def random_params(cfg, seed=0):
    """Params of the model's shapes drawn at a scale that makes every term matter (non-zero
    biases, norm scales far from one), so a wrong term cannot hide. Drawn with NumPy from
    the abstract shapes: nothing to compile."""
    shapes = jax.eval_shape(lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        centre = 1.0 if path[-1].key == "scale" else 0.0
        return jnp.asarray(centre + 0.4 * rng.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


@functools.partial(jax.jit, static_argnums=0, static_argnames="compute")
def forward(cfg, params, x, cache=None, compute=DEFAULT):
    """The model applied op by op: each operation compiles once per shape for all the tests of a
    process, which costs less than a program per config (test_model.py: 100 s against 109 s)."""
    return GPT(cfg, compute).apply({"params": params}, x, cache)


def tokens(cfg, batch, length, seed=0):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, cfg.vocab_size)


@pytest.mark.parametrize("changes", VARIANTS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_forward_matches_float64_numpy_reference(changes):
    cfg = tiny(**changes)
    got, _ = matches_reference(cfg)
    assert got.shape == (2, 9, cfg.vocab_size) and got.dtype == jnp.float32


def matches_reference(cfg):
    """(the model's logits, the float64 reference's) of random params on 2 rows of 9 tokens, checked
    equal within 1e-4: what each switch's test of its forward pass asserts first."""
    params, x = random_params(cfg), tokens(cfg, 2, 9)
    got, want = forward(cfg, params, x), ref.gpt_forward(cfg, jax.device_get(params), np.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    return got, want


@pytest.mark.parametrize("changes", VARIANTS[1:], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_variants_differ_from_default(changes):
    default, variant = tiny(), tiny(**changes)
    x = tokens(default, 2, 9)
    a = forward(default, random_params(default), x)
    b = forward(variant, random_params(variant), x)
    assert b.shape == a.shape
    assert float(jnp.abs(a - b).max()) > 1e-4  # gelu_exact vs tanh gelu differ least: ~1e-3 here


CAUSAL = [{"positions": p} for p in POSITIONS] + [  # and issue #19's variants
    {"attention": "linear"}, {"attention": "linear", "positions": "rope"}, {"n_head": 4, "n_kv_head": 1},
    {"head_dim": 6, "logits_bias": True}, {"activation": "glu"}, {"ffn_layers": 3, "activation": "silu"},
    {"attention": "local", "window": 4}]


@pytest.mark.parametrize("changes", CAUSAL, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_causality(changes):
    cfg = tiny(**changes)
    model, params = GPT(cfg), random_params(cfg)
    T, j = 10, 6
    x = tokens(cfg, 1, T)
    changed = x.at[0, j].set((x[0, j] + 1) % cfg.vocab_size)
    a, b = forward(cfg, params, x), forward(cfg, params, changed)
    np.testing.assert_array_equal(np.asarray(a[:, :j]), np.asarray(b[:, :j]))
    assert float(jnp.abs(a[:, j:] - b[:, j:]).max()) > 1e-3

    # ∂ logits_i / ∂ X_j = 0 for every j > i, and not for j ≤ i
    perturbations = {"embeddings": jnp.zeros((1, T, cfg.d_model))}
    direction = jax.random.normal(jax.random.key(3), (cfg.vocab_size,))

    def projected_logits(pert):
        logits = model.apply({"params": params, "perturbations": pert}, x)
        return logits[0] @ direction  # (T,)

    jac = jax.jit(jax.jacrev(projected_logits))(perturbations)["embeddings"][:, 0]  # (T_out, T_in, d)
    size = np.abs(np.asarray(jac)).sum(-1)
    # position i reads j ≤ i; through n_layer windows of w (local), only i − j ≤ n_layer·(w − 1)
    reach = T if cfg.window is None else cfg.n_layer * (cfg.window - 1)
    distance = np.arange(T)[:, None] - np.arange(T)[None, :]
    seen = (distance >= 0) & (distance <= reach)
    assert (size[~seen] == 0).all()
    assert (size[seen] > 0).all()


def decode_step_by_step(cfg, params, x, prompt_length, max_length, compute=DEFAULT):
    """Prefill the prompt in one call, then feed the rest of x one position at a time."""
    cache = init_cache(cfg, x.shape[0], max_length)
    logits, cache = forward(cfg, params, x[:, :prompt_length], cache, compute=compute)
    outputs = [logits]
    for t in range(prompt_length, x.shape[1]):
        logits, cache = forward(cfg, params, x[:, t: t + 1], cache, compute=compute)
        outputs.append(logits)
    np.testing.assert_array_equal(np.asarray(cache.index), x.shape[1])
    return jnp.concatenate(outputs, axis=1)


def decodes_as_forward(cfg, prompt_lengths=(1, 5), compute=DEFAULT):
    """Check that a prefill of each prompt length and then one token at a time give the logits of one
    pass over 2 rows of 11 tokens, within 1e-5 (a cache of block_size slots: partly filled at the end)."""
    params, x = random_params(cfg), tokens(cfg, 2, 11)
    full = forward(cfg, params, x)
    for prompt_length in prompt_lengths:
        cached = decode_step_by_step(cfg, params, x, prompt_length, max_length=cfg.block_size, compute=compute)
        np.testing.assert_allclose(np.asarray(cached), np.asarray(full), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positions", POSITIONS)
def test_kv_cache_reproduces_full_forward(positions):
    decodes_as_forward(tiny(positions=positions), prompt_lengths=(1, 4, 11))


def continues_as_if_alone(cfg):
    """A padded prefill of two rows, then each row's index set to its true prompt length (the cache's
    slots past it stale): each row's next three steps give the logits of that row alone."""
    params, lengths, x = random_params(cfg), jnp.array([3, 6]), tokens(cfg, 2, 9)
    _, cache = forward(cfg, params, x[:, :6], init_cache(cfg, 2))
    cache = cache.replace(index=lengths)
    continuation = tokens(cfg, 2, 3, seed=5)
    steps = []
    for t in range(3):
        logits, cache = forward(cfg, params, continuation[:, t: t + 1], cache)
        steps.append(logits[:, 0])
    for row, n in enumerate(lengths.tolist()):
        alone = jnp.concatenate([x[row, :n], continuation[row]])[None]
        np.testing.assert_allclose(np.asarray(jnp.stack(steps, 1)[row]), np.asarray(forward(cfg, params, alone)[0, n:]),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positions", ["learned", "rope", "alibi"])
def test_kv_cache_rows_at_different_positions(positions):
    continues_as_if_alone(tiny(positions=positions))


@pytest.mark.parametrize("positions", ["learned", "alibi"])
def test_xla_attention_equals_explicit(positions):
    cfg, xla = tiny(positions=positions), ComputeConfig(kernel="xla")
    params = random_params(cfg)
    x = tokens(cfg, 2, 9)
    a, b = forward(cfg, params, x), forward(cfg, params, x, compute=xla)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-5)
    cached = decode_step_by_step(cfg, params, x, prompt_length=4, max_length=cfg.block_size, compute=xla)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(a), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positions", ["learned", "rope", "alibi"])
def test_blocked_attention_matches_float64_numpy_reference(positions):
    """150 positions = query blocks of 64, 64 and 22, each against the keys up to its end:
    the logits of the full causal attention (float64 NumPy) and the explicit model's gradients."""
    cfg, blocked = tiny(positions=positions, block_size=160), ComputeConfig(kernel="blocked")
    params = random_params(cfg)
    x = tokens(cfg, 2, 150)
    want = ref.gpt_forward(cfg, jax.device_get(params), np.asarray(x))
    np.testing.assert_allclose(np.asarray(forward(cfg, params, x, compute=blocked)), want, rtol=1e-4, atol=1e-4)

    def grads(compute):
        return jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(GPT(cfg, compute).apply({"params": p}, x)))))(params)

    for got, expected in zip(jax.tree.leaves(grads(blocked)), jax.tree.leaves(grads(ComputeConfig())), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def count(tree):
    return sum(leaf.size for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("activation", ["gelu", "gelu_exact", "relu", "swiglu", "geglu", "silu", "glu"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_param_count_closed_form_equals_pytree(activation, norm):
    for tie, bias, positions, parallel in [(True, True, "learned", False), (False, False, "rope", True),
                                           (True, False, "sinusoidal", False), (False, True, "alibi", True)]:
        cfg = tiny(activation=activation, norm=norm, tie_embeddings=tie, bias=bias, positions=positions,
                   parallel_block=parallel, d_ff=20)
        shapes = jax.eval_shape(lambda cfg=cfg: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
        assert param_count(cfg) == count(shapes["params"]), cfg
    for changes in [{"n_head": 4, "n_kv_head": 2}, {"n_head": 4, "n_kv_head": 1, "bias": False}, {"head_dim": 12},
                    {"head_dim": 6, "n_head": 4, "n_kv_head": 2}, {"logits_bias": True}, {"ffn_layers": 3},
                    {"ffn_layers": 2, "bias": False, "logits_bias": True, "tie_embeddings": False}]:
        if activation in ("swiglu", "geglu", "glu") and "ffn_layers" in changes:
            continue  # refused: a deep FFN needs an ungated activation
        cfg = tiny(activation=activation, norm=norm, d_ff=20, **changes)
        shapes = jax.eval_shape(lambda cfg=cfg: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
        assert param_count(cfg) == count(shapes["params"]), cfg


def test_param_count_gpt2_small_is_published_number():
    cfg = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, d_model=768)
    assert param_count(cfg) == 124_439_808
    shapes = jax.eval_shape(lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    assert count(shapes["params"]) == 124_439_808


def test_flops_per_token():
    cfg = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, d_model=768)
    matmul_params = 124_439_808 - 1024 * 768  # the position table is a lookup
    assert flops_per_token(cfg, 1024) == 6 * matmul_params + 12 * 12 * 768 * 1024
    untied = cfg.replace(tie_embeddings=False)
    assert flops_per_token(untied, 1024) == flops_per_token(cfg, 1024)  # the extra table is a lookup too


def test_gpt2_initialisation():
    cfg = tiny(n_layer=8, d_model=64, n_head=4, vocab_size=512)
    params = init_params(cfg)
    block = params["h_3"]
    assert np.std(params["wte"]["embedding"]) == pytest.approx(0.02, rel=0.05)
    assert np.std(block["mlp"]["c_fc"]["kernel"]) == pytest.approx(0.02, rel=0.05)
    residual_std = 0.02 / np.sqrt(2 * cfg.n_layer)
    assert np.std(block["mlp"]["c_proj"]["kernel"]) == pytest.approx(residual_std, rel=0.05)
    assert np.std(block["attn"]["c_proj"]["kernel"]) == pytest.approx(residual_std, rel=0.1)
    assert not np.asarray(block["attn"]["c_attn"]["bias"]).any()
    np.testing.assert_array_equal(block["ln_1"]["scale"], 1.0)


def test_jit_equals_eager():
    cfg = tiny()
    params, x = random_params(cfg), tokens(cfg, 2, 9)
    eager = GPT(cfg).apply({"params": params}, x)
    jitted = forward(cfg, params, x)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), atol=1e-5, rtol=1e-5)  # fusion reorders sums


def test_bfloat16_compute_with_float32_params():
    """bf16 has an 8-bit mantissa (relative step 2^-8 ≈ 0.4%); through two layers the logits
    stay within 5% of the float32 logits' scale."""
    cfg, bf16 = tiny(), ComputeConfig(dtype="bfloat16")
    params = random_params(cfg)
    x = tokens(cfg, 2, 9)
    a, b = forward(cfg, params, x), forward(cfg, params, x, compute=bf16)
    assert b.dtype == jnp.float32  # logits are returned in float32 for the loss
    init16 = jax.eval_shape(lambda: GPT(cfg, bf16).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(init16))
    assert float(jnp.abs(a - b).max()) <= 0.05 * float(jnp.abs(a).max())


def test_dropout_only_with_key_and_not_deterministic():
    cfg = tiny(dropout=0.3)
    params, x = random_params(cfg), tokens(cfg, 2, 9)

    @functools.partial(jax.jit, static_argnames="deterministic")
    def run(key=None, deterministic=True):
        rngs = {} if key is None else {"dropout": key}
        return GPT(cfg).apply({"params": params}, x, deterministic=deterministic, rngs=rngs)

    clean = run()
    np.testing.assert_array_equal(run(deterministic=False), clean)  # no key: no dropout
    np.testing.assert_array_equal(run(jax.random.key(1)), clean)  # deterministic: no dropout
    noisy = run(jax.random.key(1), deterministic=False)
    assert float(jnp.abs(noisy - clean).max()) > 1e-2
    np.testing.assert_array_equal(run(jax.random.key(1), deterministic=False), noisy)  # same key, same mask
    assert float(jnp.abs(run(jax.random.key(2), deterministic=False) - noisy).max()) > 1e-2


def test_cache_longer_than_block_is_refused():
    with pytest.raises(ValueError, match=r"max_length=17 must be in 1…block_size=16"):
        init_cache(tiny(), 1, 17)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_remat_gives_the_same_gradients(dropout):
    from jaxgpt.train.step import loss_fn

    cfg = tiny(dropout=dropout)
    params, x = random_params(cfg), tokens(cfg, 2, 12)
    key = jax.random.key(3) if dropout else None

    def grads(compute):
        return jax.jit(jax.grad(lambda p: loss_fn(GPT(cfg, compute), p, x, x, None, key)))(params)

    for a, b in zip(jax.tree.leaves(grads(ComputeConfig())), jax.tree.leaves(grads(ComputeConfig(remat=True))),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
