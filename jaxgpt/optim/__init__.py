"""The optimizer: global-norm clipping, then AdamW or Muon, on a warmup-cosine or a
warmup–stable–decay schedule, each parameter group at its own peak learning rate.

    lr(t) = lr·(t+1)/(w+1)                                    for t < w   (warmup, both schedules)
    cosine: lr(t) = lr_min + ½(lr − lr_min)(1 + cos(π (t−w)/(T_d−w)))   for w ≤ t ≤ T_d
    wsd:    lr(t) = lr for t < T_d − C,  lr + (lr_min − lr)(t − T_d + C)/C up to T_d (C cooldown steps)
    lr_g(t) = lr_g · lr(t)/lr                                  (group g: matrix, embed, head, scalar)
    g ← g · min(1, c/‖g‖)                                      (clipping)
    θ ← θ − lr_g(t)·(m̂/(√v̂ + ε) + λθ)                          (AdamW; λ on matrices, embeddings optional)
    θ ← θ − lr(t)·(s·NS(M̃) + λθ)                               (Muon, the blocks' matrices: M̃ the Nesterov
                                                                momentum, NS its Newton–Schulz orthogonalisation)
    NS's coefficients: the quintic's (a, b, c) each step, or Polar Express's row per step (train.muon_coeffs);
    NorMuon (train.normuon): NS(M̃) normalised per output neuron (jaxgpt.optim.muon.scale_by_neuron_norm);
    cautious weight decay (train.cautious_weight_decay): λθ only where u·θ ≥ 0 (u the update before it)
    untie_at (train.untie_at): E and W_U one table, W_U = Eᵀ, for the steps s < S, then two (jaxgpt.optim.tying)

Both registries (OPTIMIZERS, SCHEDULES) map the names train.optimizer and train.schedule may
take to their builders: they are the lists of those names (check_train checks a train
section against them where it is opened: open_train).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from jaxgpt import layout
from jaxgpt.config import TrainConfig
from jaxgpt.errors import ConfigError
from jaxgpt.optim.muon import scale_by_banked_muon, scale_by_neuron_norm, scale_by_width
from jaxgpt.optim.tying import TiedOptimizer, tied

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the quintic's (a, b, c): optax's and modded-nanogpt's
# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): one (a, b, c) per step, each step's
# polynomial the minimax-optimal odd quintic for the singular values the steps before leave; these are
# modded-nanogpt's (5 steps, safety factor 2e-2, cushion 2)
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
NS_TABLES = {"quintic": NS_COEFFS, "polar_express": POLAR_EXPRESS}  # the names train.muon_coeffs may take

# --- learning-rate schedules --------------------------------------------------------------


def cosine_schedule(train: TrainConfig) -> optax.Schedule:
    """Linear warmup from lr/(w+1) to lr over `warmup_steps`, then cosine decay to `min_lr`
    at `decay_steps` (default: the run's `steps`), constant after."""
    return optax.warmup_cosine_decay_schedule(
        init_value=train.lr / (train.warmup_steps + 1),
        peak_value=train.lr,
        warmup_steps=train.warmup_steps,
        decay_steps=train.schedule_steps,
        end_value=train.min_lr,
    )


def wsd_schedule(train: TrainConfig) -> optax.Schedule:
    """Warmup–stable–decay (trapezoidal): the same linear warmup, then lr held until the
    cooldown's C = round(cooldown_fraction·T_d) steps, which fall linearly to `min_lr` at
    T_d; constant after."""
    w, end, cooldown = train.warmup_steps, train.schedule_steps, train.cooldown_steps
    return optax.join_schedules(
        [optax.linear_schedule(train.lr / (w + 1), train.lr, w), optax.constant_schedule(train.lr),
         optax.linear_schedule(train.lr, train.min_lr, cooldown)],
        boundaries=[w, end - cooldown],
    )


SCHEDULES: dict[str, Callable[[TrainConfig], optax.Schedule]] = {"cosine": cosine_schedule, "wsd": wsd_schedule}


def learning_rate_schedule(train: TrainConfig) -> optax.Schedule:
    """lr(t), the schedule train.schedule names (the matrix group's rate; the other groups
    scale it to their own peak)."""
    return SCHEDULES[train.schedule](train)


# --- parameter groups ---------------------------------------------------------------------
# Each parameter's group, decay and Muon axes are its declaration's (jaxgpt.layout): `declared`
# is the params' tree of declarations (jaxgpt.model.param_layout), in the params' structure.


def per_param(fn, declared) -> Callable:
    """params ↦ the tree of fn(declaration) for each parameter, in the structure of the tree it
    is given (optax.partition hands its transformations their share of the params, the others
    masked), each leaf paired with its declaration by layout.pair."""
    def of(params):
        try:
            return layout.pair(lambda _, leaf: fn(leaf), params, declared)
        except KeyError as missing:
            raise ValueError(f"the optimizer was made for other parameters (none at {missing.args[0]}): make it for "
                             "the layout of the params it updates (make_optimizer(train, param_layout(model)))") \
                from None

    return of


def scale_by_group_learning_rate(train: TrainConfig, schedule: optax.Schedule, declared) -> \
        optax.GradientTransformation:
    """u ← −lr_g(t)·u for each leaf, lr_g(t) = lr(t)·lr_g/lr its group's rate. Its state is
    optax.scale_by_learning_rate's (the step count), whatever the groups' rates."""
    rates = {group: train.group_lr(group) for group in layout.GROUPS}
    groups = per_param(lambda leaf: leaf.group, declared)
    share = {group: 1.0 if rate == train.lr else rate / train.lr for group, rate in rates.items()}  # lr may be 0

    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        del params
        step_size = -schedule(state.count)
        scaled = jax.tree.map(lambda u, group: jnp.asarray(step_size * share[group], u.dtype) * u, updates,
                              groups(updates))
        return scaled, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


# --- Newton–Schulz coefficients and weight decay -------------------------------------------


def ns_coefficients(setting: str) -> tuple:
    """train.muon_coeffs as optax.contrib.muon's ns_coeffs: a name of NS_TABLES (the quintic's one
    (a, b, c), used every step; Polar Express's rows, one per step), or rows 'a,b,c; a,b,c; …'
    (one per step; a single row: every step), also written as Python writes them, '((a,b,c),(a,b,c))'.
    ValueError, in one line, for anything else."""
    if setting in NS_TABLES:
        return NS_TABLES[setting]
    text = str(setting).strip()
    if text[:1] in "([":  # the rows in brackets: each innermost bracket is a row
        text = ";".join(re.findall(r"[(\[]([^()\[\]]*)[)\]]", text))
    try:
        rows = tuple(tuple(float(x) for x in row.split(",")) for row in text.split(";") if row.strip())
    except ValueError:
        rows = ()
    if not rows or any(len(row) != 3 for row in rows):
        raise ValueError(f"train.muon_coeffs={setting!r}: must be {' or '.join(map(repr, NS_TABLES))}, or one "
                         "'a,b,c' row per Newton–Schulz step, separated by ';' (or '((a,b,c),(a,b,c))')")
    return rows[0] if len(rows) == 1 else rows


def add_cautious_decayed_weights(weight_decay: float, mask=None) -> optax.GradientTransformation:
    """u ← u + λθ·[u·θ ≥ 0]: decoupled weight decay only where it does not oppose the update u
    (each element; cautious weight decay). Its state is optax.add_decayed_weights's (none)."""
    def update(updates, state, params=None):
        if params is None:
            raise ValueError("cautious weight decay needs the params: pass them to the optimizer's update")
        decayed = jax.tree.map(lambda u, p: u + weight_decay * jnp.where(u * p >= 0, p, 0).astype(u.dtype),
                               updates, params)
        return decayed, state

    cautious = optax.GradientTransformation(lambda params: optax.EmptyState(), update)
    return cautious if mask is None else optax.masked(cautious, mask)


def add_decayed_weights(train: TrainConfig, mask=None) -> optax.GradientTransformation:
    """u ← u + λθ where `mask` says (optax.add_decayed_weights), or cautiously with
    train.cautious_weight_decay (add_cautious_decayed_weights)."""
    if train.cautious_weight_decay:
        return add_cautious_decayed_weights(train.weight_decay, mask)
    return optax.add_decayed_weights(train.weight_decay, mask)


# --- optimizers ---------------------------------------------------------------------------


def adamw(train: TrainConfig, schedule: optax.Schedule, declared) -> optax.GradientTransformation:
    """AdamW with decoupled weight decay on the declared decay mask, each group at its own rate:
    with no group rate set it is optax.adamw(schedule, …) exactly, its state included."""
    return optax.chain(
        optax.scale_by_adam(b1=train.b1, b2=train.b2, eps=train.eps),
        add_decayed_weights(train, per_param(lambda leaf: layout.decays(leaf, train.decay_embeddings), declared)),
        scale_by_group_learning_rate(train, schedule, declared),
    )


def muon_dimension_numbers(declared) -> Callable:
    """params ↦ for each parameter, the axes Muon orthogonalises over: MuonDimensionNumbers(reduction
    axes, output axes) for the matrix group, None for the rest (they stay on AdamW). Both come
    from the declaration (layout.matrix_axes): a matrix's input axes are reduced, its output
    axes kept; axes left out of both are batch axes (Q, K and V side by side; the layers under
    compute.scan_layers), each index along them a matrix of its own."""
    return per_param(lambda leaf: MuonDimensionNumbers(*layout.matrix_axes(leaf)) if leaf.group == "matrix" else None,
                     declared)


def muon(train: TrainConfig, schedule: optax.Schedule, declared) -> optax.GradientTransformation:
    """The matrix group through Muon (momentum β, Nesterov, muon_ns_steps Newton–Schulz steps of
    train.muon_coeffs over banks of same-shaped matrices, each device its share: jaxgpt.optim.muon;
    NorMuon's normalisation per neuron with train.normuon; optax's shape scaling, weight decay
    λ (cautious with train.cautious_weight_decay), rate lr(t)); the embed, head and scalar
    groups through `adamw` at their own rates. Without NorMuon the updates are
    optax.contrib.muon's (given the same ns_coeffs), and so is the state's layout (its AdamW
    branch, which holds no parameter here, included): its checkpoints resume."""
    normuon = [scale_by_neuron_norm(declared, train.normuon_beta2)] if train.normuon else []
    matrices = optax.chain(
        scale_by_banked_muon(declared, ns_coefficients(train.muon_coeffs), train.muon_ns_steps, train.muon_momentum,
                             nesterov=train.muon_nesterov),
        *normuon,
        scale_by_width(declared),
        add_decayed_weights(train),
        optax.scale_by_learning_rate(schedule))
    as_optax = optax.partition({"muon": matrices, "adam": optax.adamw(schedule)},
                               lambda params: jax.tree.map(lambda _: "muon", params))
    labels = per_param(lambda leaf: "muon" if leaf.group == "matrix" else "adamw", declared)
    return optax.partition({"muon": as_optax, "adamw": adamw(train, schedule, declared)}, labels)


OPTIMIZERS: dict[str, Callable[[TrainConfig, optax.Schedule, Any], optax.GradientTransformation]] = {
    "adamw": adamw, "muon": muon}


def make_optimizer(train: TrainConfig, declared) -> optax.GradientTransformation | TiedOptimizer:
    """clip_by_global_norm(clip), then train.optimizer on train.schedule, for the parameters
    `declared` (jaxgpt.model.param_layout of the model it trains); with train.untie_at, with the
    tying of the embedding and the unembedding until train.untie_step (jaxgpt.optim.tying)."""
    steps = [optax.clip_by_global_norm(train.clip)] if train.clip else []
    steps.append(OPTIMIZERS[train.optimizer](train, learning_rate_schedule(train), declared))
    optimizer = optax.chain(*steps)
    return optimizer if train.untie_at is None else tied(optimizer, declared, train.untie_step)


# --- a train section opened --------------------------------------------------------------------


def check_train(train: TrainConfig) -> TrainConfig:
    """train, when its optimizer, schedule and Newton–Schulz coefficients are registered (a table
    with one row per Newton–Schulz step); a one-line ConfigError otherwise."""
    for key, valid in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES)):
        if getattr(train, key) not in valid:
            raise ConfigError(f"train.{key}={getattr(train, key)!r}: must be {' or '.join(map(repr, valid))}")
    try:
        coeffs = ns_coefficients(train.muon_coeffs)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if isinstance(coeffs[0], tuple) and len(coeffs) != train.muon_ns_steps:
        raise ConfigError(f"train.muon_coeffs={train.muon_coeffs!r} has {len(coeffs)} rows, one per Newton–Schulz "
                          f"step, but train.muon_ns_steps={train.muon_ns_steps}: set train.muon_ns_steps="
                          f"{len(coeffs)}, or give {train.muon_ns_steps} rows")
    return train


def open_train(values: Mapping[str, Any]) -> TrainConfig:
    """The TrainConfig of a config's train section, checked (check_train)."""
    return check_train(TrainConfig.from_mapping(values))
