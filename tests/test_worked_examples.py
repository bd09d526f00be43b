"""The worked examples of the documents this project follows, computed by jaxgpt's own functions
against their exact values (where a document's number is wrong, the exact one is used)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxgpt import layout, ops
from jaxgpt.config import TrainConfig
from jaxgpt.optim import learning_rate_schedule, make_optimizer


def test_layer_norm_of_1_2_3_4():
    x = jnp.array([1.0, 2.0, 3.0, 4.0])
    np.testing.assert_allclose(ops.layer_norm(x, jnp.ones(4), jnp.zeros(4)), [-1.3416, -0.4472, 0.4472, 1.3416],
                               atol=5e-5)


def test_causal_masked_softmax_of_given_scores():
    """With k = I and q = scores·√3, QKᵀ/√d_k is the score matrix itself."""
    scores = jnp.array([[0.2, 0.1, 0.3], [0.1, 0.4, 0.2], [0.3, 0.2, 0.5]])
    q = (scores * math.sqrt(3.0))[None, :, None, :]
    k = jnp.eye(3)[None, :, None, :]
    weights = ops.attention_weights(q, k, mask=ops.causal_mask(3))[0, 0]
    np.testing.assert_allclose(weights[0], [1.0, 0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(weights[1], [0.426, 0.574, 0.0], atol=5e-4)
    np.testing.assert_allclose(weights[2], [0.3199, 0.2894, 0.3907], atol=5e-5)  # not [0.268, 0.263, 0.469]


def test_sinusoidal_positions():
    pe = ops.sinusoidal_positions(2, 512)
    np.testing.assert_allclose(pe[1, :2], [0.8415, 0.5403], atol=5e-5)
    np.testing.assert_allclose(ops.sinusoidal_positions(2, 8)[1],
                               [0.8415, 0.5403, 0.0998, 0.9950, 0.0100, 1.0000, 0.0010, 1.0000], atol=5e-5)


def test_global_norm_clipping():
    g = jnp.array([0.5, 0.8, 1.2])
    assert float(optax.tree.norm(g)) == pytest.approx(1.52643, abs=5e-6)
    clipped, _ = optax.clip_by_global_norm(1.0).update(g, optax.clip_by_global_norm(1.0).init(g))
    np.testing.assert_allclose(clipped, [0.3276, 0.5241, 0.7861], atol=5e-5)


def test_cosine_schedule_without_warmup():
    schedule = learning_rate_schedule(TrainConfig(lr=1e-3, min_lr=0.0, warmup_steps=0, steps=10000))
    assert float(schedule(2500)) == pytest.approx(8.5355e-4, rel=1e-4)
    assert float(schedule(7500)) == pytest.approx(1.4645e-4, rel=1e-4)


def test_two_adamw_steps_with_decoupled_decay():
    train = TrainConfig(lr=1e-3, min_lr=1e-3, warmup_steps=0, steps=10, b1=0.9, b2=0.999, eps=1e-8,
                        weight_decay=0.01, clip=0.0)
    theta = {"kernel": jnp.array(0.5)}
    matrix = layout.Declared(jax.ShapeDtypeStruct((), jnp.float32), (), group="matrix")  # so AdamW decays it
    optimizer = make_optimizer(train, {"kernel": matrix})
    state = optimizer.init(theta)
    for g in (0.3, -0.2):
        updates, state = optimizer.update({"kernel": jnp.array(g)}, state, theta)
        theta = optax.apply_updates(theta, updates)
        if g == 0.3:
            assert float(theta["kernel"]) == pytest.approx(0.498995, abs=5e-7)
    nu = optax.tree_utils.tree_get(state, "nu")["kernel"]
    assert float(nu) / (1 - 0.999**2) == pytest.approx(0.0649875, rel=1e-5)  # not 0.06496
    assert float(theta["kernel"]) == pytest.approx(0.4988455, abs=5e-7)


def test_perplexity_of_loss_2():
    assert float(ops.perplexity(2.0)) == pytest.approx(7.389, abs=5e-4)


def test_the_erf_gelu_gradient_falls_to_minus_0_1289_at_minus_root_2():
    x = jnp.linspace(-4.0, 4.0, 80001)
    slope = jax.vmap(jax.grad(ops.gelu_exact))(x)
    assert float(slope.min()) == pytest.approx(-0.1289, abs=5e-5)  # it does fall below 0.08: to −0.1289
    assert float(x[jnp.argmin(slope)]) == pytest.approx(-math.sqrt(2.0), abs=1e-3)
