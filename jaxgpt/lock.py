"""One process at a time in a run directory: an exclusive lock on run_dir/.lock for as long as
a process trains there.

The lock is the kernel's (flock on the open file): it is released when the process ends in
any way, kill -9 included, so a lock is never left behind by a dead process. The file holds
the owner's host, PID and start time, so a second process can say who holds it, and the next
owner can say whose lock it took over when the last one did not end cleanly.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"


class LockHeld(RuntimeError):
    """Another live process holds the lock."""


class RunLock:
    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock or raise LockHeld naming its holder. Returns a note when the previous
        holder ended without releasing it (killed), else None."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockHeld(f"{self.path.parent} is in use by {_describe(_read(self.path))}: wait for it to end or "
                           "stop it, or choose another --config.run_dir") from None
        previous = _read(self.path)
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        self._fd = fd
        if previous:
            return f"took over the lock of {_describe(previous)}, which ended without releasing it"
        return None

    def release(self) -> None:
        """Clear the owner (a clean end leaves nothing to take over) and unlock."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read(path: Path) -> dict:
    try:
        owner = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (ValueError, OSError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _describe(owner: dict) -> str:
    if not owner:
        return "another process"
    return f"process {owner.get('pid', '?')} on {owner.get('host', '?')} (since {owner.get('since', '?')})"
