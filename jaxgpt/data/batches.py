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

    Row r of step `step` starts at h(seed, step, r) mod (len(tokens) − block_size), h a
    64-bit hash (SplitMix64's mixer), so the batch is a pure function of (seed, step) and
    every row can be made on its own: `rows` (a slice or (start, stop) of 0..batch_size)
    gives exactly those rows of the full batch.
    """
    _check_sizes(batch_size, block_size)
    if not (isinstance(step, (int, np.integer)) and step >= 0):
        raise DataError(f"step={step!r}: must be an integer ≥ 0")
    n_starts = len(tokens) - block_size  # window starts 0 … len − block_size − 1
    if n_starts < 1:
        raise DataError(f"the split has {len(tokens)} tokens, fewer than block_size + 1 = "
                        f"{block_size + 1}; use a smaller block_size or more text")
    row_ids = np.arange(*_row_range(rows, batch_size), dtype=np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps mod 2⁶⁴ by design
        key = _mix64(_mix64(np.uint64(int(seed) % 2**64)) + np.uint64(step))
        starts = _mix64(key + row_ids * _GOLDEN_GAMMA) % np.uint64(n_starts)
    windows = np.asarray(tokens[starts.astype(np.int64)[:, None] + np.arange(block_size + 1)])
    return windows[:, :-1].astype(np.int32), windows[:, 1:].astype(np.int32)


_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment: 2⁶⁴ / golden ratio


def _mix64(x):
    """SplitMix64's finalizer: a bijection of uint64 whose outputs look independent."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


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
    _check_sizes(batch_size, block_size)
    stride = _stride(stride, block_size)
    n = len(tokens)
    if n < 2:
        raise DataError(f"the split has {n} token(s); evaluation needs at least 2 (one input "
                        "and one target): raise data.val_fraction or give more text")
    first, last = _row_range(rows, batch_size)
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


def _check_sizes(batch_size: Any, block_size: Any) -> None:
    for name, value in (("batch_size", batch_size), ("block_size", block_size)):
        if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
                and value > 0):
            raise DataError(f"{name}={value!r}: must be a positive integer")


def _row_range(rows: slice | tuple[int, int] | None, batch_size: int) -> tuple[int, int]:
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


