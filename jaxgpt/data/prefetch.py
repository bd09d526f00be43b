"""Prefetch: batches made ahead by a background thread and placed on the devices as global
jax.Arrays, each process making only the rows its devices hold."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxgpt.errors import DataError, one_line


def process_rows(sharding: jax.sharding.Sharding, batch_size: int) -> list[slice]:
    """The rows of a (batch_size, …) global batch held by this process's devices under
    `sharding` (which splits the batch dimension and replicates the others), as sorted
    contiguous slices: the process-local data of `jax.make_array_from_process_local_data`
    is these rows, in this order."""
    try:
        indices = sharding.addressable_devices_indices_map((batch_size, 1))
    except ValueError as err:
        raise DataError(f"batch_size={batch_size} cannot be laid out by {sharding}: "
                        f"{one_line(err)}; make it a multiple of the batch shards") from None
    spans = sorted({index[0].indices(batch_size)[:2] for index in indices.values()})
    merged: list[list[int]] = []
    for start, stop in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [slice(start, stop) for start, stop in merged]


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


class DeviceBatches:
    """(step, batch) for step = start_step, start_step + 1, … (up to end_step, or forever),
    each batch made ahead of time by a background thread so the devices never wait.

    make_batch(step, rows) returns a tuple of NumPy arrays: rows `rows` (a slice) of the
    global batch of that step — e.g. `train_batch(..., step=step, rows=rows)` or
    `eval_batch(tokens, step, ..., rows=rows)`. Each process calls it only for the rows its
    devices hold, and the pieces become global jax.Arrays of leading dimension batch_size
    laid out by `sharding` (`jax.make_array_from_process_local_data`).

    At most `size` batches wait on the devices. An exception in make_batch is raised by
    the `next` that would have returned that step. Use as a context manager, or call
    close(), which stops the thread and waits for it.
    """

    def __init__(self, make_batch: Callable[[int, slice], tuple[np.ndarray, ...]], *,
                 start_step: int, batch_size: int | Callable[[int], int], sharding: jax.sharding.Sharding,
                 end_step: int | None = None, size: int = 2):
        if not (isinstance(size, int) and size >= 1):
            raise DataError(f"prefetch size={size!r}: must be a positive integer")
        self._make_batch = make_batch
        self._sharding = sharding
        self._batch_size = batch_size if callable(batch_size) else (lambda step: batch_size)
        self._rows = {}  # a batch size → this process's rows of it
        self._rows_of(self._batch_size(start_step))  # a size the sharding cannot lay out: said at once
        self._step, self._end_step = start_step, end_step
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._produce, name="jaxgpt-device-batches",
                                        daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            step = self._step
            while not self._stop.is_set() and (self._end_step is None or step < self._end_step):
                self._queue.put((step, self._device_batch(step)))
                step += 1
            self._queue.put(_END)
        except BaseException as error:  # surfaced in the consumer's thread
            self._queue.put(_Failure(error))

    def _rows_of(self, batch_size: int) -> list[slice]:
        if batch_size not in self._rows:
            self._rows[batch_size] = process_rows(self._sharding, batch_size)
        return self._rows[batch_size]

    def _device_batch(self, step: int) -> tuple[jax.Array, ...]:
        batch_size = self._batch_size(step)
        pieces = [self._make_batch(step, rows) for rows in self._rows_of(batch_size)]
        arrays = []
        for parts in zip(*pieces, strict=True):
            local = parts[0] if len(parts) == 1 else np.concatenate(parts)
            global_shape = (batch_size, *local.shape[1:])
            arrays.append(jax.make_array_from_process_local_data(self._sharding, local,
                                                                 global_shape))
        return tuple(arrays)

    def __iter__(self) -> DeviceBatches:
        return self

    def __next__(self) -> tuple[int, tuple[jax.Array, ...]]:
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if item is _END or isinstance(item, _Failure):
            self._finished = True
            self._thread.join()
            if item is _END:
                raise StopIteration
            raise item.error
        return item

    def close(self) -> None:
        """Stop the thread and wait for it; batches made ahead are dropped."""
        self._finished = True
        self._stop.set()
        while self._thread.is_alive():
            try:  # make room, so that a producer blocked on a full queue can see the stop
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.01)

    def __enter__(self) -> DeviceBatches:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

