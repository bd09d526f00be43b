"""Local files as sources: a path (a file, a directory, every file below it, or a glob) and
`stdlib`, the `.py` files of the running Python's standard library (no tests, no idlelib, no
site-packages, none of the files its installation wrote), sorted by path: ~11 MB of real code on
every machine that has Python. Not the same code on every machine: each Python version, and each
distribution's packaging of it, ships other files, so the corpus and every figure measured on it
are those of one Python; the cache's meta.json records which (`Source.description`).

Their files are read by jaxgpt.data.sources.reader (text, `.jsonl`, `.pdf`, images by OCR),
with the keys of data.files and data.ocr. A path also holds records (data.format='records').
"""

from __future__ import annotations

import glob
import os
import platform
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
# What an installation writes beside the standard library, not Python's source: the build's
# configuration (`_sysconfigdata_*.py`, `config-3.X-*/python-config.py`), which holds the install
# prefix, and a site's hooks. Read, they made the corpus depend on where Python was installed: the
# same CPython 3.11.7 under another home directory gave configs/experiment.py's learned-positions
# cell a val loss of 2.3586 against 2.3781.
STDLIB_INSTALLED_FILES = re.compile(r"_sysconfigdata_.*\.py|sitecustomize\.py|usercustomize\.py")
STDLIB_BUILD_DIRS = re.compile(r"config-\d.*")
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
        root = stdlib_root()
        files = stdlib_files(root)
        return files_source(spec, "stdlib", files, settings, description=stdlib_description(root, files))


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


def stdlib_root() -> Path:
    """The running Python's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The `.py` files of the standard library in `root` (default: the running Python's), sorted
    by path, without its tests, idlelib, installed packages and the files its installation wrote."""
    root = stdlib_root() if root is None else root
    files = [p for p in _walk(root, STDLIB_EXCLUDED_DIRS) if p.suffix == ".py" and not _installed(p.relative_to(root))]
    if not files:
        raise DataError(f"this Python ships no .py files of its standard library in {root}; "
                        "set data.source to a file or directory of text")
    return files


def _installed(relative: Path) -> bool:
    """Whether a file of the standard library's directory is one its installation wrote."""
    if len(relative.parts) == 1:
        return bool(STDLIB_INSTALLED_FILES.fullmatch(relative.name))
    return bool(STDLIB_BUILD_DIRS.fullmatch(relative.parts[0]))


def stdlib_description(root: Path, files: list[Path]) -> str:
    """Which standard library `files` are: its Python, directory, files and bytes."""
    size = sum(file.stat().st_size for file in files)
    return (f"the standard library of {platform.python_implementation()} {platform.python_version()} in {root}: "
            f"{len(files)} files, {size:,} bytes")


def _stamp(file: Path) -> tuple[int | None, int | None]:
    """A file's size and modification time; None, None for one that cannot be read (a broken
    symbolic link: the reader skips it or stops, as data.files.on_bad_file says)."""
    try:
        stat = file.stat()
    except OSError:
        return None, None
    return stat.st_size, stat.st_mtime_ns


def files_source(spec: str, name: str, files: list[Path], settings: DataConfig, description: str = "") -> Source:
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

    return Source(name, identity, documents, description)
