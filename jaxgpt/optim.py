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

Both registries (OPTIMIZERS, SCHEDULES) map the names train.optimizer and train.schedule may
take to their builders: they are the lists of those names (jaxgpt.config checks against them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

TrainConfig = Any  # jaxgpt.config's train section, which checks its names against OPTIMIZERS and SCHEDULES here

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


def param_group(path) -> str:
    """The group of the leaf at `path` in the params pytree: 'embed' for embedding tables
    (leaves named `embedding`: wte, wpe, …), 'head' for the untied unembedding (under
    `lm_head`), 'matrix' for the other weight matrices (`kernel`: the blocks'), 'scalar' for
    everything else (biases, norm gains, logits_bias)."""
    names = [str(getattr(key, "key", key)) for key in path]
    if names[-1] == "embedding":
        return "embed"
    if "lm_head" in names:
        return "head"
    return "matrix" if names[-1] == "kernel" else "scalar"


def param_groups(params):
    """The pytree of param_group for every leaf of `params`."""
    return jax.tree_util.tree_map_with_path(lambda path, _: param_group(path), params)


def weight_decay_mask(params, decay_embeddings: bool = True):
    """True for the leaves AdamW decays: weight matrices (`kernel`: the matrix and head
    groups), and embedding tables when `decay_embeddings`; never biases or norm scales."""
    def decays(path, _):
        name = path[-1].key
        return name == "kernel" or (decay_embeddings and name == "embedding")

    return jax.tree_util.tree_map_with_path(decays, params)


def scale_by_group_learning_rate(train: TrainConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """u ← −lr_g(t)·u for each leaf, lr_g(t) = lr(t)·lr_g/lr its group's rate. Its state is
    optax.scale_by_learning_rate's (the step count), whatever the groups' rates."""
    rates = {group: train.group_lr(group) for group in ("matrix", "embed", "head", "scalar")}
    share = {group: 1.0 if rate == train.lr else rate / train.lr for group, rate in rates.items()}  # lr may be 0

    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        del params
        step_size = -schedule(state.count)
        scaled = jax.tree.map(lambda u, group: jnp.asarray(step_size * share[group], u.dtype) * u,
                              updates, param_groups(updates))
        return scaled, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


# --- optimizers ---------------------------------------------------------------------------


def adamw(train: TrainConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """AdamW with decoupled weight decay on weight_decay_mask, each group at its own rate: with
    no group rate set it is optax.adamw(schedule, …) exactly, its state included."""
    return optax.chain(
        optax.scale_by_adam(b1=train.b1, b2=train.b2, eps=train.eps),
        optax.add_decayed_weights(train.weight_decay, lambda params: weight_decay_mask(params,
                                                                                       train.decay_embeddings)),
        scale_by_group_learning_rate(train, schedule),
    )


def muon_dimension_numbers(params):
    """For each leaf, the axes Muon orthogonalises over: MuonDimensionNumbers(reduction axes,
    output axes) for the matrix group, None for the rest (they stay on AdamW). The axes left
    out of both are batch axes: each index along them is a matrix of its own.

    A Linear kernel is (*inputs, *outputs) (jaxgpt.model.Linear):
      attn/c_attn/kernel (d, 3, H, D)     reduce d, output (H, D); the 3 (Q, K, V) a batch axis
      attn/q_proj/kernel (d, H, D)        reduce d, output (H, D)
      attn/kv_proj/kernel (d, 2, H_kv, D) reduce d, output (H_kv, D); the 2 (K, V) a batch axis
      attn/c_proj/kernel (H, D, d)        reduce (H, D), output d: W_O
      mlp/c_fc…/kernel (d, w), (w, w)     reduce the first axis, output the rest
      mlp/c_proj/kernel (w, d)            reduce w, output d
    Under compute.scan_layers the blocks' leaves (under 'h') have a leading layer axis: a batch
    axis, so each layer's matrix is orthogonalised alone."""
    def numbers(path, leaf):
        if param_group(path) != "matrix":
            return None
        names = [str(getattr(key, "key", key)) for key in path]
        layer = 1 if "h" in names else 0  # scan_layers: the stacked layer axis leads
        ndim, module = leaf.ndim - layer, names[-2]
        if module in ("c_attn", "kv_proj"):  # (d, k, heads, D): k projections side by side
            reduce, output = (0,), (2, 3)
        elif module == "c_proj":  # into the residual stream: (…inputs, d)
            reduce, output = tuple(range(ndim - 1)), (ndim - 1,)
        else:
            reduce, output = (0,), tuple(range(1, ndim))
        return MuonDimensionNumbers(tuple(a + layer for a in reduce), tuple(a + layer for a in output))

    return jax.tree_util.tree_map_with_path(numbers, params)


def muon(train: TrainConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """The matrix group through optax.contrib.muon (momentum β, Nesterov, muon_ns_steps
    Newton–Schulz steps, optax's shape scaling, weight decay λ, rate lr(t)); the embed, head and
    scalar groups through `adamw` at their own rates."""
    matrices = optax.contrib.muon(
        schedule, ns_steps=train.muon_ns_steps, beta=train.muon_momentum, nesterov=train.muon_nesterov,
        weight_decay=train.weight_decay, muon_weight_dimension_numbers=muon_dimension_numbers)
    labels = lambda params: jax.tree.map(lambda group: "muon" if group == "matrix" else "adamw",  # noqa: E731
                                         param_groups(params))
    return optax.partition({"muon": matrices, "adamw": adamw(train, schedule)}, labels)


OPTIMIZERS: dict[str, Callable[[TrainConfig, optax.Schedule], optax.GradientTransformation]] = {
    "adamw": adamw, "muon": muon}


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
    """clip_by_global_norm(clip), then train.optimizer on train.schedule."""
    steps = [optax.clip_by_global_norm(train.clip)] if train.clip else []
    steps.append(OPTIMIZERS[train.optimizer](train, learning_rate_schedule(train)))
    return optax.chain(*steps)
