"""Evaluation of a model on a token array: loss (nats per token), perplexity and bits per byte.

    loss = −(1/N) Σ_i log p(x_{i+1} | x_{≤i}),   ppl = exp(loss),   bpb = loss / (ln 2 · bytes/token)

over the sequential windows of `data.eval_batch`, every target counted once. Targets equal
to `ignore_id` (e.g. <|unk|>) can be left out of N; `id_share` and `known_bytes_per_token`
measure a split's targets for that.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt import data, programs
from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT
from jaxgpt.tokenizers import Tokenizer
from jaxgpt.train.step import as_model, batch_fields, make_eval_step

_EVAL_STEPS: dict = {}
_CHUNK = 1 << 22  # tokens per pass over a (memory-mapped) split


def evaluate_tokens(model: GPT | GPTConfig, params, tokens, bytes_per_token: float, *, batch_size: int,
                    stride: int | None = None, max_batches: int | None = None, batch_sharding=None,
                    on_batch: Callable[[int, int], None] | None = None, ignore_id: int | None = None) -> dict:
    """Loss, perplexity and bits per byte of the model on a token array, over the sequential
    windows of `data.eval_batch` (every target counted once; `stride` < block_size gives each
    target more context). `max_batches` keeps only the first ones; `on_batch(done, total)`
    is called after each batch. With `ignore_id`, targets equal to it are left out of the
    loss (the inputs stay as they are) and "val_ignored" says how many were."""
    T = as_model(model).cfg.block_size
    count = data.num_eval_batches(len(tokens), batch_size=batch_size, block_size=T, stride=stride)

    def make_batch(index: int, rows: slice):
        return data.eval_batch(tokens, index, batch_size=batch_size, block_size=T, stride=stride, rows=rows)

    return _evaluate(model, params, make_batch, min(count, max_batches or count), batch_size, bytes_per_token,
                     batch_sharding, on_batch, ignore_id)


def evaluate_examples(model: GPT | GPTConfig, params, examples: data.Examples, layout: data.Layout,
                      bytes_per_token: float, *, batch_size: int, max_batches: int | None = None,
                      batch_sharding=None, on_batch: Callable[[int, int], None] | None = None,
                      ignore_id: int | None = None) -> dict:
    """`evaluate_tokens` for a records split: the loss over the completion targets of its
    examples (and their <|eos|>), each example in the packed rows of `layout`; bits per byte
    with the completions' bytes per token."""
    count = data.num_eval_rows(layout, batch_size)

    def make_batch(index: int, rows: slice):
        return data.eval_rows(examples, layout, index, batch_size=batch_size, rows=rows)

    return _evaluate(model, params, make_batch, min(count, max_batches or count), batch_size, bytes_per_token,
                     batch_sharding, on_batch, ignore_id)


def _evaluate(model, params, make_batch, count_batches, batch_size, bytes_per_token, batch_sharding, on_batch,
              ignore_id) -> dict:
    model = as_model(model)
    if batch_sharding is None:
        batch_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    sums = np.zeros(3)  # Σ loss, count, ignored
    in_flight: collections.deque = collections.deque()
    with data.DeviceBatches(make_batch, start_step=0, end_step=count_batches, batch_size=batch_size,
                            sharding=batch_sharding) as batches:
        for index, (x, y, m, *packed) in batches:
            args = (params, x, y, m, np.int32(-1 if ignore_id is None else ignore_id), *packed)
            in_flight.append((index, _program(model, args).result()(*args)))
            # read each batch's sums once the next batch is on its way: the devices never wait
            while len(in_flight) > (1 if index + 1 < count_batches else 0):
                done, results = in_flight.popleft()
                sums += np.asarray(jax.device_get(results), np.float64)
                if on_batch:
                    on_batch(done + 1, count_batches)
    loss_sum, count, ignored = sums
    loss = loss_sum / max(count, 1.0)
    result = {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
              "val_bpb": data.bits_per_byte(loss, bytes_per_token), "val_tokens": int(count)}
    return result if ignore_id is None else {**result, "val_ignored": int(ignored)}


def prepare(model: GPT, params, batch_size: int, packed: bool, batch_sharding, compiler=None) -> None:
    """Start making the eval step for `params` (arrays or their jax.ShapeDtypeStructs, shardings
    included) and batches of `batch_size` rows laid out as `batch_sharding` (packed: a records
    split's rows): read back or compiled on `compiler`'s thread (programs.compiled) while the caller
    goes on (train.py: while the state is made); evaluate_tokens/evaluate_examples then find it."""
    T = model.cfg.block_size
    fields = batch_fields(batch_size, T, packed=True) if packed else (
        ((batch_size, T), jnp.dtype(jnp.int32)), ((batch_size, T), jnp.dtype(jnp.int32)),
        ((batch_size, T), jnp.dtype(bool)))
    batch = [jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding) for shape, dtype in fields]
    _program(model, (params, *batch[:3], jax.ShapeDtypeStruct((), jnp.int32), *batch[3:]), compiler)


def _program(model: GPT, args: tuple, compiler=None) -> programs.Pending:
    """The eval step for arguments like `args` (as programs.compiled gives it): one per model and
    arguments' layout, however often it is evaluated; within programs.keeping, kept and read back
    untraced."""
    description = repr(("eval_step", model.cfg, model.compute, programs.abstract(args)))
    if (model, description) not in _EVAL_STEPS:
        _EVAL_STEPS[model, description] = programs.compiled(
            description, "eval_step", lambda name: jax.jit(programs.renamed(ignoring_step(model), name)).lower(*args),
            compiler)
    return _EVAL_STEPS[model, description]


def ignoring_step(model: GPT):
    """The eval step with the targets equal to `ignore_id` taken out of the mask:
    (Σ loss, count, how many were taken out)."""
    eval_step = make_eval_step(model)

    def step(params, inputs, targets, mask, ignore_id, positions=None, segments=None):
        ignored = mask & (targets == ignore_id)
        loss_sum, count = eval_step(params, inputs, targets, mask & ~ignored, positions, segments)
        return loss_sum, count, ignored.sum()

    return step


def id_share(tokens, token_id: int | None) -> float:
    """The share of a split's targets (every token after the first) that are `token_id`;
    0 when it is None (e.g. the unk_id of a tokenizer that has no <|unk|>)."""
    targets = len(tokens) - 1
    if token_id is None or targets < 1:
        return 0.0
    found = sum(int(np.count_nonzero(tokens[start:start + _CHUNK] == token_id))
                for start in range(1, len(tokens), _CHUNK))
    return found / targets


def known_bytes_per_token(tokens, tokenizer: Tokenizer) -> float:
    """UTF-8 bytes per target that is not <|unk|>, each counted as the bytes of its own token
    (special tokens none): the text those targets stand for. Exact for character and
    byte-level tokenizers; a word tokenizer's spaces between words are not counted."""
    token_bytes = np.array([len(tokenizer.decode([i]).encode("utf-8")) for i in range(tokenizer.vocab_size)])
    total = known = 0
    for start in range(1, len(tokens), _CHUNK):
        chunk = np.asarray(tokens[start:start + _CHUNK])
        chunk = chunk[chunk != tokenizer.unk_id] if tokenizer.unk_id is not None else chunk
        total, known = total + int(token_bytes[chunk].sum()), known + len(chunk)
    return total / known if total else math.nan  # no bytes: no bits per byte
