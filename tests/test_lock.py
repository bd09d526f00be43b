"""The run-directory lock: a second holder is refused with the first one's host and PID; a lock
whose holder ended without releasing it is taken over, and the taker is told."""

import json
import os
import socket

import pytest

from jaxgpt.lock import LOCK_FILE, LockHeld, RunLock


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
