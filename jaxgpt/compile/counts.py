"""What XLA's cost analysis leaves out of a compiled program's FLOPs and bytes: it counts a loop's
body once. Each loop's parts are compiled on their own here, and the report adds them back
(jaxgpt.compile.figures) as (times, compiled program) pairs:

    train step   grad_accum micro-batches, each with C chunks of the loss (compute.loss_chunk;
                 C = 1 without), then one update. XLA counts one micro-batch with one chunk, and
                 the update: counted = micro + update, so with the step's figures × grad_accum
                     actual = grad_accum·counted − (grad_accum − 1)·update + grad_accum·(C − 1)·chunk
    eval step    its C chunks of the loss: actual = counted + (C − 1)·chunk (forward only)

chunk: one chunk's logits, loss and gradient as chunked.chunked_cross_entropy computes them (its
target scores for the eval step), the unembedding's weights gathered whole on every device as
in the loop; update: the optimizer's update and its application to the parameters.
"""

from __future__ import annotations

import math
from typing import Any

Extras = tuple[tuple[int, Any], ...]  # (times, compiled program) pairs to add to a program's counts


def chunks(tokens: int, chunk: int) -> int:
    """C: the chunks of `chunk` tokens (over all devices) a loss over `tokens` tokens runs."""
    return math.ceil(tokens / chunk)


def train_extras(gpt, mesh, optimizer, abstract, rows: int, grad_accum: int) -> Extras:
    """The train step's pairs: the update counted grad_accum − 1 times too many, and each micro-batch
    of `rows` rows its C − 1 chunks of the loss counted too few."""
    extras = []
    if grad_accum > 1:
        with _mesh(mesh):
            extras.append((-(grad_accum - 1), _update_program(optimizer, abstract)))
    with _mesh(mesh):
        missed = _chunks_missed(gpt, rows)
        if missed:
            extras.append((grad_accum * missed, _chunk_program(gpt, mesh, abstract.params, train=True)))
    return tuple(extras)


def eval_extras(gpt, mesh, params, rows: int) -> Extras:
    """The eval step's pair: the C − 1 chunks of its targets' scores counted too few."""
    with _mesh(mesh):
        missed = _chunks_missed(gpt, rows)
        return ((missed, _chunk_program(gpt, mesh, params, train=False)),) if missed else ()


def _chunks_missed(gpt, rows: int) -> int:
    """C − 1 for a loss over `rows` rows under the current mesh: 0 without compute.loss_chunk, or in one chunk
    (nothing is compiled for it then)."""
    from jaxgpt.loss import chunk_tokens

    return chunks(rows * gpt.cfg.block_size, chunk_tokens(gpt.compute)) - 1 if gpt.compute.loss_chunk else 0


def _mesh(mesh):
    import jax

    return jax.set_mesh(mesh)


def _chunk_program(gpt, mesh, params, train: bool):
    """The compiled loss and gradient of one chunk (train) or its target scores (eval), its rows split over the
    devices as the loop splits them."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxgpt.axes import BATCH_AXES
    from jaxgpt.loss import chunk_tokens, chunked, logits_fn

    n = chunk_tokens(gpt.compute)
    row = jax.ShapeDtypeStruct((1, gpt.cfg.block_size), jnp.int32)  # a whole row, as any kernel takes (traced only)
    head = jax.eval_shape(lambda p, t: gpt.apply({"params": p}, t, hidden=True)[1], params, row)
    whole, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    head = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=whole), head)
    hidden = jax.ShapeDtypeStruct((n, gpt.cfg.d_model), gpt.compute.compute_dtype,
                                  sharding=NamedSharding(mesh, PartitionSpec(BATCH_AXES, None)))
    targets = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rows)
    if train:
        mask = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=rows)

        def loss(w, h, y, m):
            return chunked.chunked_cross_entropy(logits_fn(gpt), w, h, y, m, chunk=n)

        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(head, hidden, targets, mask)
    else:
        lowered = jax.jit(lambda w, h, y: chunked.chunked_target_scores(logits_fn(gpt), w, h, y, chunk=n)).lower(
            head, hidden, targets)
    return lowered.compile()


def _update_program(optimizer, abstract):
    """The optimizer's update of the abstract state's params from gradients shaped and laid out as them."""
    import jax
    import optax

    shardings = jax.tree.map(lambda a: a.sharding, abstract)

    def update(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    jitted = jax.jit(update, in_shardings=(shardings.params, shardings.opt_state, shardings.params),
                     out_shardings=(shardings.params, shardings.opt_state), donate_argnums=(0, 1))
    return jitted.lower(abstract.params, abstract.opt_state, abstract.params).compile()
