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
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import chain

import numpy as np

from jaxgpt.errors import DataError
from jaxgpt.tokenizers import Tokenizer

BATCHES_PER_WORKER = 2  # in flight: one being encoded, one waiting, per worker
PARENT_POLL_SECONDS = 1.0  # where the kernel cannot kill a worker with its parent, it looks this often
PR_SET_PDEATHSIG = 1  # prctl option: the signal a process gets when its parent ends (linux/prctl.h)
WORKER_ENV = "JAXGPT_ENCODING_WORKER"  # set in the workers' environment: a worker never prepares data
UNGUARDED = ("an encoding worker stopped before it began: a script that calls jaxgpt.data.prepare must do so under "
             "`if __name__ == '__main__':` (each worker imports the script again), or set data.workers=1")

Batch = list[tuple[str, str]]  # (split, document)
Encoded = tuple[str, np.ndarray, int, int | None]  # (split, ids, UTF-8 bytes, an id outside the vocabulary)


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
    batches = _batches(items, batch_chars)
    first = next(batches, None)
    second = next(batches, None) if first is not None else None
    if second is None or workers == 1:
        for batch in chain([first] if first else [], [second] if second else [], batches):
            yield from encode_documents(tokenizer, batch, dtype)
        return
    os.environ[WORKER_ENV] = "1"  # inherited by the workers as they start (on the first submissions)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(tokenizer, dtype, os.getpid()))
    finished = False
    try:
        pending: deque[Future] = deque()
        for batch in chain([first, second], batches):
            pending.append(pool.submit(_encode_in_worker, batch))
            if len(pending) >= BATCHES_PER_WORKER * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
        finished = True
    except BrokenProcessPool:
        raise DataError(UNGUARDED) from None
    finally:
        os.environ.pop(WORKER_ENV, None)
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


def _batches(items: Iterable[tuple[str, str]], batch_chars: int) -> Iterator[Batch]:
    batch: Batch = []
    size = 0
    for item in items:
        batch.append(item)
        size += len(item[1])
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


_worker_tokenizer: tuple[Tokenizer, np.dtype] | None = None


def _start_worker(tokenizer: Tokenizer, dtype: np.dtype, parent: int) -> None:
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the pool
    die_with_parent(parent)
    _worker_tokenizer = tokenizer, dtype


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
