"""Each op against a float64 NumPy evaluation of its formula, written here independently."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

from jaxgpt import ops

SHAPES = [(1, 4, 1, 8), (2, 7, 3, 4), (3, 16, 4, 16)]  # (B, T, H, D)
TOL = dict(rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_attention_matches_numpy(rng, shape):
    q, k, v = (rng.standard_normal(shape) for _ in range(3))
    B, T, H, D = shape
    mask = np.tril(np.ones((T, T), bool))
    bias = rng.standard_normal((1, H, T, T))
    for m, b in [(None, None), (mask, None), (mask, bias)]:
        want = ref.attention(q, k, v, m, b)
        got = ops.attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)),
                            mask=None if m is None else jnp.asarray(m),
                            bias=None if b is None else jnp.asarray(b, jnp.float32))
        np.testing.assert_allclose(np.asarray(got), want, **TOL)


def test_attention_queries_and_keys_of_different_lengths(rng):
    q = rng.standard_normal((2, 3, 2, 4))
    k, v = rng.standard_normal((2, 5, 2, 4)), rng.standard_normal((2, 5, 2, 4))
    mask = np.arange(5)[None, :] <= np.array([2, 3, 4])[:, None]  # queries at positions 2, 3, 4
    want = ref.attention(q, k, v, mask)
    got = ops.attention(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
                        mask=ops.position_mask(jnp.array([2, 3, 4]), jnp.arange(5)))
    np.testing.assert_allclose(np.asarray(got), want, **TOL)


def test_causal_mask_is_lower_triangular():
    for n in (1, 2, 5, 9):
        np.testing.assert_array_equal(np.asarray(ops.causal_mask(n)), np.tril(np.ones((n, n), bool)))


@pytest.mark.parametrize("shape", SHAPES)
def test_causal_attention_weights_zero_in_future_and_rows_sum_to_one(rng, shape):
    q, k = (jnp.asarray(rng.standard_normal(shape) * 3, jnp.float32) for _ in range(2))
    T = shape[1]
    w = np.asarray(ops.attention_weights(q, k, mask=ops.causal_mask(T)))
    future = ~np.tril(np.ones((T, T), bool))
    assert (w[..., future] == 0.0).all()  # exactly zero, not merely small
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    assert (w[..., ~future] > 0).all()


@pytest.mark.parametrize("shape", [(5,), (3, 8), (2, 4, 32)])
def test_layer_norm(rng, shape):
    x = rng.standard_normal(shape) * 4 + 3
    d = shape[-1]
    scale, bias = rng.standard_normal(d), rng.standard_normal(d)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)  # biased variance
    normed = (x - mean) / np.sqrt(var + 1e-5)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    got = np.asarray(ops.layer_norm(f32(x), f32(scale), f32(bias), eps=1e-5))
    np.testing.assert_allclose(got, scale * normed + bias, rtol=1e-4, atol=1e-5)
    # before scale and shift: mean 0 and variance 1
    plain = np.asarray(ops.layer_norm(f32(x), jnp.ones(d), None, eps=1e-5), np.float64)
    np.testing.assert_allclose(plain.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(plain.var(-1), 1.0, rtol=1e-3)


@pytest.mark.parametrize("shape", [(6,), (3, 8), (2, 4, 32)])
def test_rms_norm(rng, shape):
    x = rng.standard_normal(shape) * 2 + 1
    scale = rng.standard_normal(shape[-1])
    want = scale * x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)
    got = ops.rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(scale, jnp.float32), eps=1e-6)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(7,), (3, 10), (2, 3, 16)])
def test_activations(rng, shape):
    x = rng.standard_normal(shape) * 3
    a, b = x[..., : shape[-1] // 2], x[..., shape[-1] // 2:]
    gated = {} if shape[-1] % 2 else {"swiglu": ref.silu(a) * b, "geglu": ref.gelu_tanh(a) * b,
                                      "glu": b / (1 + np.exp(-a))}
    want = {"gelu": ref.gelu_tanh(x), "gelu_exact": ref.gelu_exact(x), "relu": np.maximum(x, 0),
            "silu": x / (1 + np.exp(-x)), **gated}
    for name, expected in want.items():
        got = np.asarray(ops.ACTIVATIONS[name](jnp.asarray(x, jnp.float32)))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("n,d", [(1, 2), (7, 4), (50, 16), (128, 64)])
def test_sinusoidal_positions_element_by_element(n, d):
    pe = np.asarray(ops.sinusoidal_positions(n, d))
    assert pe.shape == (n, d)
    for i in range(n):
        for j in range(d // 2):
            angle = i / 10000 ** (2 * j / d)
            assert pe[i, 2 * j] == pytest.approx(math.sin(angle), abs=2e-5)
            assert pe[i, 2 * j + 1] == pytest.approx(math.cos(angle), abs=2e-5)


@pytest.mark.parametrize("rope", [ops.rope, ops.rope_pairs, ops.rope_lanes])
@pytest.mark.parametrize("shape", [(1, 5, 2, 4), (2, 6, 3, 8)])
def test_rope(rng, shape, rope):
    x = rng.standard_normal(shape)
    positions = rng.integers(0, 100, size=shape[:2])
    got = rope(jnp.asarray(x, jnp.float32), jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(got), ref.rope(x, positions), rtol=1e-4, atol=1e-4)


def test_rope_by_lanes_equals_rope_by_pairs_in_bfloat16_and_in_its_gradient(rng):
    """The TPU's and GPU's form swaps each pair by a permutation matmul: exact in bfloat16, and its gradient
    is the pairs' (the CPU's form)."""
    x = jnp.asarray(rng.standard_normal((2, 7, 3, 16)), jnp.bfloat16)
    positions = jnp.asarray(rng.integers(0, 1000, size=(2, 7)))
    np.testing.assert_array_equal(np.asarray(ops.rope_lanes(x, positions), np.float32),
                                  np.asarray(ops.rope_pairs(x, positions), np.float32))
    weights = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    grads = [jax.grad(lambda x, f=f: (f(x, positions) * weights).sum())(x.astype(jnp.float32))
             for f in (ops.rope_lanes, ops.rope_pairs)]
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(grads[1]), rtol=1e-6, atol=1e-6)


def test_rope_scores_depend_only_on_relative_position(rng):
    q, k = rng.standard_normal((1, 1, 1, 8)), rng.standard_normal((1, 1, 1, 8))
    q, k = jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32)

    def score(i, j):
        return float((ops.rope(q, jnp.array([[i]])) * ops.rope(k, jnp.array([[j]]))).sum())

    assert score(7, 3) == pytest.approx(score(24, 20), rel=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 5), rel=1e-3)


@pytest.mark.parametrize("n_head", [1, 4, 6, 8, 12])
def test_alibi_bias(n_head):
    n = 6
    slopes = ref.alibi_slopes(n_head)
    bias = np.asarray(ops.alibi_bias(n_head, n))
    assert bias.shape == (n_head, n, n)
    for h in range(n_head):
        for i in range(n):
            for j in range(n):
                assert bias[h, i, j] == pytest.approx(-slopes[h] * (i - j), abs=1e-6)


@pytest.mark.parametrize("shape", [(5, 7), (2, 6, 11), (3, 4, 50)])
def test_cross_entropy_and_perplexity(rng, shape):
    logits = rng.standard_normal(shape) * 3
    targets = rng.integers(0, shape[-1], size=shape[:-1])
    mask = rng.random(shape[:-1]) < 0.6
    mask.flat[0] = True
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    f32 = jnp.asarray(logits, jnp.float32)
    loss = ops.cross_entropy(f32, jnp.asarray(targets))
    np.testing.assert_allclose(float(loss), nll.mean(), rtol=1e-5)
    masked = ops.cross_entropy(f32, jnp.asarray(targets), jnp.asarray(mask))
    np.testing.assert_allclose(float(masked), nll[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(ops.perplexity(masked)), np.exp(nll[mask].mean()), rtol=1e-5)


def test_cross_entropy_of_uniform_logits_is_log_vocab():
    V = 37
    loss = ops.cross_entropy(jnp.zeros((4, 9, V)), jnp.zeros((4, 9), jnp.int32))
    assert float(loss) == pytest.approx(math.log(V), rel=1e-6)
    assert float(ops.perplexity(loss)) == pytest.approx(V, rel=1e-5)


@pytest.mark.parametrize("rate", [0.1, 0.2, 0.5])
def test_dropout_zeroes_a_fraction_p_and_scales_the_rest(rate):
    import jax

    x = jnp.ones((64, 1000))
    y = np.asarray(ops.dropout(x, rate, jax.random.key(0)))
    n = y.size
    dropped = (y == 0).mean()
    assert abs(dropped - rate) < 5 * math.sqrt(rate * (1 - rate) / n)  # within 5 binomial standard deviations
    np.testing.assert_allclose(y[y != 0], 1 / (1 - rate), rtol=1e-6)  # E[y] = x
    rows = (y == 0).mean(axis=1)  # no position is favoured
    assert rows.std() < 4 * math.sqrt(rate * (1 - rate) / 1000)
    again = np.asarray(ops.dropout(x, rate, jax.random.key(0)))
    other = np.asarray(ops.dropout(x, rate, jax.random.key(1)))
    np.testing.assert_array_equal(y, again)
    assert (y != other).mean() > rate * (1 - rate)
    np.testing.assert_array_equal(np.asarray(ops.dropout(x, 0.0, jax.random.key(0))), 1.0)


def test_dropout_masks_are_uncorrelated_along_every_axis_and_across_keys():
    """Neighbours along every axis, and the same element under another key, are dropped
    independently (correlations within 5 standard errors of 0)."""
    import jax

    x = jnp.ones((16, 8, 32, 32))
    kept = np.asarray(ops.dropout(x, 0.5, jax.random.key(3))) != 0
    n = kept.size
    assert abs(kept.mean() - 0.5) < 5 * math.sqrt(0.25 / n)
    for axis in range(kept.ndim):
        a, b = np.moveaxis(kept, axis, 0)[:-1].ravel(), np.moveaxis(kept, axis, 0)[1:].ravel()
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(a.size), axis
    other = np.asarray(ops.dropout(x, 0.5, jax.random.key(4))) != 0
    assert abs(np.corrcoef(kept.ravel(), other.ravel())[0, 1]) < 5 / math.sqrt(n)


DROPOUT_ON_EIGHT_DEVICES = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxgpt import ops
x = jnp.arange(1.0, 1.0 + 16 * 8 * 32).reshape(16, 8, 32)
key = jax.random.key(7)
drop = jax.jit(lambda x, key: ops.dropout(x, 0.3, key))
whole = np.asarray(drop(x, key))
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
for spec in (P("a", None, "b"), P(None, ("a", "b"), None), P(None, None, ("a", "b"))):
    sharded = jax.device_put(x, NamedSharding(mesh, spec))
    np.testing.assert_array_equal(np.asarray(drop(sharded, key)), whole)
    program = drop.lower(sharded, key).compile().as_text()
    collectives = [op for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute") if op in program]
    assert not collectives, (spec, collectives)
print("ok")
"""


def test_dropout_mask_is_the_same_sharded_over_eight_devices_and_drawn_shard_by_shard():
    """On 8 fake CPU devices, x sharded three ways gets the mask it gets on one device, and
    the compiled program has no collective: each device draws the bits of its own shard."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", DROPOUT_ON_EIGHT_DEVICES], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.parametrize("shape", [(7, 5), (2, 6, 8)])
def test_linear_and_its_gradients(rng, shape):
    """y = xW; ∂(Σ y⊙g)/∂x = g Wᵀ and /∂W = Σ_positions xᵀ g, against float64 NumPy."""
    import jax

    x, w = rng.standard_normal(shape), rng.standard_normal((shape[-1], 3))
    g = rng.standard_normal((*shape[:-1], 3))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    np.testing.assert_allclose(np.asarray(ops.linear(f32(x), f32(w))), x @ w, rtol=1e-5, atol=1e-5)
    dx, dw = jax.grad(lambda x, w: (ops.linear(x, w) * f32(g)).sum(), argnums=(0, 1))(f32(x), f32(w))
    np.testing.assert_allclose(np.asarray(dx), g @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), x.reshape(-1, shape[-1]).T @ g.reshape(-1, 3), rtol=1e-5, atol=1e-5)


# (lhs shape, rhs shape, dimension numbers): the plain contractions y = x W that a CPU
# computes with its own gradient, and others that go to jax.lax.dot_general everywhere
DOT_GENERAL_CASES = [
    ((2, 6, 8), (8, 3), (((2,), (0,)), ((), ())), True),
    ((2, 3, 4, 5), (4, 5, 6), (((2, 3), (0, 1)), ((), ())), True),
    ((5, 4), (4, 2, 3), (((1,), (0,)), ((), ())), True),
    ((6, 8), (3, 8), (((1,), (1,)), ((), ())), False),
    ((3, 4, 5), (5, 4, 2), (((2, 1), (0, 1)), ((), ())), False),
    ((2, 6, 8), (2, 8, 3), (((2,), (1,)), ((0,), (0,))), False),
]


@pytest.mark.parametrize(("lhs_shape", "rhs_shape", "dims", "plain"), DOT_GENERAL_CASES)
def test_dot_general_and_its_gradients_equal_lax_dot_general_in_float64(rng, lhs_shape, rhs_shape, dims, plain):
    import jax

    with jax.enable_x64(True):
        lhs, rhs = jnp.asarray(rng.standard_normal(lhs_shape)), jnp.asarray(rng.standard_normal(rhs_shape))
        want = jax.lax.dot_general(lhs, rhs, dims)
        g = jnp.asarray(rng.standard_normal(want.shape))

        def loss(dot):
            return lambda lhs, rhs: (dot(lhs, rhs, dims) * g).sum()

        got = ops.dot_general(lhs, rhs, dims)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)
        grad = jax.jit(jax.grad(loss(ops.dot_general), argnums=(0, 1)))
        for got_grad, want_grad in zip(grad(lhs, rhs), jax.grad(loss(jax.lax.dot_general), argnums=(0, 1))(lhs, rhs),
                                       strict=True):
            np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad), rtol=1e-12, atol=1e-12)
        assert ("optimization_barrier" in grad.lower(lhs, rhs).as_text()) == plain  # the CPU's gradient, or XLA's


def test_dot_general_keeps_precision_and_the_preferred_element_type(rng):
    """bfloat16 operands with a float32 result, as lax.dot_general gives them; the gradients
    in the operands' dtype, within bfloat16 rounding of lax.dot_general's."""
    import jax

    lhs = jnp.asarray(rng.standard_normal((3, 5, 16)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((16, 4)), jnp.bfloat16)
    dims = (((2,), (0,)), ((), ()))
    options = dict(precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    got, want = ops.dot_general(lhs, rhs, dims, **options), jax.lax.dot_general(lhs, rhs, dims, **options)
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)

    def grads(dot):
        return jax.grad(lambda lhs, rhs: dot(lhs, rhs, dims, **options).sum(), argnums=(0, 1))(lhs, rhs)

    for got_grad, want_grad in zip(grads(ops.dot_general), grads(jax.lax.dot_general), strict=True):
        assert got_grad.dtype == want_grad.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got_grad, np.float32), np.asarray(want_grad, np.float32), rtol=1e-2,
                                   atol=1e-2)


def test_flax_dense_general_computes_with_dot_general(rng):
    """nn.DenseGeneral(dot_general=ops.dot_general) over two input axes: the outputs and
    gradients of Flax's own."""
    import flax.linen as nn
    import jax

    x = jnp.asarray(rng.standard_normal((2, 3, 4, 5)), jnp.float32)
    ours, flax_own = (nn.DenseGeneral((2, 3), axis=(-2, -1), dot_general=dot) for dot in (ops.dot_general, None))
    params = flax_own.init(jax.random.key(0), x)

    def loss(module):
        return lambda params, x: jnp.sin(module.apply(params, x)).sum()

    np.testing.assert_allclose(np.asarray(ours.apply(params, x)), np.asarray(flax_own.apply(params, x)), rtol=1e-6,
                               atol=1e-6)
    ours_grad = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))
    for got, want in zip(jax.tree.leaves(ours_grad(params, x)),
                         jax.tree.leaves(jax.grad(loss(flax_own), argnums=(0, 1))(params, x)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert "optimization_barrier" in ours_grad.lower(params, x).as_text()  # the CPU's own gradient ran


@pytest.mark.parametrize("platform", ["cpu", "cuda", "rocm", "tpu"])
def test_dot_general_has_its_cpu_gradient_only_in_a_program_lowered_for_a_cpu(platform):
    """The barrier of the CPU's gradient is in the CPU's program only; a GPU's or TPU's,
    lowered here on a CPU host, is XLA's own dot_general and gradient."""
    import jax

    x, w = jnp.ones((2, 6, 8)), jnp.ones((8, 3))
    step = jax.jit(jax.value_and_grad(lambda x, w: jnp.tanh(ops.linear(x, w)).sum(), argnums=(0, 1)))
    program = step.trace(x, w).lower(lowering_platforms=(platform,)).as_text()
    assert "stablehlo.dot_general" in program
    assert ("optimization_barrier" in program) == (platform == "cpu")
