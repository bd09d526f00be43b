"""Each op against a float64 NumPy evaluation of its formula, written here independently."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from processes import xla_flags

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


@pytest.mark.parametrize("shape", [(1, 5, 2, 4), (2, 6, 3, 8)])
def test_rope(rng, shape):
    """ops.rope; its other forms are tests/test_forms.py's."""
    x = rng.standard_normal(shape)
    positions = rng.integers(0, 100, size=shape[:2])
    got = ops.rope(jnp.asarray(x, jnp.float32), jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(got), ref.rope(x, positions), rtol=1e-4, atol=1e-4)


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
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "PYTHONPATH": str(root)}
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
