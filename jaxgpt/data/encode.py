"""Documents encoded in parallel, in order: batches go to worker processes (the tokenizer sent
once to each, when it starts) and come back in the order they were submitted, so the tokens
are the same whatever the number of workers. At most 2 · workers batches are in flight, so
memory stays bounded however long the stream.

A stream that fits in one batch is encoded in this process: no worker is started for it.
Workers are spawned, not forked: a process that has started JAX holds threads a fork would
copy mid-flight. As with any spawned worker, each imports the main script again: a script
that prepares data at its top level needs `if __name__ == "__main__":` (one that does not is
told so, rather than left waiting).

Workers die with their parent however it ends (kill -9 included): on Linux the kernel kills
them (PR_SET_PDEATHSIG), elsewhere each polls its parent every second. A stream stopped before
its end (Ctrl-C, an error) terminates its workers at once rather than waiting for the batches
they are encoding, which would be thrown away.

The same workers count the pieces of a tokenizer's sample, for a kind that learns from counted
pieces (`counted`): there each worker is a pool of its own, whose tally adds up the batches it
gets and is sent back once, at the end (not one count per batch, which the parent would have to
add up alone).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from itertools import chain, islice
from typing import Any, TypeVar

import numpy as np

from jaxgpt.errors import DataError
from jaxgpt.tokenizers import Tokenizer
from jaxgpt.tokenizers.base import Tally, count_here

BATCHES_PER_WORKER = 2  # in flight: one being encoded, one waiting, per worker
PARENT_POLL_SECONDS = 1.0  # where the kernel cannot kill a worker with its parent, it looks this often
PR_SET_PDEATHSIG = 1  # prctl option: the signal a process gets when its parent ends (linux/prctl.h)
WORKER_ENV = "JAXGPT_ENCODING_WORKER"  # set in the workers' environment: a worker never prepares data
UNGUARDED = ("an encoding worker stopped before it began: a script that calls jaxgpt.data.prepare must do so under "
             "`if __name__ == '__main__':` (each worker imports the script again), or set data.workers=1")

Batch = list[tuple[str, str]]  # (split, document)
Encoded = tuple[str, np.ndarray, int, int | None]  # (split, ids, UTF-8 bytes, an id outside the vocabulary)
Item = TypeVar("Item")


def default_workers() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def encode_documents(tokenizer: Tokenizer, batch: Batch, dtype: np.dtype) -> list[Encoded]:
    """Each document's ids (as `dtype`), its UTF-8 byte count, and the first id outside the
    tokenizer's vocabulary (None when all are inside: an id outside is never cast)."""
    encoded = []
    for split, document in batch:
        ids = np.asarray(tokenizer.encode(document), np.int64)
        bad = None
        if len(ids) and not 0 <= ids.min() <= ids.max() < tokenizer.vocab_size:
            bad = int(ids.min() if ids.min() < 0 else ids.max())
        encoded.append((split, ids.astype(dtype) if bad is None else ids[:0].astype(dtype),
                        len(document.encode("utf-8")), bad))
    return encoded


def encoded_stream(items: Iterable[tuple[str, str]], tokenizer: Tokenizer, dtype: np.dtype, *,
                   workers: int, batch_chars: int) -> Iterator[Encoded]:
    """encode_documents over `items`, document by document, in order."""
    head, rest = _first_two(_batches(items, batch_chars, lambda item: len(item[1])))
    if len(head) < 2 or workers == 1:
        for batch in chain(head, rest):
            yield from encode_documents(tokenizer, batch, dtype)
        return
    with _pools(1, workers, _start_worker, (tokenizer, dtype)) as (pool,):
        pending: deque[Future] = deque()
        for batch in chain(head, rest):
            pending.append(pool.submit(_encode_in_worker, batch))
            if len(pending) >= BATCHES_PER_WORKER * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()


def counted(tally: Tally, documents: Iterable[str], *, workers: int, batch_chars: int) -> list:
    """The results of copies of `tally` that together added every document (a Counting), one
    copy per worker process (see the module docstring); in this process when the documents fit
    in one batch or `workers` is 1."""
    head, rest = _first_two(_batches(documents, batch_chars, len))
    if len(head) < 2 or workers == 1:
        return count_here(tally, chain.from_iterable(chain(head, rest)))
    with _pools(workers, 1, _start_counter, (tally,)) as pools:
        pending: list[deque[Future]] = [deque() for _ in pools]
        for batch in chain(head, rest):
            k = _least_busy(pending)
            pending[k].append(pools[k].submit(_count_in_worker, batch))
        wait([future for queue in pending for future in queue])
        for future in chain.from_iterable(pending):
            future.result()  # raises a worker's error
        return [pool.submit(_result_in_worker).result() for pool in pools]


def _least_busy(pending: list[deque[Future]]) -> int:
    """The worker with the fewest batches in flight, once it has fewer than BATCHES_PER_WORKER
    (waiting for one to finish when none has)."""
    while True:
        for queue in pending:
            while queue and queue[0].done():  # a pool of one process finishes its batches in order
                queue.popleft().result()
        k = min(range(len(pending)), key=lambda k: len(pending[k]))
        if len(pending[k]) < BATCHES_PER_WORKER:
            return k
        wait([future for queue in pending for future in queue], return_when=FIRST_COMPLETED)


@contextlib.contextmanager
def _pools(count: int, processes: int, initializer: Callable[..., None], initargs: tuple) \
        -> Iterator[list[ProcessPoolExecutor]]:
    """`count` pools of `processes` spawned workers each, started by initializer(*initargs, this
    process's id); left early (Ctrl-C, an error, a stream closed), their workers are ended at once."""
    os.environ[WORKER_ENV] = "1"  # inherited by the workers as they start (on the first submissions)
    context = multiprocessing.get_context("spawn")
    pools = [ProcessPoolExecutor(processes, mp_context=context, initializer=initializer,
                                 initargs=(*initargs, os.getpid())) for _ in range(count)]
    finished = False
    try:
        yield pools
        finished = True
    except BrokenProcessPool:
        raise DataError(UNGUARDED) from None
    finally:
        os.environ.pop(WORKER_ENV, None)
        for pool in pools:
            if not finished:
                _terminate_workers(pool)
            pool.shutdown(wait=True, cancel_futures=True)


def _terminate_workers(pool: ProcessPoolExecutor) -> None:
    """End the pool's workers now, mid-batch."""
    if hasattr(pool, "terminate_workers"):  # Python ≥ 3.14
        pool.terminate_workers()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):  # before 3.14, the only handle
        process.terminate()


def _batches(items: Iterable[Item], batch_chars: int, chars: Callable[[Item], int]) -> Iterator[list[Item]]:
    """`items` in lists of at least `batch_chars` characters (`chars` of each), the last one shorter."""
    batch: list[Item] = []
    size = 0
    for item in items:
        batch.append(item)
        size += chars(item)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _first_two(batches: Iterator[list[Item]]) -> tuple[list[list[Item]], Iterator[list[Item]]]:
    """(the first two batches, or fewer when there are fewer; the others)."""
    return list(islice(batches, 2)), batches


_worker_tokenizer: tuple[Tokenizer, np.dtype] | None = None  # what an encoding worker encodes with
_worker_tally: Tally | None = None  # what a counting worker adds its batches to


def _start_worker(tokenizer: Tokenizer, dtype: np.dtype, parent: int) -> None:
    global _worker_tokenizer
    _start(parent)
    _worker_tokenizer = tokenizer, dtype


def _start_counter(tally: Tally, parent: int) -> None:
    global _worker_tally
    _start(parent)
    _worker_tally = tally


def _start(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the pool
    die_with_parent(parent)


def die_with_parent(parent: int) -> None:
    """End this process when the process `parent` ends, however it ends."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent:  # it ended before the request was made
                os._exit(1)
            return
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="parent-watch").start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_SECONDS)
    os._exit(1)


def _encode_in_worker(batch: Batch) -> list[Encoded]:
    tokenizer, dtype = _worker_tokenizer
    return encode_documents(tokenizer, batch, dtype)


def _count_in_worker(documents: list[str]) -> None:
    for document in documents:
        _worker_tally.add(document)


def _result_in_worker() -> Any:
    return _worker_tally.result()
