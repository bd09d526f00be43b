"""File locks (jaxgpt.lock): a second holder of a run directory is refused with the first one's
host and PID; a lock whose holder ended without releasing it is taken over, and the taker is
told; a waiter (a token cache's build) is told whom it waits for, and takes the lock at its
path even when the file it waited on was renamed away."""

import json
import os
import socket
import threading
import time

import pytest

from jaxgpt.lock import LOCK_FILE, FileLock, LockHeld, RunLock


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    first = RunLock(tmp_path)
    assert first.acquire() is None
    with pytest.raises(LockHeld, match=rf"in use by process {os.getpid()} on {socket.gethostname()}"):
        RunLock(tmp_path).acquire()
    first.release()
    with RunLock(tmp_path):  # released cleanly: free, and nothing to take over
        pass
    assert (tmp_path / LOCK_FILE).read_text() == ""


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_note(tmp_path):
    # what kill -9 leaves: the owner's record, and no kernel lock (the kernel drops it with the process)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "h1", "pid": 4242, "since": "2026-01-01 00:00:00"}))
    lock = RunLock(tmp_path)
    note = lock.acquire()
    assert note == "took over the lock of process 4242 on h1 (since 2026-01-01 00:00:00), which ended without " \
                   "releasing it"
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_waiter_is_told_the_holder_and_locks_the_path_anew_after_a_rename(tmp_path):
    first = FileLock(tmp_path / "build" / LOCK_FILE)
    assert first.acquire() == {}
    with pytest.raises(LockHeld, match=rf"held by process {os.getpid()}"):
        FileLock(tmp_path / "build" / LOCK_FILE).acquire()
    told = []
    second = FileLock(tmp_path / "build" / LOCK_FILE, on_wait=told.append)
    waiter = threading.Thread(target=second.acquire)
    waiter.start()
    deadline = time.monotonic() + 30
    while not told:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert told[0]["pid"] == os.getpid() and waiter.is_alive()
    (tmp_path / "build").rename(tmp_path / "published")  # what the lock guarded is published, the lock file with it
    first.release()
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert json.loads((tmp_path / "build" / LOCK_FILE).read_text())["pid"] == os.getpid()  # a new file at the path
    assert (tmp_path / "published" / LOCK_FILE).read_text() == ""
    second.release()
