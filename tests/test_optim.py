"""The learning-rate schedules against their formulas, the parameter groups and their rates, which
leaves AdamW decays, and the one-line errors of the optimizer's settings."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxgpt import GPT, GPTConfig, layout
from jaxgpt.config import TrainConfig
from jaxgpt.model import param_layout
from jaxgpt.optim import learning_rate_schedule, make_optimizer

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
    mask = layout.decay_mask(param_layout(cfg), decay_embeddings)
    decayed = {"/".join(k.key for k in path) for path, v in jax.tree_util.tree_leaves_with_path(mask) if v}
    matrices = {f"h_{i}/{m}" for i in range(2) for m in
                ("attn/c_attn/kernel", "attn/c_proj/kernel", "mlp/c_fc/kernel", "mlp/c_proj/kernel")}
    matrices.add("lm_head/kernel")
    embeddings = {"wte/embedding", "wpe/embedding"} if decay_embeddings else set()
    assert decayed == matrices | embeddings


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_adamw_decays_matrices_and_leaves_biases_alone(optimizer):
    """With zero gradients Adam's step is zero (and Muon's: the orthogonalisation of a zero
    momentum is zero), so only the decoupled decay moves a leaf: θ ← θ − lr·λ·θ for decayed
    leaves, θ unchanged for the rest."""
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=8)
    params = jax.jit(lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])()
    params = jax.tree.map(lambda p: p + 1.0, params)  # non-zero biases
    train = TrainConfig(**{**TRAIN, "optimizer": optimizer, "warmup_steps": 0, "lr": 0.5, "weight_decay": 0.2})
    optimizer = make_optimizer(train, param_layout(cfg))
    # jitted: one program, not one per operation and leaf
    updates, _ = jax.jit(lambda p: optimizer.update(jax.tree.map(jnp.zeros_like, p), optimizer.init(p), p))(params)
    lr0 = 0.5 / 1  # warmup 0: lr/(0+1)
    kernel = params["h_0"]["mlp"]["c_fc"]["kernel"]
    np.testing.assert_allclose(updates["h_0"]["mlp"]["c_fc"]["kernel"], -lr0 * 0.2 * kernel, rtol=1e-5)
    np.testing.assert_allclose(updates["wte"]["embedding"], -lr0 * 0.2 * params["wte"]["embedding"], rtol=1e-5)
    np.testing.assert_array_equal(updates["h_0"]["mlp"]["c_fc"]["bias"], 0.0)
    np.testing.assert_array_equal(updates["h_0"]["ln_1"]["scale"], 0.0)


@pytest.mark.parametrize("norm, clip", [(5.0, 0.5), (0.2, 0.5)])
def test_clipping_scales_gradients_to_the_global_norm_bound(norm, clip):
    """With ε far above |g|, Adam's first step is ≈ −lr·ĝ/ε, so the update shows the clipped
    gradient ĝ = g·min(1, c/‖g‖) directly (up to a relative error of ‖ĝ‖/ε)."""
    eps = 1e4
    train = TrainConfig(**{**TRAIN, "warmup_steps": 0, "lr": 1.0, "weight_decay": 0.0, "clip": clip, "eps": eps})
    params = {"w": jnp.zeros((3,)), "b": jnp.zeros((2,))}
    declared = jax.tree.map(lambda p: layout.Declared(jax.ShapeDtypeStruct(p.shape, p.dtype), ("norm",)), params)
    optimizer = make_optimizer(train, declared)
    direction = np.array([3.0, 4.0, 0.0, 1.0, 2.0])
    g = direction / np.linalg.norm(direction) * norm
    grads = {"w": jnp.asarray(g[:3]), "b": jnp.asarray(g[3:])}
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    clipped = g * min(1.0, clip / norm)
    got = -np.concatenate([updates["w"], updates["b"]]) * eps
    np.testing.assert_allclose(got, clipped, rtol=1e-3)


def expected_wsd(t, lr=1e-3, min_lr=1e-4, warmup=10, end=100, cooldown=20):
    """Warmup–stable–decay written out: warmup lr·(t+1)/(w+1), lr until end − C, then a
    straight line from lr at end − C to min_lr at end, min_lr after."""
    if t < warmup:
        return lr * (t + 1) / (warmup + 1)
    if t < end - cooldown:
        return lr
    if t <= end:
        return lr + (min_lr - lr) * (t - (end - cooldown)) / cooldown
    return min_lr


@pytest.mark.parametrize("t", [0, 5, 9, 10, 11, 50, 79, 80, 81, 90, 99, 100, 101, 500])
def test_wsd_schedule_values(t):
    """steps 100, warmup 10, cooldown_fraction 0.2: the cooldown is steps 80…100."""
    train = TrainConfig(**{**TRAIN, "steps": 100, "warmup_steps": 10, "schedule": "wsd", "cooldown_fraction": 0.2})
    assert train.cooldown_steps == 20
    assert float(learning_rate_schedule(train)(t)) == pytest.approx(expected_wsd(t), rel=1e-5)


def test_wsd_follows_decay_steps_and_may_cool_down_from_the_warmups_end():
    """decay_steps 40 in a run of 100 steps, warmup 8, the whole rest (fraction 0.8) cooling:
    C = 32 steps from step 8 to step 40, then min_lr."""
    train = TrainConfig(**{**TRAIN, "steps": 100, "decay_steps": 40, "warmup_steps": 8, "schedule": "wsd",
                           "cooldown_fraction": 0.8})
    schedule = learning_rate_schedule(train)
    for t in (0, 7, 8, 9, 24, 39, 40, 41, 99):
        assert float(schedule(t)) == pytest.approx(expected_wsd(t, warmup=8, end=40, cooldown=32), rel=1e-5), t


def tiny_cfg(**changes) -> GPTConfig:
    """A one-layer untied GPT."""
    return GPTConfig(**{**dict(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=8, tie_embeddings=False),
                        **changes})


@functools.cache
def tiny_layout(**changes):
    """tiny_cfg's params' declarations (with logits_bias: few_params' leaves are all in it)."""
    return param_layout(tiny_cfg(**{"logits_bias": True, **changes}))


def few_params():
    """A leaf of each group at its place in a GPT's params (as GROUPS names them): tiny_layout's
    shapes at those paths."""
    shapes = {"wte": {"embedding": (11, 8)}, "lm_head": {"kernel": (8, 11)}, "logits_bias": (11,),
              "h_0": {"attn": {"c_attn": {"kernel": (8, 3, 2, 4), "bias": (3, 2, 4)}}, "ln_1": {"scale": (8,)}}}
    return jax.tree.map(lambda shape: jnp.sin(jnp.arange(math.prod(shape), dtype=jnp.float32)).reshape(shape) + 1.0,
                        shapes, is_leaf=lambda x: isinstance(x, tuple))


def matrices_and_tables(params):
    """The decay mask written out by name: the weight matrices (kernels) and the embedding tables."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in ("kernel", "embedding"), params)


def test_adamw_without_group_rates_is_optax_adamw_bit_for_bit():
    """The default optimizer is clip, then optax.adamw on the schedule: the same state
    structure (so checkpoints written before the groups restore) and the same updates."""
    train = TrainConfig(**{**TRAIN, "warmup_steps": 2, "steps": 10})
    declared = tiny_layout()
    ours = make_optimizer(train, declared)
    reference = optax.chain(optax.clip_by_global_norm(train.clip), optax.adamw(
        learning_rate_schedule(train), b1=train.b1, b2=train.b2, eps=train.eps, weight_decay=train.weight_decay,
        mask=matrices_and_tables))
    shapes = jax.tree.map(lambda leaf: leaf.value, declared, is_leaf=layout.is_declared)
    assert jax.tree.structure(jax.eval_shape(ours.init, shapes)) == \
        jax.tree.structure(jax.eval_shape(reference.init, shapes))
    params = few_params()  # one leaf of each group: a small program to compile
    states = [ours.init(params), reference.init(params)]
    both = jax.jit(lambda grads, states: (ours.update(grads, states[0], params),
                                          reference.update(grads, states[1], params)))
    for i in range(3):  # one program, compiled once
        grads = jax.tree.map(lambda p, i=i: jnp.sin(p * 7.0 + i) + 0.1, params)
        (u1, state_ours), (u2, state_ref) = both(grads, states)
        states = [state_ours, state_ref]
        for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2), strict=True):
            np.testing.assert_array_equal(a, b)


GROUPS = {"wte/embedding": "embed", "wpe/embedding": "embed", "lm_head/kernel": "head", "ln_f/scale": "scalar",
          "ln_f/bias": "scalar", "logits_bias": "scalar", "h_0/attn/c_attn/kernel": "matrix",
          "h_0/attn/c_attn/bias": "scalar", "h_0/attn/c_proj/kernel": "matrix", "h_0/ln_1/scale": "scalar",
          "h_0/mlp/c_fc/kernel": "matrix", "h_0/mlp/c_proj/bias": "scalar"}


def test_param_groups_as_declared():
    groups = layout.groups(tiny_layout())
    flat = {"/".join(k.key for k in path): g for path, g in jax.tree_util.tree_leaves_with_path(groups)}
    assert {path: flat[path] for path in GROUPS} == GROUPS
    assert set(flat.values()) == {"embed", "head", "scalar", "matrix"}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_each_group_steps_at_its_own_rate(optimizer):
    """Adam's first step is m̂/(√v̂ + ε) = g/(|g| + ε) = sign(g) for ε ≪ |g|, so with no decay
    or clipping |Δθ| = lr_g(0) in every element, lr_g(0) = lr_g/(w+1) in the warmup (w = 3):
    embed 0.4/4, head 0.02/4, scalar 0.8/4, matrix (AdamW) 0.01/4. Under Muon the matrices
    take Muon's step instead; the others still step at their own rates."""
    rates = {"matrix": 0.01, "embed": 0.4, "head": 0.02, "scalar": 0.8}
    train = TrainConfig(**{**TRAIN, "optimizer": optimizer, "lr": rates["matrix"], "embed_lr": rates["embed"],
                           "head_lr": rates["head"], "scalar_lr": rates["scalar"], "warmup_steps": 3, "steps": 10,
                           "weight_decay": 0.0, "clip": 0.0, "eps": 1e-12})
    params = few_params()
    optimizer_ = make_optimizer(train, tiny_layout())
    grads = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size, dtype=jnp.float32).reshape(p.shape) * 1.3) + 0.05,
                         params)
    updates, _ = jax.jit(lambda g: optimizer_.update(g, optimizer_.init(params), params))(grads)
    for path, update in jax.tree_util.tree_leaves_with_path(updates):
        group = GROUPS["/".join(k.key for k in path)]
        if optimizer == "muon" and group == "matrix":
            assert float(jnp.abs(update).std()) > 0  # orthogonalised, not sign-like
            continue
        np.testing.assert_allclose(np.abs(update), rates[group] / 4, rtol=1e-5, err_msg=jax.tree_util.keystr(path))
        np.testing.assert_array_equal(np.sign(update), -np.sign(grads_at(grads, path)))


def grads_at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_group_rates_follow_the_schedule_to_their_own_minimum():
    """lr_g(t) = lr_g · lr(t)/lr: with b1 = b2 = 0 Adam's step is sign(g) at every step t, so
    |Δθ| reads the group's rate off the schedule: at the peak (t = w) lr_g, at the end
    lr_g·min_lr/lr."""
    train = TrainConfig(**{**TRAIN, "lr": 0.01, "min_lr": 0.001, "embed_lr": 0.5, "warmup_steps": 2, "steps": 10,
                           "b1": 0.0, "b2": 0.0, "weight_decay": 0.0, "clip": 0.0, "eps": 1e-12})
    params = few_params()
    optimizer = make_optimizer(train, tiny_layout())
    grads = jax.tree.map(lambda p: jnp.ones_like(p), params)

    @jax.jit
    def step_at(t):
        state = optax.tree.set(optimizer.init(params), count=jnp.asarray(t, jnp.int32))
        return optimizer.update(grads, state, params)[0]

    for t, factor in ((2, 1.0), (10, 0.1), (20, 0.1)):
        updates = step_at(t)
        np.testing.assert_allclose(updates["wte"]["embedding"], -0.5 * factor, rtol=1e-5)
        np.testing.assert_allclose(updates["h_0"]["attn"]["c_attn"]["kernel"], -0.01 * factor, rtol=1e-5)


def test_a_schedule_or_optimizer_added_to_its_registry_is_a_train_setting_at_once(monkeypatch):
    """The registries are the lists of valid names: a train section is checked against them where it
    is opened, so one entry there, and nothing else, makes a setting."""
    from jaxgpt import optim
    from jaxgpt.errors import ConfigError
    from jaxgpt.optim import open_train

    with pytest.raises(ConfigError, match=r"train.schedule='flat': must be 'cosine' or 'wsd'"):
        open_train({"schedule": "flat"})
    monkeypatch.setitem(optim.SCHEDULES, "flat", lambda train: optax.constant_schedule(train.lr))
    monkeypatch.setitem(optim.OPTIMIZERS, "sgd", lambda train, schedule, *layout: optax.sgd(schedule))
    train = open_train({"schedule": "flat", "optimizer": "sgd", "lr": 0.5, "warmup_steps": 0})
    assert float(optim.learning_rate_schedule(train)(7)) == 0.5


@pytest.mark.parametrize("changes, message", [
    (dict(optimizer="sgd"), r"^train.optimizer='sgd': must be 'adamw' or 'muon'$"),
    (dict(schedule="linear"), r"^train.schedule='linear': must be 'cosine' or 'wsd'$"),
    (dict(cooldown_fraction=0.0), r"^train.cooldown_fraction=0.0: must be a number in \(0, 1\]$"),
    (dict(cooldown_fraction=1.5), r"^train.cooldown_fraction=1.5: must be a number in \(0, 1\]$"),
    (dict(schedule="wsd", steps=100, warmup_steps=10, cooldown_fraction=0.001),
     r"^train.cooldown_fraction=0.001 gives no cooldown step out of train.steps=100: raise it to at least 0.01$"),
    (dict(schedule="wsd", steps=100, warmup_steps=50, cooldown_fraction=0.6),
     r"^train.cooldown_fraction=0.6: its cooldown of 60 steps would start at step 40, inside the warmup of 50"),
    (dict(embed_lr=-1.0), r"^train.embed_lr=-1.0: must be None \(train.lr\) or a number ≥ 0$"),
    (dict(head_lr="fast"), r"^train.head_lr='fast': must be None \(train.lr\) or a number ≥ 0$"),
    (dict(scalar_lr=0.1, lr=0.0), r"^train.scalar_lr=0.1 needs train.lr > 0"),
    (dict(muon_momentum=1.0), r"^train.muon_momentum=1.0: must be a number in \[0, 1\)$"),
    (dict(muon_ns_steps=0), r"^train.muon_ns_steps=0: must be a positive integer$"),
    (dict(muon_nesterov="yes"), r"^train.muon_nesterov='yes': must be True or False$"),
])
def test_a_bad_optimizer_or_schedule_setting_is_a_one_line_error_naming_its_key(changes, message):
    from jaxgpt.errors import ConfigError
    from jaxgpt.optim import open_train

    with pytest.raises(ConfigError, match=message) as raised:
        open_train({**TRAIN, **changes})
    assert "\n" not in str(raised.value)
