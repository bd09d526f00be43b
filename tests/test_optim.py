"""The learning-rate schedule against its formula, and which leaves AdamW decays."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import GPT, GPTConfig
from jaxgpt.config import TrainConfig
from jaxgpt.optim import learning_rate_schedule, make_optimizer, weight_decay_mask

TRAIN = dict(lr=1e-3, min_lr=1e-4, warmup_steps=100, steps=2000, b1=0.9, b2=0.99, weight_decay=0.1, clip=1.0)


def expected_lr(t, lr=1e-3, min_lr=1e-4, warmup=100, decay=2000):
    """The schedule written out: warmup lr·(t+1)/(w+1), then cosine from lr to min_lr."""
    if t < warmup:
        return lr * (t + 1) / (warmup + 1)
    if t > decay:
        return min_lr
    progress = (t - warmup) / (decay - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("t", [0, 1, 50, 99, 100, 101, 1050, 1999, 2000, 2500])
def test_schedule_values(t):
    schedule = learning_rate_schedule(TrainConfig(**TRAIN))
    assert float(schedule(t)) == pytest.approx(expected_lr(t), rel=1e-5)


def test_schedule_landmarks():
    schedule = learning_rate_schedule(TrainConfig(**TRAIN))
    assert float(schedule(0)) == pytest.approx(1e-3 / 101, rel=1e-5)  # step 0 already learns
    assert float(schedule(100)) == pytest.approx(1e-3, rel=1e-6)  # end of warmup: the peak
    assert float(schedule(1050)) == pytest.approx((1e-3 + 1e-4) / 2, rel=1e-5)  # mid-cosine: halfway
    assert float(schedule(2000)) == pytest.approx(1e-4, rel=1e-5)  # the end: the minimum


def test_schedule_decay_steps_must_exceed_warmup():
    with pytest.raises(ValueError, match=r"train.decay_steps=50 must exceed train.warmup_steps=100"):
        TrainConfig(**{**TRAIN, "decay_steps": 50})


@pytest.mark.parametrize("decay_embeddings", [True, False])
def test_decay_mask_covers_exactly_weight_matrices(decay_embeddings):
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=8, tie_embeddings=False)
    params = jax.eval_shape(lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    mask = weight_decay_mask(params, decay_embeddings)
    decayed = {"/".join(k.key for k in path) for path, v in jax.tree_util.tree_leaves_with_path(mask) if v}
    matrices = {f"h_{i}/{m}" for i in range(2) for m in
                ("attn/c_attn/kernel", "attn/c_proj/kernel", "mlp/c_fc/kernel", "mlp/c_proj/kernel")}
    matrices.add("lm_head/kernel")
    embeddings = {"wte/embedding", "wpe/embedding"} if decay_embeddings else set()
    assert decayed == matrices | embeddings


def test_adamw_decays_matrices_and_leaves_biases_alone():
    """With zero gradients Adam's step is zero, so only the decoupled decay moves a leaf:
    θ ← θ − lr·λ·θ for decayed leaves, θ unchanged for the rest."""
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=8)
    params = jax.jit(lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])()
    params = jax.tree.map(lambda p: p + 1.0, params)  # non-zero biases
    train = TrainConfig(**{**TRAIN, "warmup_steps": 0, "lr": 0.5, "weight_decay": 0.2})
    optimizer = make_optimizer(train)
    # jitted: one program, not one per operation and leaf
    updates, _ = jax.jit(lambda p: optimizer.update(jax.tree.map(jnp.zeros_like, p), optimizer.init(p), p))(params)
    lr0 = 0.5 / 1  # warmup 0: lr/(0+1)
    kernel = params["h_0"]["mlp"]["c_fc"]["kernel"]
    np.testing.assert_allclose(updates["h_0"]["mlp"]["c_fc"]["kernel"], -lr0 * 0.2 * kernel, rtol=1e-5)
    np.testing.assert_array_equal(updates["h_0"]["mlp"]["c_fc"]["bias"], 0.0)
    np.testing.assert_array_equal(updates["h_0"]["ln_1"]["scale"], 0.0)


@pytest.mark.parametrize("norm, clip", [(5.0, 0.5), (0.2, 0.5)])
def test_clipping_scales_gradients_to_the_global_norm_bound(norm, clip):
    """With ε far above |g|, Adam's first step is ≈ −lr·ĝ/ε, so the update shows the clipped
    gradient ĝ = g·min(1, c/‖g‖) directly (up to a relative error of ‖ĝ‖/ε)."""
    eps = 1e4
    train = TrainConfig(**{**TRAIN, "warmup_steps": 0, "lr": 1.0, "weight_decay": 0.0, "clip": clip, "eps": eps})
    optimizer = make_optimizer(train)
    params = {"w": jnp.zeros((3,)), "b": jnp.zeros((2,))}
    direction = np.array([3.0, 4.0, 0.0, 1.0, 2.0])
    g = direction / np.linalg.norm(direction) * norm
    grads = {"w": jnp.asarray(g[:3]), "b": jnp.asarray(g[3:])}
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    clipped = g * min(1.0, clip / norm)
    got = -np.concatenate([updates["w"], updates["b"]]) * eps
    np.testing.assert_allclose(got, clipped, rtol=1e-3)
