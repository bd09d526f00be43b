"""Local files as sources: a path (a file, a directory, every file below it, or a glob) and
`stdlib`, the `.py` files of the running Python's standard library (no tests, no idlelib, no
site-packages), sorted by path: ~11 MB of real code on every machine that has Python.

Their files are read by jaxgpt.data.sources.reader (text, `.jsonl`, `.pdf`, images by OCR),
with the keys of data.files and data.ocr. A path also holds records (data.format='records').
"""

from __future__ import annotations

import glob
import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxgpt.data import ocr
from jaxgpt.data.sources.reader import DocumentReader, pdf_library
from jaxgpt.data.sources.registry import PATHS, Source, SourceKind, known_forms, register
from jaxgpt.data_config import DataConfig
from jaxgpt.errors import DataError

STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"})
_GLOB_MAGIC = re.compile(r"[*?[]")


@register
class Paths(SourceKind):
    """A file, a directory or a glob: its files, read as documents or as records."""

    scheme = PATHS
    form = "a file, directory or glob"
    section = "files"

    def open(self, spec: str, settings: DataConfig) -> Source:
        return files_source(spec, Path(spec).name or spec, list_files(spec), settings)

    def record_files(self, spec: str, settings: DataConfig) -> list[Path]:
        return list_files(spec)


@register
class Stdlib(SourceKind):
    """'stdlib': the standard library's .py files, one document each."""

    scheme = "stdlib"
    bare = True
    form = "stdlib"

    def open(self, spec: str, settings: DataConfig) -> Source:
        return files_source(spec, "stdlib", stdlib_files(), settings)


def list_files(spec: str | os.PathLike) -> list[Path]:
    """The files a path source names: the file itself, every file below a directory (sorted
    by path; names starting with "." skipped), or those of every glob match (`**` recurses).
    """
    path = Path(spec).expanduser()
    if path.exists():
        matches = [path]
    elif _GLOB_MAGIC.search(str(path)):
        matches = sorted(map(Path, glob.glob(str(path), recursive=True)))
        if not matches:
            raise FileNotFoundError(f"no file matches the data source {str(spec)!r}")
    else:
        raise FileNotFoundError(f"data source {str(spec)!r} does not exist; give {known_forms()}")
    files = [file for match in matches for file in _walk(match)]
    return list(dict.fromkeys(files))  # a file under two matching directories counts once


def _walk(root: Path, excluded_dirs: frozenset[str] = frozenset()) -> list[Path]:
    if not root.is_dir():
        return [root]
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if not d.startswith(".") and d not in excluded_dirs]
        files += [Path(directory, name) for name in names if not name.startswith(".")]
    return sorted(files)


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in _walk(root, STDLIB_EXCLUDED_DIRS) if p.suffix == ".py"]
    if not files:
        raise DataError(f"this Python ships no .py files of its standard library in {root}; "
                        "set data.source to a file or directory of text")
    return files


def _stamp(file: Path) -> tuple[int | None, int | None]:
    """A file's size and modification time; None, None for one that cannot be read (a broken
    symbolic link: the reader skips it or stops, as data.files.on_bad_file says)."""
    try:
        stat = file.stat()
    except OSError:
        return None, None
    return stat.st_size, stat.st_mtime_ns


def files_source(spec: str, name: str, files: list[Path], settings: DataConfig) -> Source:
    """The Source of local files: its identity is each file's path, size and modification
    time, and the settings that change what is read from files with their suffixes."""
    if not files:
        raise DataError(f"data source {spec!r} holds no files")
    identity: dict[str, Any] = {"kind": "files", "files": [[str(f.resolve()), *_stamp(f)] for f in files]}
    suffixes = {f.suffix.lower() for f in files}
    if ".jsonl" in suffixes:
        identity["text_field"] = settings.files.text_field
    if ".pdf" in suffixes:
        identity["pypdf"] = pdf_library().__version__  # text extraction differs by version
    if suffixes & (ocr.IMAGE_SUFFIXES | {".pdf"}) or any(stamp[1] is None for stamp in identity["files"]):
        identity["on_bad_file"] = settings.files.on_bad_file  # 'warn' may have skipped a file that 'error' refuses
    identity.update(ocr.identity(settings.ocr, suffixes))  # images and scanned pages: the engine, language, …

    def documents(reader: DocumentReader) -> Iterator[str]:
        yield from reader.read_files(files)

    return Source(name, identity, documents)
