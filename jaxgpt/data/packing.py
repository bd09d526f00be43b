"""Packing: examples laid into rows of block_size positions, and their batches as pure
functions of (seed, step).

An example of n tokens takes n − 1 positions of a row: inputs x₀…x_{n−2}, targets x₁…x_{n−1}.
`plan` lays the examples into rows once per run, first fit in order over the last
OPEN_ROWS rows still open ('pack'), or one example per row ('pad'); the rest of a row is
padding. In a row each example has its own segment id (1, 2, …; padding 0) and positions
that restart at 0, so the model attends within each example only (jaxgpt.model.GPT).

An example longer than block_size + 1 tokens keeps its first block_size + 1 under
truncate='completion' (its completion loses its tail) and is left out when its prompt alone
fills the block; both are counted. Under truncate='error' either is a one-line error that
names the record.

Row r of the global batch of step s is row π_e(i) of the layout, for i = (s·B + r) mod R,
e = ⌊(s·B + r) / R⌋ the epoch (s·B: the rows drawn before step s, Σ of each step's own under a
batch-size schedule) and π_e a permutation drawn from (seed, e): every row once
per epoch, in a new order each epoch, and any batch can be made on its own, so a resumed
run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxgpt.data.batches import check_sizes, row_range, step_rng
from jaxgpt.data.examples import Examples
from jaxgpt.errors import DataError

OPEN_ROWS = 8  # rows first fit may still add to; the oldest is closed when a ninth opens


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which examples share each row: row r holds members[row_starts[r]:row_starts[r+1]],
    example i cut to kept[i] tokens."""

    row_starts: np.ndarray
    members: np.ndarray
    kept: np.ndarray
    block_size: int
    truncated: int  # examples that lost their completion's tail
    dropped: int  # examples left out: their prompt alone fills the block

    @property
    def rows(self) -> int:
        return len(self.row_starts) - 1

    @property
    def padding(self) -> float:
        """The share of the rows' positions that are padding."""
        used = int(np.maximum(self.kept[self.members] - 1, 0).sum())
        return 1 - used / max(self.rows * self.block_size, 1)

    def summary(self, split: str) -> str:
        return (f"{split}: {len(self.members)} examples in {self.rows} rows of {self.block_size} positions "
                f"({self.padding:.1%} padding); {self.truncated} truncated, {self.dropped} left out (longer than "
                "the block)")


def plan(examples: Examples, block_size: int, packing: str = "pack", truncate: str = "completion") -> Layout:
    """The rows of a split's examples (see the module docstring)."""
    if packing not in ("pack", "pad") or truncate not in ("completion", "error"):
        raise DataError(f"packing={packing!r}, truncate={truncate!r}: must be 'pack' or 'pad', and 'completion' "
                        "or 'error'")
    kept, truncated, dropped = _kept_lengths(examples, block_size, truncate)
    rows: list[list[int]] = []
    open_rows: list[tuple[list[int], list[int]]] = []  # (free positions, members) of the open rows
    for i in np.flatnonzero(kept):
        need = int(kept[i]) - 1
        target = next((row for row in open_rows if row[0][0] >= need), None) if packing == "pack" else None
        if target is None:
            target = ([block_size], [])
            open_rows.append(target)
            if len(open_rows) > OPEN_ROWS or packing == "pad":
                rows.append(open_rows.pop(0)[1])
        target[0][0] -= need
        target[1].append(int(i))
    rows += [members for _, members in open_rows]
    rows = [members for members in rows if members]
    row_starts = np.cumsum([0] + [len(members) for members in rows])
    members = np.asarray([i for row in rows for i in row], np.int64)
    return Layout(row_starts, members, kept, block_size, truncated, dropped)


def _kept_lengths(examples: Examples, block_size: int, truncate: str) -> tuple[np.ndarray, int, int]:
    lengths = examples.lengths
    kept = np.minimum(lengths, block_size + 1)
    truncated = dropped = 0
    for i in np.flatnonzero(lengths > block_size + 1):
        prompt = int(np.argmax(examples.example(i)[1]))  # tokens before the first completion token
        if truncate == "error":
            what = (f"its prompt alone is {prompt} tokens" if prompt > block_size else
                    f"it is {lengths[i]} tokens")
            raise DataError(f"{examples.where(i)}: {what}, more than block_size + 1 = {block_size + 1}; raise "
                            "model.block_size, shorten the record, or set data.truncate='completion'")
        if prompt > block_size:  # not one completion token would be a target
            kept[i] = 0
            dropped += 1
        else:
            truncated += 1
    return kept, truncated, dropped


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, rows: int) -> np.ndarray:
    """π_e: a uniformly random permutation of the rows, drawn by step_rng(seed, epoch)."""
    return step_rng(seed, epoch).permutation(rows)


def packed_batch(examples: Examples, layout: Layout, *, seed: int, step: int, batch_size: int,
                 rows: slice | tuple[int, int] | None = None, loss_on: str = "completion",
                 drawn_before: int | None = None) -> tuple[np.ndarray, ...]:
    """(inputs, targets, mask, positions, segments), each (rows, block_size): rows of the
    global training batch of `step` (see the module docstring). The mask is True on the
    targets the loss counts: completions and their <|eos|> (loss_on='completion') or every
    target of an example (loss_on='all'); never on padding. `drawn_before`: the rows of the
    steps before (None: step · batch_size; a batch-size schedule's jaxgpt.batch_schedule.rows_before)."""
    check_sizes(batch_size, layout.block_size)
    if layout.rows == 0:
        raise DataError("no example fits in a row: raise model.block_size or shorten the records")
    first, last = row_range(rows, batch_size)
    start = step * batch_size if drawn_before is None else drawn_before
    chosen = []
    for g in range(start + first, start + last):
        epoch, i = divmod(g, layout.rows)
        chosen.append(int(_permutation(int(seed), epoch, layout.rows)[i]))
    return _fill(examples, layout, chosen, loss_on)


def num_eval_rows(layout: Layout, batch_size: int) -> int:
    """How many batches `eval_rows` has: every row of the layout once."""
    return -(-layout.rows // batch_size)


def eval_rows(examples: Examples, layout: Layout, index: int, *, batch_size: int,
              rows: slice | tuple[int, int] | None = None) -> tuple[np.ndarray, ...]:
    """Batch `index` of the layout's rows in order, the mask on completions only; rows past the
    last are padding (nothing counted)."""
    first, last = row_range(rows, batch_size)
    chosen = [r if r < layout.rows else -1 for r in range(index * batch_size + first, index * batch_size + last)]
    return _fill(examples, layout, chosen, "completion")


def _fill(examples: Examples, layout: Layout, chosen: list[int], loss_on: str) -> tuple[np.ndarray, ...]:
    T = layout.block_size
    inputs, targets, segments = (np.zeros((len(chosen), T), np.int32) for _ in range(3))
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (len(chosen), T)).copy()
    mask = np.zeros((len(chosen), T), bool)
    for r, row in enumerate(chosen):
        at = 0
        for segment, i in enumerate(layout.members[layout.row_starts[row]:layout.row_starts[row + 1]] if row >= 0
                                    else [], start=1):
            tokens, completion = examples.example(int(i))
            n = int(layout.kept[i]) - 1
            span = slice(at, at + n)
            inputs[r, span], targets[r, span] = tokens[:n], tokens[1:n + 1]
            mask[r, span] = completion[1:n + 1] if loss_on == "completion" else True
            positions[r, span], segments[r, span] = np.arange(n), segment
            at += n
        positions[r, at:] = np.arange(T - at)  # the padding: a segment (0) of its own
    return inputs, targets, mask, positions, segments
