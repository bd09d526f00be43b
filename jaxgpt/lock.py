"""Exclusive locks on files, held for as long as a process works on what the file guards: a run
directory while a run trains there (`RunLock`, run_dir/.lock), and a token cache's build
directory while it is built (jaxgpt.data.cache).

The lock is the kernel's (flock on the open file): it is released when the process ends in
any way, kill -9 included, so a lock is never left behind by a dead process. The file holds
the owner's host, PID and start time, so a second process can say who holds it, and the next
owner can say whose lock it took over when the last one did not end cleanly. (The filelock
library takes the same kernel lock, but keeps no owner in the file and waits by polling.)
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

LOCK_FILE = ".lock"


class LockHeld(RuntimeError):
    """Another live process holds the lock; `holder` is its owner record ({} when unknown)."""

    def __init__(self, message: str, holder: dict):
        super().__init__(message)
        self.holder = holder


class FileLock:
    """An exclusive lock on the file `path` (made, with its directory, when missing).

    Held by another process, `acquire` raises LockHeld naming it, or with `on_wait` calls
    on_wait(its owner record) and waits for it. A lock file renamed or removed while this one
    waited (its holder published what it guarded) is let go and the lock taken at `path` again.
    """

    def __init__(self, path: str | os.PathLike, on_wait: Callable[[dict], None] | None = None):
        self.path = Path(path)
        self.on_wait = on_wait
        self._fd: int | None = None

    def acquire(self) -> dict:
        """Take the lock and record this process as its owner. Returns the owner recorded
        before: {} after a clean release, else the holder that ended without releasing it."""
        while True:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(self.path)
                if self.on_wait is None:
                    os.close(fd)
                    raise LockHeld(f"{self.path} is held by {describe(holder)}", holder) from None
                self.on_wait(holder)
                fcntl.flock(fd, fcntl.LOCK_EX)
            if _still_at(self.path, fd):
                break
            os.close(fd)
        previous = _read(self.path)
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        self._fd = fd
        return previous

    def release(self) -> None:
        """Clear the owner (a clean end leaves nothing to take over) and unlock."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class RunLock:
    """One process at a time in a run directory: the lock on run_dir/.lock."""

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / LOCK_FILE
        self._lock = FileLock(self.path)

    def acquire(self) -> str | None:
        """Take the lock or raise LockHeld naming its holder. Returns a note when the previous
        holder ended without releasing it (killed), else None."""
        try:
            previous = self._lock.acquire()
        except LockHeld as held:
            raise LockHeld(f"{self.path.parent} is in use by {describe(held.holder)}: wait for it to end or stop "
                           "it, or choose another --config.run_dir", held.holder) from None
        if previous:
            return f"took over the lock of {describe(previous)}, which ended without releasing it"
        return None

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def describe(owner: dict) -> str:
    """An owner record in words: 'process PID on HOST (since …)', or 'another process'."""
    if not owner:
        return "another process"
    return f"process {owner.get('pid', '?')} on {owner.get('host', '?')} (since {owner.get('since', '?')})"


def _read(path: Path) -> dict:
    try:
        owner = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (ValueError, OSError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _still_at(path: Path, fd: int) -> bool:
    """Whether the file open as `fd` is still the one at `path` (not renamed away or removed)."""
    try:
        at, held = os.stat(path), os.fstat(fd)
        return (at.st_dev, at.st_ino) == (held.st_dev, held.st_ino)
    except FileNotFoundError:
        return False
