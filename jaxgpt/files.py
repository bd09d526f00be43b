"""Writing files so that a reader never sees half of one: write a temporary file beside the
target, then rename it into place (atomic on POSIX file systems)."""

from __future__ import annotations

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
