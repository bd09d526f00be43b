"""The token embedding and the unembedding one table until a step, then two (train.untie_at):
modded-nanogpt's "untied two thirds into the run", for a model whose tables are its own
(model.tie_embeddings=False). The model is always the untied one; the tying is the train
step's (jaxgpt.train.step), read from the optimizer the run makes (TiedOptimizer).

    s < S:  W_U = Eᵀ read and written: E's gradient is g_E + g_Uᵀ (the chain rule through the tie),
            W_U's is 0, E steps in the embed group, and W_U ← Eᵀ after the step
    s = S:  W_U's optimizer state ← E's (transposed), as modded-nanogpt copies it at its untie point
    s ≥ S:  E and W_U each with its own gradient, group and state

S = round(untie_at · T), T the schedule's steps: train.decay_steps, else train.steps
(TrainConfig.untie_step). The tables are found by their declarations (jaxgpt.layout), never by
name: E the embed group's (vocab, embed) table, W_U the head group's (embed, vocab) matrix.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxgpt import layout
from jaxgpt.config import TrainConfig
from jaxgpt.errors import ConfigError

EMBEDDING = ("embed", ("vocab", "embed"))  # (group, axes) of the token embedding E
UNEMBEDDING = ("head", ("embed", "vocab"))  # … and of the untied unembedding W_U


def check_untie(train: TrainConfig, tie_embeddings: bool) -> None:
    """A one-line ConfigError for train.untie_at on a model whose tables are one already."""
    if train.untie_at is not None and tie_embeddings:
        raise ConfigError(f"train.untie_at={train.untie_at!r} unties the embedding and the unembedding, but "
                          "model.tie_embeddings=True makes them one table for the whole run: set "
                          "--config.model.tie_embeddings=False, or drop train.untie_at")


@dataclasses.dataclass(frozen=True)
class Tying:
    """E (at `embedding`, a key path) and W_U (at `unembedding`) one table for the steps s < untie_step,
    W_U = transpose(E, axes)."""

    untie_step: int
    embedding: str
    unembedding: str
    axes: tuple[int, ...]

    @classmethod
    def of(cls, declared, untie_step: int) -> Tying:
        """The tying of the params `declared` (jaxgpt.model.param_layout); ConfigError without an untied unembedding."""
        found = layout.by_path(declared)
        paths = [[path for path, leaf in found.items() if (leaf.group, tuple(leaf.names)) == role]
                 for role in (EMBEDDING, UNEMBEDDING)]
        if any(len(path) != 1 for path in paths):
            raise ConfigError("train.untie_at needs a model with one token embedding and one unembedding of its own "
                              "(model.tie_embeddings=False): set it, or drop train.untie_at")
        (embedding,), (unembedding,) = paths
        names = found[embedding].names
        return cls(untie_step, embedding, unembedding, tuple(names.index(name) for name in found[unembedding].names))

    def tied(self, step) -> jax.Array:
        """Whether the tables are one at `step`: s < S."""
        return jnp.asarray(step) < self.untie_step

    def tie(self, params, step):
        """params with W_U = Eᵀ while tied (the stored W_U after): the gradient through it is g_E + g_Uᵀ in E,
        0 in W_U."""
        tied = self.tied(step)
        return self._with_head(params, lambda head, e: jnp.where(tied, jnp.transpose(e, self.axes), head))

    def untie_state(self, opt_state, step, optimizer: optax.GradientTransformation):
        """opt_state with W_U's leaves (Adam's moments) E's, transposed, at the untie step s = S: in every copy
        of the params' structure `optimizer`'s state holds that has both (optax.tree_map_params)."""
        untying = jnp.asarray(step) == self.untie_step

        def copied(part):
            return self._with_head(part, lambda head, e: jnp.where(untying, jnp.transpose(e, self.axes), head))

        return optax.tree_map_params(lambda placeholder: jax.eval_shape(optimizer.init, placeholder), copied,
                                     opt_state, is_leaf=lambda _: True)

    def _with_head(self, tree, head_of):
        """tree with its W_U leaf head_of(W_U, E), where the tree holds both (one that optax masked holds neither)."""
        leaves = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
        if self.embedding not in leaves or self.unembedding not in leaves:
            return tree
        e = leaves[self.embedding]
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: head_of(leaf, e) if jax.tree_util.keystr(path) == self.unembedding else leaf, tree)


class TiedOptimizer(NamedTuple):
    """An optax GradientTransformation (its init and update) with the tying the train step applies around it."""

    init: Any
    update: Any
    tying: Tying


def tied(optimizer: optax.GradientTransformation, declared, untie_step: int) -> TiedOptimizer:
    """`optimizer` for the params `declared`, their tables one until untie_step (Tying)."""
    return TiedOptimizer(optimizer.init, optimizer.update, Tying.of(declared, untie_step))
