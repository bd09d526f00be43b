"""Training: the train state and the jitted pure steps.

    state = (step, params, opt_state)
    train_step(state, batch, key) -> (state', metrics)    one optimizer update, jitted, donated
    seeded(train_step)(state, batch, seed)                 the same, its key made from (seed, step)
    eval_step(params, inputs, targets, mask[, positions, segments]) -> (Σ loss, Σ count)

A batch is (inputs, targets) windows of a token stream, or (inputs, targets, mask,
positions, segments) rows of packed examples (jaxgpt.data.packing).

Each takes `model`: a GPT(cfg, compute), what the model computes and how it runs here, or a
GPTConfig alone for GPT(cfg) with the default compute (float32, the explicit kernel).

The loop that drives them (data, logging, evaluation, checkpoints, resume) is jaxgpt.train.run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxgpt import axes, layout, ops, programs, stack
from jaxgpt.config import GPTConfig, TrainConfig
from jaxgpt.loss import chunk_tokens, chunked, logits_fn, multi_token, score_targets
from jaxgpt.model import GPT, param_layout, param_shapes
from jaxgpt.optim.tying import TiedOptimizer


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any

    def to_dict(self) -> dict:
        return {"step": self.step, "params": self.params, "opt_state": self.opt_state}

    @classmethod
    def from_dict(cls, tree: dict) -> TrainState:
        return cls(step=tree["step"], params=tree["params"], opt_state=tree["opt_state"])


def as_model(model: GPT | GPTConfig) -> GPT:
    """A GPT module: as given, or GPT(cfg) with the default compute for a GPTConfig."""
    return GPT(model) if isinstance(model, GPTConfig) else model


def loss_fn(model: GPT, params, inputs, targets, mask=None, dropout_key=None, *, positions=None, segments=None,
            count=None, ahead=None, value_rows=None, window=None):
    """Cross-entropy of the model's next-token predictions: the mean over the targets where
    `mask` is True, or their sum over `count` (see ops.cross_entropy); with compute.loss_chunk,
    the logits made and their gradient taken a chunk of tokens at a time (chunked.chunked_cross_entropy).
    ahead (K,): multi-token prediction's weights w_k, each position's logits also scored on the
    targets k − 1 further on (jaxgpt.loss.multi_token), still over the count of next-token targets.
    value_rows: the value tables' rows of `inputs`, looked up before (looked_up; see GPT). window: how far
    back attention reaches (a window schedule's step; None: the whole row)."""
    rngs = {} if dropout_key is None else {"dropout": dropout_key}
    chunk = model.compute.loss_chunk
    out = model.apply({"params": params}, inputs, positions=positions, segments=segments,
                      deterministic=dropout_key is None, rngs=rngs, hidden=bool(chunk), value_rows=value_rows,
                      window=window)
    if ahead is not None:  # K targets a position: logits (B, T, 1, V) against targets (B, T, K)
        count = (targets.size if mask is None else mask.sum(dtype=jnp.float32)) if count is None else count
        targets, mask = multi_token.targets_ahead(targets, mask, segments, ahead)
        out = out if chunk else out[..., None, :]
    if not chunk:
        return ops.cross_entropy(out, targets, mask, count)
    hidden, head = out
    return chunked.chunked_cross_entropy(logits_fn(model), head, hidden, targets, mask, count,
                                     chunk=chunk_tokens(model.compute))


def make_train_step(model: GPT | GPTConfig, optimizer: optax.GradientTransformation, schedule: Callable,
                    grad_accum: int = 1, grad_shardings=None, ahead: Callable | None = None, window=None):
    """train_step(state, batch, key) for a batch of k·B rows (k = grad_accum): batch is
    (inputs, targets) of a text stream, or (inputs, targets, mask, positions, segments) of
    packed examples (the loss only on the targets where mask is True; see GPT).

    Row i·k + j belongs to micro-batch j, so every micro-batch spreads over the devices the
    way the whole batch does. Each micro-batch's loss is its masked targets' losses summed
    over the count of masked targets in the whole batch, so the k losses and their
    gradients, summed in a lax.scan (one gradient-sized buffer), are exactly those of one
    batch of k·B rows, however unevenly the mask falls.

    grad_shardings (the params' NamedShardings): each micro-batch's gradient is laid out as
    its parameter is, so under fsdp it is reduce-scattered into the sum's shards (not
    all-reduced whole, as a sum of unknown layout would be). The value tables are read once a
    step, before the loop (looked_up): each micro-batch takes its rows and the gradient of
    them, which stay on their devices, and the tables' gradient is made of all of them once
    after it.

    ahead: step → (K,) multi-token prediction's weights at that step (ahead_weights), or None: the
    next token only (the loss reported is then the objective). window: every layer's attention
    reaches that far back (a window schedule's step; None: the whole row). An optimizer made with
    train.untie_at ties E and W_U until its untie step (`tied`: the loss reads W_U = Eᵀ, the step
    writes it; then W_U's state starts as E's)."""
    model = as_model(model)
    use_dropout = model.cfg.dropout > 0
    tie, untie_state = tied(optimizer)
    k = grad_accum

    def train_step(state: TrainState, batch, key):
        micro_batches = tuple(a.reshape(a.shape[0] // k, k, *a.shape[1:]).swapaxes(0, 1) for a in batch)
        count = batch[2].sum(dtype=jnp.float32) if len(batch) > 2 else jnp.float32(batch[1].size)

        rows, pull_back = looked_up(model, state.params, micro_batches[0])

        def micro_step(grad_sum, micro):
            (x, y, *packed), i, value_rows = micro
            mask, positions, segments = packed or (None, None, None)
            dropout_key = jax.random.fold_in(key, i) if use_dropout else None

            def objective(params, value_rows):
                return loss_fn(model, tie(params, state.step), x, y, mask, dropout_key, positions=positions,
                               segments=segments, count=count, ahead=None if ahead is None else ahead(state.step),
                               value_rows=value_rows, window=window)

            loss, (grads, row_grads) = jax.value_and_grad(objective, argnums=(0, 1))(state.params, value_rows)
            return laid_out(jax.tree.map(jnp.add, grad_sum, laid_out(grads))), (loss, row_grads)

        laid_out = (lambda tree: tree) if grad_shardings is None else (  # noqa: E731
            lambda tree: jax.lax.with_sharding_constraint(tree, grad_shardings))
        zeros = laid_out(jax.tree.map(jnp.zeros_like, state.params))
        grads, (losses, row_grads) = jax.lax.scan(micro_step, zeros, (micro_batches, jnp.arange(k), rows))
        if rows is not None:  # the tables' gradient, of every micro-batch's rows at once
            grads = laid_out(jax.tree.map(jnp.add, grads, pull_back(row_grads)))
        updates, opt_state = optimizer.update(grads, untie_state(state.opt_state, state.step), state.params)
        params = tie(optax.apply_updates(state.params, updates), state.step)
        metrics = {"loss": losses.sum(), "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step)}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def tied(optimizer) -> tuple[Callable, Callable]:
    """(tie(params, step), untie_state(opt_state, step)) of the optimizer's tying of the embedding and
    the unembedding (jaxgpt.optim.tying.Tying: W_U = Eᵀ while tied; W_U's state E's at the untie
    step), or both the identity for an optimizer without one."""
    if not isinstance(optimizer, TiedOptimizer):
        return (lambda params, step: params), (lambda opt_state, step: opt_state)
    tying = optimizer.tying
    return tying.tie, lambda opt_state, step: tying.untie_state(opt_state, step, optimizer)


def looked_up(model: GPT, params, tokens) -> tuple[Any, Callable | None]:
    """(VE_k[x] of each micro-batch's tokens, a (k, B, T, H_kv, D) for each table k, pull_back: their gradient →
    the params'): the value tables gathered whole and read once a step, outside the loop of
    micro-batches (tokens (k, B, T)); pull_back sums each device's rows into the tables'
    gradient and reduce-scatters it into their layout, once (axes.whole). (None, None) without
    value tables, or where no mesh splits the rows: the tables are then whole already and read
    in the loop, where a whole step's rows would only take memory."""
    mesh = axes.current_mesh()
    if not model.cfg.value_embeds or mesh is None or axes.batch_ways(mesh) == 1:
        return None, None
    lookup = jax.vmap(lambda p, t: stack.looked_up(model.cfg, model.compute, p, t), in_axes=(None, 0))
    rows, pull_back = jax.vjp(lambda p: lookup(p, tokens), params)
    return rows, lambda row_grads: pull_back(row_grads)[0]


def ahead_weights(train: TrainConfig) -> Callable | None:
    """step → (w_1 … w_K) of multi-token prediction (multi_token.weights_at, fading out by
    train.mtp_fraction of the schedule's steps, as the learning rate's), or None when train.mtp_tokens = 1."""
    if train.mtp_tokens == 1:
        return None
    until = train.mtp_fraction * train.schedule_steps
    return lambda step: multi_token.weights_at(step, train.mtp_tokens, train.mtp_weight, until)


def batch_fields(rows: int, block_size: int, packed: bool = False) -> tuple[tuple[tuple[int, int], Any], ...]:
    """(shape, dtype) of each field of a training batch of `rows` rows: (inputs, targets)
    int32 windows of a text stream, or packed examples' (inputs, targets, mask, positions,
    segments), the mask bool (jaxgpt.data.packing)."""
    ints = ((rows, block_size), jnp.dtype(jnp.int32))
    return (ints, ints, ((rows, block_size), jnp.dtype(bool)), ints, ints) if packed else (ints, ints)


def seeded(train_step: Callable) -> Callable:
    """train_step(state, batch, seed) of a train_step(state, batch, key): the step's key is
    fold_in(key(seed), state.step), made inside the step's own program (a loop that made it
    on the host would run two small programs per step)."""
    def seeded_step(state: TrainState, batch, seed):
        return train_step(state, batch, jax.random.fold_in(as_key(seed), state.step))

    return seeded_step


def make_eval_step(model: GPT | GPTConfig):
    """eval_step(params, inputs, targets, mask, positions=None, segments=None) -> (Σ of the
    masked targets' losses, their count); chunk by chunk with compute.loss_chunk (model.score_targets)."""
    model = as_model(model)

    def eval_step(params, inputs, targets, mask, positions=None, segments=None):
        log_probs, _ = score_targets(model, params, inputs, targets, positions=positions, segments=segments)
        mask = mask.astype(jnp.float32)
        return -(log_probs * mask).sum(), mask.sum()

    return eval_step


def init_state(model: GPT | GPTConfig, optimizer: optax.GradientTransformation, key) -> TrainState:
    """A fresh train state; `key` is a PRNG key or an integer seed (its key is made here, in
    the caller's program, rather than by programs of its own)."""
    model = as_model(model)
    tie, _ = tied(optimizer)  # with train.untie_at, W_U = Eᵀ from the start
    params = tie(model.init(as_key(key), jnp.zeros((1, model.cfg.block_size), jnp.int32))["params"], 0)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def state_shapes(model: GPT | GPTConfig, optimizer: optax.GradientTransformation) -> TrainState:
    """init_state's shapes and dtypes, from the params' declarations (model.param_shapes) and
    the optimizer's init traced on them: the model is not traced again."""
    params = param_shapes(as_model(model))
    return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                      opt_state=jax.eval_shape(optimizer.init, params))


def as_key(key_or_seed) -> jax.Array:
    """A PRNG key as it is, or the key of an integer seed."""
    if jnp.issubdtype(jnp.result_type(key_or_seed), jax.dtypes.prng_key):
        return key_or_seed
    return jax.random.key(key_or_seed)


# The init program runs once: LLVM's -O2 instead of XLA's default -O3 gives the same values
# (bit for bit) and halves its compile (2.6 s to 1.2 s for the CPU recipe; 4.4 s to 2.9 s at
# GPT-2 small, whose init then runs as fast).
INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 2}


def abstract_state(model: GPT | GPTConfig, optimizer: optax.GradientTransformation, mesh) -> TrainState:
    """The train state's shapes and dtypes (from jax.eval_shape: nothing allocated) with the
    shardings its leaves take on `mesh` by the params' declarations (jaxgpt.layout.tree_shardings:
    the params, and the optimizer state's leaves that mirror them, laid out as declared; the
    step and the other leaves whole)."""
    shapes, declared = state_shapes(model, optimizer), param_layout(as_model(model))
    where = TrainState(step=NamedSharding(mesh, P()), params=layout.tree_shardings(shapes.params, declared, mesh),
                       opt_state=layout.tree_shardings(shapes.opt_state, declared, mesh, optimizer))
    return jax.tree.map(lambda leaf, at: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=at), shapes, where)


def sharded_init(model: GPT | GPTConfig, optimizer, key, mesh):
    """(state, its shardings): a fresh state initialised into the shardings of abstract_state."""
    shardings = jax.tree.map(lambda leaf: leaf.sharding, abstract_state(model, optimizer, mesh))
    return initialise_into(model, optimizer, key, shardings), shardings


def initialise_into(model: GPT | GPTConfig, optimizer, key, shardings: TrainState, program=None) -> TrainState:
    """A fresh train state made directly in `shardings`, in one program: a large model never
    materialises on one device. `key` is a PRNG key or an integer seed; `program`, that program
    compiled already for an integer seed (lower_init's), if the caller has it."""
    if program is not None and not jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        return program(np.int32(key))  # the seed's key is made inside: no program of its own
    return jax.jit(_init(model, optimizer), out_shardings=shardings, compiler_options=INIT_COMPILER_OPTIONS)(key)


def lower_init(model: GPT | GPTConfig, optimizer, shardings: TrainState, name: str | None = None):
    """initialise_into's program, lowered for an integer seed (`name`: the program's, programs.renamed)."""
    jitted = jax.jit(programs.renamed(_init(model, optimizer), name), out_shardings=shardings,
                     compiler_options=INIT_COMPILER_OPTIONS)
    return jitted.lower(jax.ShapeDtypeStruct((), jnp.int32))


def _init(model, optimizer):
    def init(key):
        return init_state(model, optimizer, key)

    return init
