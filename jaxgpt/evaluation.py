"""Evaluation of a model on a token array: loss (nats per token), perplexity and bits per byte.

    loss = −(1/N) Σ_i log p(x_{i+1} | x_{≤i}),   ppl = exp(loss),   bpb = loss / (ln 2 · bytes/token)

over the sequential windows of `data.eval_batch`, every target counted once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax

from jaxgpt import data
from jaxgpt.config import GPTConfig
from jaxgpt.training import make_eval_step

_EVAL_STEPS: dict = {}


def evaluate_tokens(model_cfg: GPTConfig, params, tokens, bytes_per_token: float, *, batch_size: int,
                    stride: int | None = None, max_batches: int | None = None, batch_sharding=None,
                    on_batch: Callable[[int, int], None] | None = None) -> dict:
    """Loss, perplexity and bits per byte of the model on a token array, over the sequential
    windows of `data.eval_batch` (every target counted once; `stride` < block_size gives each
    target more context). `max_batches` keeps only the first ones; `on_batch(done, total)`
    is called after each batch."""
    if model_cfg not in _EVAL_STEPS:  # one compiled step per model, however often it is evaluated
        _EVAL_STEPS[model_cfg] = jax.jit(make_eval_step(model_cfg))
    eval_step = _EVAL_STEPS[model_cfg]
    T = model_cfg.block_size
    count_batches = data.num_eval_batches(len(tokens), batch_size=batch_size, block_size=T, stride=stride)
    if max_batches:
        count_batches = min(count_batches, max_batches)
    if batch_sharding is None:
        batch_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def make_batch(index: int, rows: slice):
        return data.eval_batch(tokens, index, batch_size=batch_size, block_size=T, stride=stride, rows=rows)

    loss_sum, count = 0.0, 0.0
    with data.DeviceBatches(make_batch, start_step=0, end_step=count_batches, batch_size=batch_size,
                            sharding=batch_sharding) as batches:
        for index, (x, y, m) in batches:
            s, c = eval_step(params, x, y, m)
            loss_sum, count = loss_sum + float(s), count + float(c)
            if on_batch:
                on_batch(index + 1, count_batches)
    loss = loss_sum / max(count, 1.0)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
            "val_bpb": data.bits_per_byte(loss, bytes_per_token), "val_tokens": int(count)}
