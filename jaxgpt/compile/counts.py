"""What XLA's cost analysis leaves out of a compiled program's FLOPs and bytes: it counts a loop's
body once. Each loop's parts are compiled on their own here, and the report adds them back
(jaxgpt.compile.figures) as (times, compiled program) pairs:

    train step   grad_accum micro-batches, each with C chunks of the loss (compute.loss_chunk;
                 C = 1 without), and what runs once a step outside them: the value tables' rows
                 looked up before and their gradient after (train.step.looked_up), and the update.
                 XLA counts one micro-batch with one chunk, and that once: counted = micro + outside,
                 so with the step's figures × grad_accum
                     actual = grad_accum·counted − (grad_accum − 1)·outside + grad_accum·(C − 1)·chunk
    eval step    its C chunks of the loss: actual = counted + (C − 1)·chunk (forward only)

chunk: one chunk's logits, loss and gradient as chunked.chunked_cross_entropy computes them (its
target scores for the eval step), the unembedding's weights gathered whole on every device as
in the loop; outside: the value tables' lookup of the step's tokens and the gradient of their rows
returned to them (none without value tables, or where no mesh splits the rows), the optimizer's update
and its application to the parameters.
"""

from __future__ import annotations

import math
from typing import Any

Extras = tuple[tuple[int, Any], ...]  # (times, compiled program) pairs to add to a program's counts


def chunks(tokens: int, chunk: int) -> int:
    """C: the chunks of `chunk` tokens (over all devices) a loss over `tokens` tokens runs."""
    return math.ceil(tokens / chunk)


def train_extras(gpt, mesh, optimizer, abstract, rows: int, grad_accum: int) -> Extras:
    """The train step's pairs: what runs outside its loop counted grad_accum − 1 times too many, and
    each micro-batch of `rows` rows its C − 1 chunks of the loss counted too few."""
    extras = []
    if grad_accum > 1:
        with _mesh(mesh):
            extras.append((-(grad_accum - 1), _outside_program(gpt, mesh, optimizer, abstract, rows, grad_accum)))
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


def _outside_program(gpt, mesh, optimizer, abstract, rows: int, grad_accum: int):
    """The train step's work outside its loop, as it does it (train.step.make_train_step): the value
    tables' rows of grad_accum micro-batches of `rows` rows looked up, their gradient returned to the
    tables, and the optimizer's update of the abstract state's params from gradients laid out as them."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxgpt.axes import BATCH_AXES
    from jaxgpt.train.step import looked_up

    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    micro = NamedSharding(mesh, PartitionSpec(None, BATCH_AXES))  # (k, B, T): each micro-batch's rows split
    tokens = jax.ShapeDtypeStruct((grad_accum, rows, gpt.cfg.block_size), jnp.int32, sharding=micro)
    found = jax.eval_shape(lambda p, t: looked_up(gpt, p, t)[0], abstract.params, tokens)
    row_grads = jax.tree.map(lambda row: jax.ShapeDtypeStruct(row.shape, row.dtype, sharding=micro), found)

    def outside(params, opt_state, grads, tokens, row_grads):
        looked, pull_back = looked_up(gpt, params, tokens)
        if pull_back is not None:
            grads = jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, grads, pull_back(row_grads)),
                                                     shardings.params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, looked

    jitted = jax.jit(outside, in_shardings=(shardings.params, shardings.opt_state, shardings.params, micro, micro),
                     out_shardings=(shardings.params, shardings.opt_state, micro), donate_argnums=(0, 1))
    return jitted.lower(abstract.params, abstract.opt_state, abstract.params, tokens, row_grads).compile()
