"""The optimizer's switches (issue 37): Polar Express coefficients for Newton–Schulz, NorMuon's
normalisation per neuron and cautious weight decay against float64 NumPy references (and
optax.contrib.muon given the same coefficients), and the batch-size schedule's arithmetic and
its bad input. Their resume and mesh tests extend tests/test_muon.py's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from muon_reference import optax_muon

from jaxgpt import batch_schedule, layout
from jaxgpt.config import TrainConfig
from jaxgpt.errors import ConfigError
from jaxgpt.optim import POLAR_EXPRESS, make_optimizer, ns_coefficients, open_train
from jaxgpt.optim.muon import newton_schulz, scale_by_neuron_norm
from jaxgpt.train.micro_batch import plan

MUON = TrainConfig(optimizer="muon", lr=1.0, min_lr=1.0, warmup_steps=0, weight_decay=0.0, clip=0.0, steps=10)
# a few parameters as a model declares them: Muon's matrices with batch axes (the layers; Q, K, V), one
# tall and one wide, and a table and a gain for AdamW
SHAPES = {"qkv": ((2, 16, 3, 2, 8), ("layers", "embed", "qkv", "heads", "head_dim"), 1, "matrix"),
          "fc": ((16, 48), ("embed", "mlp"), 1, "matrix"),
          "out": ((2, 48, 16), ("layers", "mlp", "embed"), 1, "matrix"),
          "table": ((11, 16), ("vocab", "embed"), 0, "embed"), "gain": ((16,), ("norm",), 0, "scalar")}
DECLARED = {name: layout.Declared(jax.ShapeDtypeStruct(shape, jnp.float32), names, inputs=inputs, group=group)
            for name, (shape, names, inputs, group) in SHAPES.items()}


def tiny():
    """(params, two random gradients) of DECLARED."""
    params = {name: jax.random.normal(jax.random.key(i), leaf.value.shape) for i, (name, leaf) in
              enumerate(DECLARED.items())}
    grads = [jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.key(i), p.shape), params) for i in (10, 11)]
    return params, grads


def updates_of(optimizer, params, grads):
    state, out = optimizer.init(params), []
    step = jax.jit(optimizer.update)
    for g in grads:
        update, state = step(g, state, params)
        out.append(jax.tree.map(lambda x: np.asarray(x, np.float64), update))
    return out


def muon_leaves(tree) -> dict[str, tuple]:
    """name → (leaf, (reduction axes, output axes)) of the matrix group's leaves of `tree`."""
    return {name: (leaf, layout.matrix_axes(DECLARED[name])) for name, leaf in tree.items()
            if DECLARED[name].group == "matrix"}


# --- Polar Express ----------------------------------------------------------------------------


def test_polar_express_maps_singular_values_through_its_five_polynomials_into_a_narrower_band():
    """One Muon direction (no momentum) of G = U S Vᵀ with Polar Express's table: its singular
    values are p₅∘…∘p₁ of S/‖G‖_F (each pᵢ(σ) = aᵢσ + bᵢσ³ + cᵢσ⁵, float64), which for every
    normalised σ ≥ 10⁻³ lie in [0.85, 1.15] (the quintic's five steps: [0.47, 1.21])."""
    g = np.random.default_rng(0).normal(size=(16, 24))
    g[:, 0] *= 1e-2  # a small singular value too
    s = np.linalg.svd(g, compute_uv=False) / np.linalg.norm(g)
    grid = np.geomspace(1e-3, 1.0, 20_001)
    for a, b, c in POLAR_EXPRESS:
        s, grid = (a * x + b * x**3 + c * x**5 for x in (s, grid))
    assert 0.85 <= grid.min() and grid.max() <= 1.15
    direction = optax.contrib.scale_by_muon(ns_coeffs=POLAR_EXPRESS, beta=0.0, nesterov=False,
                                            weight_dimension_numbers={"w": optax.contrib.MuonDimensionNumbers()})
    ours = np.asarray(newton_schulz(jnp.asarray(g, jnp.float32)[None], jnp.asarray(POLAR_EXPRESS, jnp.float32),
                                    1e-8)[0], np.float64)
    theirs = np.asarray(direction.update({"w": jnp.asarray(g, jnp.float32)},
                                         direction.init({"w": jnp.zeros_like(g, jnp.float32)}))[0]["w"])
    np.testing.assert_allclose(np.sort(np.linalg.svd(ours, compute_uv=False)), np.sort(s), rtol=2e-3, atol=2e-4)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_banked_polar_express_updates_equal_optax_muon_given_the_same_table():
    """Two updates (momentum, Nesterov, weight decay 0.1) with train.muon_coeffs='polar_express'
    equal optax.contrib.muon's with ns_coeffs = the same table."""
    params, grads = tiny()
    train = dataclasses.replace(MUON, muon_coeffs="polar_express", weight_decay=0.1, lr=0.05, min_lr=0.05)
    ours = updates_of(make_optimizer(train, DECLARED), params, grads)
    theirs = updates_of(optax_muon(train, DECLARED), params, grads)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6)


# --- NorMuon ----------------------------------------------------------------------------------


def neuron_normalised_reference(o, nu, reduction, output, beta2, eps=1e-10):
    """float64: ν ← β₂ν + (1−β₂)·mean_j O², Ô = O/√max(ν, ε), Ô·‖O‖_F/‖Ô‖_F per matrix (batch axes apart)."""
    nu = beta2 * nu + (1 - beta2) * np.mean(o**2, axis=reduction, keepdims=True)
    scaled = o / np.sqrt(np.maximum(nu, eps))
    norm = lambda x: np.sqrt(np.sum(x**2, axis=reduction + output, keepdims=True))  # noqa: E731
    return scaled * norm(o) / np.maximum(norm(scaled), eps), nu


def test_normuon_normalises_each_output_neuron_of_each_matrix_against_float64():
    """Two NorMuon updates (β₂ 0.9) of Muon's matrices equal, leaf by leaf, Muon's own directions
    (optax.contrib.muon's, a constant rate 1, no decay) put through the float64 reference with its
    own state: per output neuron of each layer's and each of Q's, K's, V's matrices. (The width
    scaling and the rate are constant scalars per matrix, which the normalisation keeps.)"""
    params, grads = tiny()
    train = dataclasses.replace(MUON, normuon=True, normuon_beta2=0.9)
    ours = updates_of(make_optimizer(train, DECLARED), params, grads)
    muon = updates_of(optax_muon(MUON, DECLARED), params, grads)
    leaves = muon_leaves(params)
    nus = {}
    for step in range(2):
        got, plain = muon_leaves(ours[step]), muon_leaves(muon[step])
        for key, (_, (reduction, output)) in leaves.items():
            o = plain[key][0]
            nu = nus.get(key, np.zeros([1 if i in reduction else n for i, n in enumerate(o.shape)]))
            want, nus[key] = neuron_normalised_reference(o, nu, reduction, output, 0.9)
            np.testing.assert_allclose(got[key][0], want, rtol=1e-4, atol=1e-6)
            assert not np.allclose(got[key][0], o, atol=1e-3)  # the normalisation changed something
    assert nus["qkv"].shape == (2, 1, 3, 2, 8) and nus["fc"].shape == (1, 48)  # the layers, Q/K/V, the neurons


def test_normuon_keeps_each_matrix_norm_and_equalises_its_neurons_on_the_first_step():
    """From ν = 0, the first step's ν = (1−β₂)·row mean square, so every output neuron's row of Ô
    has the same RMS, and ‖update‖_F = ‖O‖_F for each matrix: the invariants, on a (d, 3, H, D)
    leaf whose Q, K and V are matrices of their own."""
    o = jax.random.normal(jax.random.key(0), (16, 3, 2, 8)) * jnp.linspace(0.5, 4.0, 8)  # neurons of unequal scale
    declared = {"w": layout.Declared(jax.ShapeDtypeStruct(o.shape, o.dtype), ("embed", "qkv", "heads", "head_dim"),
                                     inputs=1, group="matrix")}
    normuon = scale_by_neuron_norm(declared, 0.95)
    update, state = jax.jit(lambda x: normuon.update(x, normuon.init(x)))({"w": o})
    u, o = np.asarray(update["w"], np.float64), np.asarray(o, np.float64)
    for which in range(3):
        rows = u[:, which].reshape(16, -1)  # (inputs, neurons)
        rms = np.sqrt(np.mean(rows**2, axis=0))
        np.testing.assert_allclose(rms, rms.mean(), rtol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(rows), np.linalg.norm(o[:, which]), rtol=1e-5)
    assert state.nu["w"].shape == (1, 3, 2, 8)


# --- cautious weight decay ----------------------------------------------------------------------


def test_cautious_weight_decay_decays_only_where_update_and_parameter_agree_in_sign():
    """First step, lr η, λ = 0.5: AdamW's update is −η(g/(|g|+ε) + λθ·[gθ ≥ 0]) on the decayed
    leaves (float64, from Adam's first step m̂ = g, v̂ = g²) and −η·g/(|g|+ε) on biases and gains;
    Muon's matrices −η(O + λθ·[Oθ ≥ 0]) with O its direction without decay (optax.contrib.muon's)."""
    params, grads = tiny()
    declared = DECLARED
    eta, lam = 0.1, 0.5
    adamw = dataclasses.replace(MUON, optimizer="adamw", lr=eta, min_lr=eta, weight_decay=lam,
                                cautious_weight_decay=True)
    got = updates_of(make_optimizer(adamw, declared), params, grads[:1])[0]
    decays = layout.decay_mask(declared)
    for g, p, u, decayed in zip(*(jax.tree.leaves(t) for t in (grads[0], params, got, decays)), strict=True):
        g, p = np.asarray(g, np.float64), np.asarray(p, np.float64)
        direction = g / (np.abs(g) + adamw.eps)
        want = -eta * (direction + (lam * p * (direction * p >= 0) if decayed else 0))
        np.testing.assert_allclose(u, want, rtol=1e-5, atol=1e-7)
    muon = dataclasses.replace(MUON, lr=eta, min_lr=eta, weight_decay=lam, cautious_weight_decay=True)
    got = muon_leaves(updates_of(make_optimizer(muon, declared), params, grads[:1])[0])
    plain = muon_leaves(updates_of(optax_muon(dataclasses.replace(muon, weight_decay=0.0), declared), params,
                                   grads[:1])[0])
    for key, (p, _) in muon_leaves(params).items():
        p, o = np.asarray(p, np.float64), -plain[key][0] / eta
        # two float32 programs' Newton–Schulz iterations: their rounding, amplified, differs by a few 1e-5 of
        # the direction's largest entry; a decay applied where it should not be moves an entry by ηλ|θ|, far more
        np.testing.assert_allclose(got[key][0], -eta * (o + lam * p * (o * p >= 0)), rtol=1e-5,
                                   atol=eta * 5e-5 * np.abs(o).max())
        assert 0 < np.mean(o * p >= 0) < 1  # both cases occur


# --- the batch-size schedule ----------------------------------------------------------------------


def test_batch_schedule_rows_of_each_step_and_the_rows_before_it():
    schedule, rows = ((2, 4), (5, 8)), 12
    assert [batch_schedule.rows_at(schedule, rows, t) for t in range(7)] == [4, 4, 8, 8, 8, 12, 12]
    for t in range(12):
        assert batch_schedule.rows_before(schedule, rows, t) == sum(batch_schedule.rows_at(schedule, rows, u)
                                                                    for u in range(t))
    train = TrainConfig(batch_size=4, grad_accum=3, batch_schedule=[[2, 4], [5, 8]])
    assert train.batch_schedule == schedule and train.step_rows == 12


def test_a_chosen_micro_batch_divides_every_scheduled_batch():
    """rows_per_step 48 with batches of 16 and 24 before it, on 4 devices with room for any rows:
    the micro-batch is their common divisor 8 (2 rows a device), not 48."""
    train = TrainConfig(rows_per_step=48, batch_size=0, grad_accum=0, batch_schedule=((10, 16), (20, 24)))
    chosen = plan(train, ways=4, state=0.0, row=1.0, memory=1e12)
    assert (chosen.batch_size, chosen.grad_accum) == (8, 6)


@pytest.mark.parametrize(("changes", "message"), [
    (dict(batch_size=4, batch_schedule=((10, 6),)), "train.batch_schedule: 6 rows a step before step 10 is not a "
     "multiple of the micro-batch train.batch_size=4"),
    (dict(batch_schedule=((10, 24), (10, 36))), "its until_steps must increase"),
    (dict(batch_schedule=((10, 0),)), "must be (until_step, rows) pairs of positive integers"),
    (dict(optimizer="muon", muon_coeffs="polar_express", muon_ns_steps=4), "train.muon_coeffs='polar_express' has "
     "5 rows, one per Newton–Schulz step, but train.muon_ns_steps=4: set train.muon_ns_steps=5, or give 4 rows"),
    (dict(optimizer="muon", muon_coeffs="1,2,3;4,5"), "must be 'quintic' or 'polar_express', or one 'a,b,c' row"),
    (dict(normuon=True), "train.normuon=True needs train.optimizer='muon'"),
    (dict(normuon_beta2=1.0), "train.normuon_beta2=1.0: must be a number in [0, 1)"),
    (dict(cautious_weight_decay="yes"), "train.cautious_weight_decay='yes': must be True or False"),
])
def test_a_bad_switch_is_a_one_line_error_naming_its_key(changes, message):
    with pytest.raises(ConfigError) as refused:
        open_train(changes)  # as a command opens its train section: the schema, then the registries' names
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_rows_of_a_table_and_the_devices_a_schedule_must_divide():
    assert ns_coefficients("quintic") == (3.4445, -4.7750, 2.0315)
    assert ns_coefficients("1,2,3; 4,5,6") == ((1.0, 2.0, 3.0), (4.0, 5.0, 6.0))
    assert ns_coefficients("1,2,3") == (1.0, 2.0, 3.0)  # one row: every step
    train = TrainConfig(rows_per_step=48, batch_size=0, grad_accum=0, batch_schedule=((10, 6),))
    with pytest.raises(ConfigError, match=r"train.rows_per_step=48 and train.batch_schedule's rows \(their divisor "
                                          r"6\) must be divisible by the 4 devices"):
        plan(train, ways=4)
