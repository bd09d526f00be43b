"""The optimizer: global-norm clipping, then AdamW with linear warmup and cosine decay.

    lr(t) = lr·(t+1)/(w+1)                                    for t < w   (warmup)
    lr(t) = lr_min + ½(lr − lr_min)(1 + cos(π (t−w)/(T_d−w)))   for w ≤ t ≤ T_d
    g ← g · min(1, c/‖g‖)                                      (clipping)
    θ ← θ − lr(t)·(m̂/(√v̂ + ε) + λθ)                            (AdamW; λ on matrices only)
"""

from __future__ import annotations

import jax
import optax

from jaxgpt.config import TrainConfig


def learning_rate_schedule(train: TrainConfig) -> optax.Schedule:
    """Linear warmup from lr/(w+1) to lr over `warmup_steps`, then cosine decay to `min_lr`
    at `decay_steps` (default: the run's `steps`), constant after."""
    return optax.warmup_cosine_decay_schedule(
        init_value=train.lr / (train.warmup_steps + 1),
        peak_value=train.lr,
        warmup_steps=train.warmup_steps,
        decay_steps=train.schedule_steps,
        end_value=train.min_lr,
    )


def weight_decay_mask(params, decay_embeddings: bool = True):
    """True for the leaves AdamW decays: weight matrices (`kernel`), and embedding tables
    when `decay_embeddings`; never biases or norm scales."""
    def decays(path, _):
        name = path[-1].key
        return name == "kernel" or (decay_embeddings and name == "embedding")

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
    """clip_by_global_norm(clip) followed by AdamW on the warmup-cosine schedule."""
    steps = [optax.clip_by_global_norm(train.clip)] if train.clip else []
    steps.append(
        optax.adamw(
            learning_rate_schedule(train),
            b1=train.b1,
            b2=train.b2,
            eps=train.eps,
            weight_decay=train.weight_decay,
            mask=lambda params: weight_decay_mask(params, train.decay_embeddings),
        )
    )
    return optax.chain(*steps)
