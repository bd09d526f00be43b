"""Documents encoded in parallel, in order: batches go to worker processes (the tokenizer sent
once to each, before its first batch) and come back in the order they were submitted, so the tokens
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

The same workers first count the pieces of a tokenizer's sample, for a kind that learns from
counted pieces (`Workers.counted`), as the sample is read; they are spawned once for both. Each
worker is a pool of its own, whose tally adds up the batches it gets. At the end each worker cuts
its counts into one share per worker (by a rule of the piece alone), and worker k joins the k-th
shares of all: the parent receives disjoint counts, never adding them up alone, and the joining
too is spread over the workers.
"""

from __future__ import annotations

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

from jaxgpt.data.split import utf8_size
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
                        utf8_size(document), bad))
    return encoded


def encoded_stream(items: Iterable[tuple[str, str]], tokenizer: Tokenizer, dtype: np.dtype, *,
                   workers: int, batch_chars: int) -> Iterator[Encoded]:
    """encode_documents over `items`, document by document, in order, by workers of its own."""
    with Workers(workers) as pool:
        yield from pool.encoded(items, tokenizer, dtype, batch_chars=batch_chars)


class Workers:
    """`count` worker processes, spawned when a stream first needs them and kept until closed (a
    context manager): they count a tokenizer's sample (`counted`), then encode the corpus
    (`encoded`). Each is a pool of one process, so that a batch can be sent to a given worker."""

    def __init__(self, count: int):
        self.count = count
        self._pools: list[ProcessPoolExecutor] = []

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(finished=kind is None)
        if isinstance(error, BrokenProcessPool):
            raise DataError(UNGUARDED) from None

    def close(self, finished: bool = True) -> None:
        """End the workers: at once when not `finished` (Ctrl-C, an error, a stream left early)."""
        for pool in self._pools:
            if not finished:
                _terminate_workers(pool)
            pool.shutdown(wait=True, cancel_futures=True)
        self._pools = []

    def counted(self, tally: Tally, documents: Iterable[str], *, batch_chars: int,
                then: Callable[[], None] | None = None) -> list:
        """The results of copies of `tally` that together added every document (a Counting), as
        the documents come: one copy per worker, whose results are then cut into shares and each
        share joined by one worker (see the module docstring); in this process when the documents
        fit in one batch or there is one worker. Each worker then runs `then()` while the caller
        learns from the counts (work that does not depend on them)."""
        head, rest = _first_two(_batches(documents, batch_chars, len))
        if len(head) < 2 or self.count == 1:
            return count_here(tally, chain.from_iterable(chain(head, rest)))
        pools = self._started(_begin_counting, tally)
        pending: list[deque[Future]] = [deque() for _ in pools]
        counting = []
        for batch in chain(head, rest):
            k = _least_busy(pending)
            pending[k].append(pools[k].submit(_count_in_worker, batch))
            counting.append(pending[k][-1])
        shares = [pool.submit(_shares_in_worker, len(pools)) for pool in pools]  # after each one's batches
        for future in counting:
            future.result()  # raises a worker's error
        shares = [future.result() for future in shares]
        joined = [pool.submit(_join_in_worker, [share[k] for share in shares]) for k, pool in enumerate(pools)]
        joined = [future.result() for future in joined]
        for pool in pools if then else ():
            pool.submit(then)  # its outcome is not waited for: were it to fail, the encoding does that work
        return joined

    def encoded(self, items: Iterable[tuple[str, str]], tokenizer: Tokenizer, dtype: np.dtype, *,
                batch_chars: int) -> Iterator[Encoded]:
        """encode_documents over `items`, document by document, in order: each batch to the worker
        with the fewest in flight, at most BATCHES_PER_WORKER each; in this process when the items
        fit in one batch or there is one worker."""
        head, rest = _first_two(_batches(items, batch_chars, lambda item: len(item[1])))
        if len(head) < 2 or self.count == 1:
            for batch in chain(head, rest):
                yield from encode_documents(tokenizer, batch, dtype)
            return
        pools = self._started(_begin_encoding, tokenizer, dtype)
        pending: list[deque[Future]] = [deque() for _ in pools]
        order: deque[Future] = deque()
        for batch in chain(head, rest):
            if len(order) >= BATCHES_PER_WORKER * len(pools):
                yield from order.popleft().result()
            k = min(range(len(pools)), key=lambda k: _in_flight(pending[k]))
            pending[k].append(pools[k].submit(_encode_in_worker, batch))
            order.append(pending[k][-1])
        while order:
            yield from order.popleft().result()

    def _started(self, begin: Callable[..., None], *args: Any) -> list[ProcessPoolExecutor]:
        """The workers (spawned now if they are not yet), each given begin(*args) first."""
        os.environ[WORKER_ENV] = "1"  # inherited by each worker as it is spawned, on its pool's first submission
        try:
            if not self._pools:
                context = multiprocessing.get_context("spawn")
                self._pools = [ProcessPoolExecutor(1, mp_context=context, initializer=_start, initargs=(os.getpid(),))
                               for _ in range(self.count)]
            for pool in self._pools:
                pool.submit(begin, *args)
        finally:
            os.environ.pop(WORKER_ENV, None)
        return self._pools


def _in_flight(pending: deque[Future]) -> int:
    """The batches a worker has not finished (a pool of one process finishes them in order)."""
    while pending and pending[0].done():
        pending.popleft()
    return len(pending)


def _least_busy(pending: list[deque[Future]]) -> int:
    """The worker with the fewest batches in flight, once it has fewer than BATCHES_PER_WORKER
    (waiting for one to finish when none has)."""
    while True:
        k = min(range(len(pending)), key=lambda k: _in_flight(pending[k]))
        if len(pending[k]) < BATCHES_PER_WORKER:
            return k
        wait([future for queue in pending for future in queue], return_when=FIRST_COMPLETED)


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


_worker: dict[str, Any] = {}  # a worker's tally (while it counts) and tokenizer and dtype (while it encodes)


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


def _begin_counting(tally: Tally) -> None:
    _worker["tally"] = tally


def _count_in_worker(documents: list[str]) -> None:
    for document in documents:
        _worker["tally"].add(document)


def _shares_in_worker(parts: int) -> list:
    return _worker["tally"].result(parts)


def _join_in_worker(shares: list) -> Any:
    return _worker.pop("tally").joined(shares)


def _begin_encoding(tokenizer: Tokenizer, dtype: np.dtype) -> None:
    _worker["encoding"] = tokenizer, dtype


def _encode_in_worker(batch: Batch) -> list[Encoded]:
    tokenizer, dtype = _worker["encoding"]
    return encode_documents(tokenizer, batch, dtype)
