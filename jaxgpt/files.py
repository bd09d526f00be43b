"""Writing files so that a reader never sees half of one: write a temporary file beside the
target, then rename it into place (atomic on POSIX file systems)."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_atomically(path: str | os.PathLike, content: str | bytes | Callable[[str], None]) -> None:
    """Replace `path` with `content` (text as UTF-8, bytes as they are, or a function that
    writes the temporary file whose name it is given); on any failure `path` is unchanged."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            if isinstance(content, str):
                file.write(content.encode("utf-8"))
            elif isinstance(content, bytes):
                file.write(content)
        if callable(content):
            content(temporary)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, value: Any, **dump_options: Any) -> None:
    """`value` as JSON (sorted keys, indented, a final newline), written atomically."""
    options = {"indent": 2, "sort_keys": True, **dump_options}
    write_atomically(path, json.dumps(value, **options) + "\n")


def writable_directory(path: str | os.PathLike, instead: str) -> Path:
    """`path` as a directory that takes new files, made if need be; a ValueError in one line
    naming it and saying what to do (`instead`, e.g. "pass --out DIR") when it cannot be."""
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "a file, not a directory")
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as error:
        raise unwritable(path, error, instead) from None
    return path


def unwritable(path: str | os.PathLike, error: OSError, instead: str) -> ValueError:
    """The one-line error for files that could not be written in or as `path`."""
    reason = error.strerror or type(error).__name__
    return ValueError(f"cannot write in {path} ({reason}): {instead}")
