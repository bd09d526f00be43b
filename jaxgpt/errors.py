"""The errors a user can act on, and the one way their messages are made one line long.

Every error that reaches a command line is a single line that says what is wrong and what to
do; `one_line` turns a library's error (often many lines, sometimes a repr) into that form.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import re
import sys
import tempfile
import threading
import traceback
import warnings
from typing import Any

import numpy as np

# reprs of library internals that mean nothing to a user: <bound method pybind11…>, <… object at 0x…>
_LIBRARY_REPR = re.compile(r"<(?:bound method |built-in method |function )[^<>]*>|<[^<>]* object at 0x[0-9a-f]+>")


class ConfigError(ValueError):
    """A setting that cannot work; the message names the key and what it must be."""


class DataError(ValueError):
    """A data source, setting or cache that cannot be used; the message says what to do."""


def one_line(error: BaseException, limit: int = 400, with_type: bool = False) -> str:
    """The first non-empty line of an error's message (at most `limit` characters), or its
    type's name when it has no message; `with_type` puts the type's name in front (for
    errors from inside a library, whose type says more than their text). A longer line loses
    its middle, not its end, where a message says what to do: `head … end`, its last third kept."""
    lines = [_without_reprs(line.strip()) for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    line = lines[0]
    if len(line) > limit:
        end = limit // 3
        line = f"{line[:limit - end - 1]}…{line[len(line) - end:]}" if end else line[:limit]
    return f"{type(error).__name__}: {line}" if with_type else line


class TrainingError(RuntimeError):
    """A run that cannot go on (non-finite loss, incompatible resume, bad settings)."""


def _without_reprs(line: str) -> str:
    """The line with library reprs (nested ones too) shortened to …."""
    while (shorter := _LIBRARY_REPR.sub("…", line)) != line:
        line = shorter
    return line


def exit_without_a_last_collection() -> None:
    """For command-line programs: at exit (atexit, before the interpreter finalises), every object
    is left out of the garbage collector's passes (gc.freeze). The interpreter's last collection
    walks the whole heap, JAX's and Flax's hundreds of thousands of objects, for nothing a
    command needs: 0.3 s of each run on a 2-core CPU. Destructors and atexit handlers still run."""
    atexit.register(gc.freeze)


def tidy_cli_output() -> None:
    """For command-line programs: one line per warning, and no library noise burying the
    one-line error. Warnings print as "warning: message" (no source line). orbax's write
    threads print their exception's traceback (orbax then raises it in the caller, where jaxgpt
    reports it in one line), and its abandoned reads after a damaged checkpoint leave "Event
    loop is closed" reports with nothing to act on: both are dropped. Any other exception in a
    thread, or that Python cannot raise, is reported as before; so are asyncio's logs but for
    orbax's write tasks, which fail together with the save jaxgpt reports."""
    warnings.formatwarning = _warning_line
    if getattr(sys.unraisablehook, "tidies_cli_output", False):
        return  # installed already
    previous_unraisable, previous_thread = sys.unraisablehook, threading.excepthook

    def unraisable_hook(unraisable) -> None:
        value = unraisable.exc_value
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            previous_unraisable(unraisable)

    def thread_hook(args) -> None:
        if not any("/orbax/" in frame.filename for frame in traceback.extract_tb(args.exc_traceback)):
            previous_thread(args)

    unraisable_hook.tidies_cli_output = True
    sys.unraisablehook, threading.excepthook = unraisable_hook, thread_hook
    # orbax's failed write tasks, each logged by asyncio as "Task exception was never retrieved",
    # and the futures gathering them ("_GatheringFuture exception …", orbax in the traceback only)
    logging.getLogger("asyncio").addFilter(lambda record: not _from_orbax(record))


def _from_orbax(record: logging.LogRecord) -> bool:
    """The log record is orbax's: its message or its exception's traceback passes through orbax."""
    error = record.exc_info[1] if record.exc_info else None
    frames = traceback.extract_tb(error.__traceback__) if error is not None else []
    return "/orbax/" in record.getMessage() or any("/orbax/" in frame.filename for frame in frames)


class stderr_kept(contextlib.AbstractContextManager):
    """What this process (its C++ libraries too) writes to standard error inside the block,
    kept in a file instead of printed: text() reads it as one line, lines() line by line. Not
    enabled: printed as usual. python=False: what Python code writes to sys.stderr (jaxgpt's
    own lines, warnings) is printed as usual, and only what the libraries below it write is kept."""

    def __init__(self, enabled: bool = True, python: bool = True):
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2) if enabled else None
        self._python = python
        self._stderr = None  # sys.stderr while Python's writes go to the terminal

    def __enter__(self):
        if self._saved is not None:
            sys.stderr.flush()
            if not self._python:
                self._stderr = sys.stderr
                sys.stderr = open(os.dup(self._saved), "w", buffering=1, encoding=self._stderr.encoding,  # noqa: SIM115
                                  errors="backslashreplace")
            os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            sys.stderr.flush()
            if self._stderr is not None:
                sys.stderr.close()
                sys.stderr, self._stderr = self._stderr, None
            os.dup2(self._saved, 2)
            os.close(self._saved)
        return False

    def text(self) -> str:
        return " ".join(" ".join(self.lines()).split())

    def lines(self) -> list[str]:
        self._file.seek(0)
        return [line for line in self._file.read().decode(errors="replace").splitlines() if line.strip()]


def _warning_line(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def is_int(value: Any) -> bool:
    """A Python or NumPy integer, not a bool (for the configs' checks)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A Python or NumPy integer or float, not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
