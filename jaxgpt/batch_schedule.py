"""The shape of each step's batch as a function of the step: train.batch_schedule (its rows),
train.length_schedule (the tokens of each row) and train.window_schedule (how far back attention
reaches). Each schedule is ((s₁, v₁), (s₂, v₂), …) with s₁ < s₂ < …:

    v(t)       = v_i for the first i with t < s_i;  the run's own value for t ≥ the last s_i
    rows(t)    the batch schedule's, after it the run's rows a step (R)
    length(t)  the length schedule's, after it model.block_size
    window(t)  the window schedule's, after it none (the whole context)
    tokens_before(t) = Σ_{u<t} rows(u)·length(u)

Every step runs at the run's micro-batch B (train.batch_size), as rows(t)/B micro-batches: one
compiled train step per distinct shape (rows(t), length(t), window(t)), so each scheduled rows
is a multiple of B (and so of the devices B is split over). A step's batch is still a pure
function of (seed, step): its size is rows(step) windows of length(step) + 1 tokens (a packed
corpus's rows start at rows_before(step)), so a resumed run sees the batches an uninterrupted one
would. Evaluation always reads whole blocks with the whole context ("widened for validation"), and
the learning-rate schedule stays a function of the step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxgpt.errors import ConfigError, is_int

Schedule = tuple[tuple[int, int], ...]

# each schedule's key, what its values are, and an example of one
SCHEDULES = {"batch_schedule": ("rows", "((200, 16), (600, 32)): 16 rows a step before step 200, 32 before 600, "
                                        "then the run's"),
             "length_schedule": ("length", "((100, 32), (200, 48)): rows of 32 tokens before step 100, 48 before "
                                           "200, then model.block_size"),
             "window_schedule": ("window", "((100, 16),): attention reaches 16 positions back (itself and 15 "
                                           "before) before step 100, then the whole context")}


class Shape(NamedTuple):
    """A step's batch: rows of `length` tokens, attention reaching `window` positions back (None: all)."""

    rows: int
    length: int
    window: int | None = None


def checked(schedule: Any, key: str = "batch_schedule") -> Schedule:
    """The schedule train.`key` as a tuple of (until_step, value) pairs; ConfigError, in one line,
    unless each is a pair of positive integers and the steps increase."""
    pairs = tuple(tuple(pair) if isinstance(pair, (tuple, list)) else (pair,) for pair in schedule or ())
    what, example = SCHEDULES[key]
    if not all(len(pair) == 2 and all(is_int(n) and n > 0 for n in pair) for pair in pairs):
        raise ConfigError(f"train.{key}={schedule!r}: must be (until_step, {what}) pairs of positive integers, "
                          f"e.g. {example}")
    steps = [step for step, _ in pairs]
    if steps != sorted(set(steps)):
        raise ConfigError(f"train.{key}={schedule!r}: its until_steps must increase (each pair holds until its step)")
    return tuple((int(step), int(value)) for step, value in pairs)


def check_rows(schedule: Schedule, micro_batch: int | None) -> None:
    """Each scheduled rows a multiple of the micro-batch, when it is known (None: chosen later to
    divide them all, jaxgpt.train.micro_batch)."""
    for step, rows in schedule:
        if micro_batch and rows % micro_batch:
            raise ConfigError(f"train.batch_schedule: {rows} rows a step before step {step} is not a multiple of the "
                              f"micro-batch train.batch_size={micro_batch} (each step runs rows/batch_size "
                              f"micro-batches): choose a multiple of {micro_batch}")


def value_at(schedule: Schedule, default, step: int):
    """v(step): the first pair's value whose until_step is past `step`; `default` after the last."""
    return next((value for until, value in schedule if step < until), default)


def rows_at(schedule: Schedule, rows: int, step: int) -> int:
    """rows(step) of a batch schedule, `rows` after its last pair."""
    return value_at(schedule, rows, step)


def rows_before(schedule: Schedule, rows: int, step: int) -> int:
    """Σ_{u<step} rows(u), in closed form: each phase's rows times its steps before `step`."""
    return sum((end - start) * rows_at(schedule, rows, start) for start, end in _phases((schedule,), 0, step))


def shape_at(train, block_size: int, step: int) -> Shape:
    """(rows(step), length(step), window(step)) of train's three schedules."""
    return Shape(rows_at(train.batch_schedule, train.step_rows, step),
                 value_at(train.length_schedule, block_size, step), value_at(train.window_schedule, None, step))


def shapes(train, block_size: int, start: int = 0, end: int | None = None) -> tuple[Shape, ...]:
    """The distinct shapes of the steps start ≤ t < end (None: train.steps): one compiled train step each."""
    end = train.steps if end is None else end
    found = {shape_at(train, block_size, a) for a, _ in _phases(_schedules(train), start, end)}
    return tuple(sorted(found, key=lambda shape: (shape.rows, shape.length, shape.window or 0)))


def tokens_before(train, block_size: int, step: int) -> int:
    """Σ_{u<step} rows(u)·length(u): the tokens of the steps before `step`."""
    total = 0
    for start, end in _phases(_schedules(train), 0, step):
        shape = shape_at(train, block_size, start)
        total += (end - start) * shape.rows * shape.length
    return total


def _schedules(train) -> tuple[Schedule, ...]:
    return train.batch_schedule, train.length_schedule, train.window_schedule


def _phases(schedules: tuple[Schedule, ...], start: int, end: int) -> list[tuple[int, int]]:
    """[start, end) cut at every until_step of the schedules: within each piece every value is constant."""
    if start >= end:
        return []
    cuts = sorted({start, end, *(until for schedule in schedules for until, _ in schedule if start < until < end)})
    return list(zip(cuts, cuts[1:], strict=False))
