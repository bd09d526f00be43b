"""The batch-size schedule (train.batch_schedule): the rows of each step as a function of the step.

    schedule = ((s₁, r₁), (s₂, r₂), …)      s₁ < s₂ < …
    rows(t)   = r_i for the first i with t < s_i;  R (the run's rows a step) for t ≥ the last s_i
    before(t) = Σ_{u<t} rows(u)                  the rows drawn before step t

Every step runs at the run's micro-batch B (train.batch_size), as rows(t)/B micro-batches: one
compiled train step per distinct rows(t), so each r_i must be a multiple of B (and so of the
devices B is split over). A step's batch is still a pure function of (seed, step) (its size is
rows(step), a packed corpus's rows start at before(step)): a resumed run sees the batches an
uninterrupted one would. The learning-rate schedule stays a function of the step.
"""

from __future__ import annotations

from typing import Any

from jaxgpt.errors import ConfigError, is_int

Schedule = tuple[tuple[int, int], ...]


def checked(schedule: Any, micro_batch: int | None) -> Schedule:
    """The schedule as a tuple of (until_step, rows) pairs; ConfigError, in one line, unless each is
    a pair of positive integers, the steps increase, and each rows is a multiple of the
    micro-batch (when it is known; None: chosen later to divide them all, jaxgpt.train.micro_batch)."""
    pairs = tuple(tuple(pair) if isinstance(pair, (tuple, list)) else (pair,) for pair in schedule or ())
    if not all(len(pair) == 2 and all(is_int(n) and n > 0 for n in pair) for pair in pairs):
        raise ConfigError(f"train.batch_schedule={schedule!r}: must be (until_step, rows) pairs of positive integers, "
                          "e.g. ((200, 16), (600, 32)): 16 rows a step before step 200, 32 before 600, then the run's")
    steps = [step for step, _ in pairs]
    if steps != sorted(set(steps)):
        raise ConfigError(f"train.batch_schedule={schedule!r}: its until_steps must increase (each pair holds until "
                          "its step)")
    for step, rows in pairs:
        if micro_batch and rows % micro_batch:
            raise ConfigError(f"train.batch_schedule: {rows} rows a step before step {step} is not a multiple of the "
                              f"micro-batch train.batch_size={micro_batch} (each step runs rows/batch_size "
                              f"micro-batches): choose a multiple of {micro_batch}")
    return tuple((int(step), int(rows)) for step, rows in pairs)


def rows_at(schedule: Schedule, rows: int, step: int) -> int:
    """rows(step): the first pair's rows whose until_step is past `step`; `rows` after the last."""
    return next((r for until, r in schedule if step < until), rows)


def rows_before(schedule: Schedule, rows: int, step: int) -> int:
    """Σ_{u<step} rows(u), in closed form: each phase's rows times its steps before `step`."""
    total, start = 0, 0
    for until, r in schedule:
        total += r * max(0, min(step, until) - start)
        start = max(start, until)
    return total + rows * max(0, step - start)


def distinct_rows(schedule: Schedule, rows: int, start: int = 0, end: int | None = None) -> tuple[int, ...]:
    """The distinct rows(t) of the steps start ≤ t < end (None: on): one compiled train step each."""
    found, begin = set(), 0
    for until, r in schedule:
        if max(begin, start) < (until if end is None else min(until, end)):
            found.add(r)
        begin = until
    if end is None or max(begin, start) < end:
        found.add(rows)
    return tuple(sorted(found))
