"""Batches: pure functions of their arguments, made from a split's token array.

A training batch is a function of (seed, step), so a run resumed at step s sees exactly the
batches of an uninterrupted run, with no iterator state to save; an evaluation batch is a
function of its index. Each takes `rows`, so that a process can make only its own rows of
the global batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxgpt.errors import DataError


def train_batch(tokens: np.ndarray, *, seed: int, step: int, batch_size: int, block_size: int,
                rows: slice | tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), int32 arrays (rows, block_size): windows of block_size + 1 tokens at
    random positions, inputs their first block_size tokens and targets their last.

    The batch_size starts are drawn uniformly from 0 … len(tokens) − block_size − 1 by
    `step_rng(seed, step)`, so the batch is a pure function of (seed, step); `rows` (a slice
    or (start, stop) of 0..batch_size) gives exactly those rows of the full batch.
    """
    check_sizes(batch_size, block_size)
    if not (isinstance(step, (int, np.integer)) and step >= 0):
        raise DataError(f"step={step!r}: must be an integer ≥ 0")
    n_starts = len(tokens) - block_size  # window starts 0 … len − block_size − 1
    if n_starts < 1:
        raise DataError(f"the split has {len(tokens)} tokens, fewer than block_size + 1 = "
                        f"{block_size + 1}; use a smaller block_size or more text")
    first, last = row_range(rows, batch_size)
    starts = step_rng(seed, step).integers(n_starts, size=batch_size)[first:last]
    windows = np.asarray(tokens[starts[:, None] + np.arange(block_size + 1)])
    return windows[:, :-1].astype(np.int32), windows[:, 1:].astype(np.int32)


def step_rng(seed: int, step: int) -> np.random.Generator:
    """The random numbers of (seed, step): NumPy's Philox keyed by the pair (each mod 2⁶⁴),
    counter at 0, so every call with the same pair draws the same numbers and distinct pairs
    draw independent ones."""
    return np.random.Generator(np.random.Philox(key=[int(seed) % 2**64, int(step) % 2**64]))


def num_eval_batches(num_tokens: int, *, batch_size: int, block_size: int,
                     stride: int | None = None) -> int:
    """How many batches `eval_batches` yields for a split of `num_tokens` tokens."""
    windows = _num_eval_windows(num_tokens, block_size, _stride(stride, block_size))
    return -(-windows // batch_size)


def eval_batch(tokens: np.ndarray, index: int, *, batch_size: int, block_size: int,
               stride: int | None = None, rows: slice | tuple[int, int] | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch `index` of the evaluation windows: (inputs, targets) int32 and mask bool, each
    (rows, block_size).

    Window w starts at token w·stride (stride ≤ block_size, default block_size). The mask
    marks the targets that count: all of window 0's, and of later windows the last
    `stride` (the earlier ones were counted by the window before, which also gives those
    the longer context). Over all windows, every token after the first is a counted target
    exactly once. A window that runs past the end is padded with id 0 and the padding
    masked out; rows past the last window (in the last batch) are all padding.
    """
    check_sizes(batch_size, block_size)
    stride = _stride(stride, block_size)
    n = len(tokens)
    if n < 2:
        raise DataError(f"the split has {n} token(s); evaluation needs at least 2 (one input "
                        "and one target): raise data.val_fraction or give more text")
    first, last = row_range(rows, batch_size)
    window = np.arange(index * batch_size + first, index * batch_size + last)
    starts = window * stride
    offsets = np.arange(block_size + 1)
    positions = starts[:, None] + offsets
    windows = np.where(positions < n, np.asarray(tokens[np.minimum(positions, n - 1)]), 0)
    # Targets that exist: position j of a window holds the target at token start + j + 1.
    exists = positions[:, 1:] < n
    first_counted = np.where(window == 0, 0, block_size - stride)[:, None]
    in_range = (window < _num_eval_windows(n, block_size, stride))[:, None]
    mask = exists & (offsets[None, :-1] >= first_counted) & in_range
    inputs = np.where(in_range, windows[:, :-1], 0).astype(np.int32)
    targets = np.where(exists & in_range, windows[:, 1:], 0).astype(np.int32)
    return inputs, targets, mask


def eval_batches(tokens: np.ndarray, *, batch_size: int, block_size: int,
                 stride: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every `eval_batch` of the split, in order (see `eval_batch`)."""
    count = num_eval_batches(len(tokens), batch_size=batch_size, block_size=block_size,
                             stride=stride)
    for index in range(count):
        yield eval_batch(tokens, index, batch_size=batch_size, block_size=block_size,
                         stride=stride)


def _num_eval_windows(num_tokens: int, block_size: int, stride: int) -> int:
    """1 + ⌈(n − 1 − block_size) / stride⌉: window 0 counts targets 1…block_size, window w
    the `stride` after those of window w − 1, until target n − 1 is counted."""
    return 1 + max(0, -(-(num_tokens - 1 - block_size) // stride))


def _stride(stride: int | None, block_size: int) -> int:
    if stride is None:
        return block_size
    if not (isinstance(stride, int) and 1 <= stride <= block_size):
        raise DataError(f"eval stride {stride!r} must be an integer in 1…block_size="
                        f"{block_size}")
    return stride


def check_sizes(batch_size: Any, block_size: Any) -> None:
    """A DataError unless batch_size and block_size are positive integers."""
    for name, value in (("batch_size", batch_size), ("block_size", block_size)):
        if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
                and value > 0):
            raise DataError(f"{name}={value!r}: must be a positive integer")


def row_range(rows: slice | tuple[int, int] | None, batch_size: int) -> tuple[int, int]:
    """(start, stop) of `rows` (a slice or pair within 0…batch_size; None: all of them)."""
    if rows is None:
        return 0, batch_size
    if isinstance(rows, slice):
        start, stop, step = rows.indices(batch_size)
        if step != 1:
            raise DataError(f"rows={rows!r}: must be a contiguous range (step 1)")
    else:
        start, stop = rows
    if not 0 <= start <= stop <= batch_size:
        raise DataError(f"rows={rows!r}: must lie within 0…batch_size={batch_size}")
    return start, stop


def bits_per_byte(loss: float, bytes_per_token: float) -> float:
    """BPB = loss / (ln 2 · bytes_per_token): a mean loss in nats per token, as bits per
    UTF-8 byte of text, comparable across tokenizers."""
    return loss / (math.log(2) * bytes_per_token)


