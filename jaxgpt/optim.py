"""The optimizer: global-norm clipping, then AdamW with linear warmup and cosine decay.

    lr(t) = lr·(t+1)/(w+1)                                    for t < w   (warmup)
    lr(t) = lr_min + ½(lr − lr_min)(1 + cos(π (t−w)/(T_d−w)))   for w ≤ t ≤ T_d
    g ← g · min(1, c/‖g‖)                                      (clipping)
    θ ← θ − lr(t)·(m̂/(√v̂ + ε) + λθ)                            (AdamW; λ on matrices only)
"""

from __future__ import annotations

import jax
import optax


def learning_rate_schedule(train_cfg) -> optax.Schedule:
    """Linear warmup from lr/(w+1) to lr over `warmup_steps`, then cosine decay to `min_lr`
    at `decay_steps` (default: the run's `steps`), constant after."""
    warmup = int(train_cfg.warmup_steps)
    decay_steps = int(train_cfg.get("decay_steps") or train_cfg.steps)
    if decay_steps <= warmup:
        raise ValueError(
            f"train.decay_steps={decay_steps} must exceed train.warmup_steps={warmup}: "
            "the cosine needs at least one step after the warmup"
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=train_cfg.lr / (warmup + 1),
        peak_value=train_cfg.lr,
        warmup_steps=warmup,
        decay_steps=decay_steps,
        end_value=train_cfg.min_lr,
    )


def weight_decay_mask(params, decay_embeddings: bool = True):
    """True for the leaves AdamW decays: weight matrices (`kernel`), and embedding tables
    when `decay_embeddings`; never biases or norm scales."""
    def decays(path, _):
        name = path[-1].key
        return name == "kernel" or (decay_embeddings and name == "embedding")

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    """clip_by_global_norm(clip) followed by AdamW on the warmup-cosine schedule."""
    decay_embeddings = bool(train_cfg.get("decay_embeddings", True))
    steps = [optax.clip_by_global_norm(train_cfg.clip)] if train_cfg.clip else []
    steps.append(
        optax.adamw(
            learning_rate_schedule(train_cfg),
            b1=train_cfg.b1,
            b2=train_cfg.b2,
            eps=train_cfg.get("eps", 1e-8),
            weight_decay=train_cfg.weight_decay,
            mask=lambda params: weight_decay_mask(params, decay_embeddings),
        )
    )
    return optax.chain(*steps)
