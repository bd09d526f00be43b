"""Sources: where the documents of a corpus come from, read as text.

- a path: a file, a directory (every file below it, sorted; names starting with "." are
  skipped) or a glob. Files of any extension are text, read as UTF-8 (undecodable bytes
  become U+FFFD, counted in one warning; files with a NUL byte in their first 8 KiB are
  binary and skipped), one document per file; `.jsonl` holds one document per line, in the
  field `data.text_field`; `.pdf` is one document, its text layer (needs the pdf extra:
  `pip install 'jaxgpt[pdf]'`). Empty documents are dropped.
- `stdlib`: the `.py` files of the running Python's standard library (no tests, no idlelib,
  no site-packages), sorted by path, one document each: ~11 MB of real code on every machine
  that has Python.

A `Source` has a cheap identity (what the token cache's fingerprint hashes) and a generator
of its documents; `capped` and `split_documents` then choose what is read and held out.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import sysconfig
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from jaxgpt.config import DataConfig
from jaxgpt.errors import DataError

STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"})
BINARY_PROBE_BYTES = 8192  # a NUL byte in this prefix marks a binary file, as git judges


class DocumentReader:
    """Reads files as documents and counts what it had to repair, for one warning at the end.

    `read(path)` gives a file's documents (see the module docstring); `warn()` then
    reports, once for everything read, the undecodable byte sequences replaced by U+FFFD,
    the binary files skipped and the PDFs without a text layer.
    """

    def __init__(self, text_field: str = "text"):
        self.text_field = text_field
        self.replaced = 0
        self.files_with_replacements: list[Path | str] = []
        self.binary_files: list[Path] = []
        self.pdfs_without_text: list[Path] = []

    def read(self, path: Path) -> list[str]:
        if path.suffix.lower() == ".pdf":
            text = _pdf_text(path)
            if not text.strip():
                self.pdfs_without_text.append(path)
                return []
            return [text]
        raw = path.read_bytes()
        if b"\0" in raw[:BINARY_PROBE_BYTES]:
            self.binary_files.append(path)
            return []
        text = self.decode(raw, path)
        if path.suffix.lower() == ".jsonl":
            return self._jsonl_documents(text, path)
        return [text] if text else []

    def warn(self) -> None:
        notes = []
        if self.replaced:
            notes.append(f"replaced {self.replaced} undecodable byte sequence(s) with U+FFFD in "
                         f"{len(self.files_with_replacements)} file(s), e.g. "
                         f"{self.files_with_replacements[0]}")
        if self.binary_files:
            notes.append(f"skipped {len(self.binary_files)} binary file(s), e.g. "
                         f"{self.binary_files[0]}")
        if self.pdfs_without_text:
            notes.append(f"found no text layer in {len(self.pdfs_without_text)} PDF(s), e.g. "
                         f"{self.pdfs_without_text[0]} (scanned pages need OCR first)")
        if notes:
            warnings.warn("reading the corpus: " + "; ".join(notes), stacklevel=3)

    def decode(self, raw: bytes, origin: Path | str) -> str:
        """`raw` as UTF-8 text (a leading byte-order mark dropped), repairs counted."""
        try:
            return raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            text = raw.decode("utf-8-sig", "replace")
            # U+FFFD that the file itself holds is text, not a repair.
            self.replaced += text.count("\ufffd") - raw.count("\ufffd".encode())
            self.files_with_replacements.append(origin)
            return text

    def _jsonl_documents(self, text: str, path: Path) -> list[str]:
        documents = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number} is not valid JSON ({err.msg}); a .jsonl file "
                                "holds one JSON object per line") from None
            if not isinstance(record, dict) or self.text_field not in record:
                fields = ", ".join(map(repr, record)) if isinstance(record, dict) else "none"
                raise DataError(f"{path}:{number} has no field {self.text_field!r} (its fields: "
                                f"{fields}); set data.text_field to the field with the text")
            document = record[self.text_field]
            if not isinstance(document, str):
                raise DataError(f"{path}:{number}: field {self.text_field!r} holds "
                                f"{type(document).__name__}, not text; set data.text_field to "
                                "the field with the text")
            if _LONE_SURROGATE.search(document):  # JSON can escape them; UTF-8 cannot hold them
                document, count = _LONE_SURROGATE.subn("\ufffd", document)
                self.replaced += count
                self.files_with_replacements.append(path)
            if document:
                documents.append(document)
        return documents


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _pdf_library():
    try:
        import pypdf
    except ImportError:
        raise DataError("reading PDF files needs the pdf extra: pip install 'jaxgpt[pdf]'") \
            from None
    return pypdf


def _pdf_text(path: Path) -> str:
    pypdf = _pdf_library()
    try:
        return "\n".join(page.extract_text() for page in pypdf.PdfReader(path).pages)
    except pypdf.errors.PyPdfError as err:
        raise DataError(f"{path} is not a readable PDF ({err}); remove it from the corpus") \
            from None


_GLOB_MAGIC = re.compile(r"[*?[]")


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
        raise FileNotFoundError(f"data source {str(spec)!r} does not exist; give a file, "
                                "directory or glob, 'stdlib', or 'tfds:NAME[:SPLIT]'")
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


@dataclasses.dataclass(frozen=True)
class Source:
    """Where documents come from: `identity` is cheap to compute and changes whenever the
    documents may have changed; `documents(reader)` reads them."""

    name: str
    identity: dict[str, Any]
    documents: Callable[[DocumentReader], Iterator[str]]


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in _walk(root, STDLIB_EXCLUDED_DIRS) if p.suffix == ".py"]
    if not files:
        raise DataError(f"this Python ships no .py files of its standard library in {root}; "
                        "set data.source to a file or directory of text")
    return files


def files_source(name: str, files: list[Path], settings: DataConfig) -> Source:
    if not files:
        raise DataError(f"data source {settings.source!r} holds no files")
    identity: dict[str, Any] = {
        "kind": "files",
        "files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
    }
    suffixes = {f.suffix.lower() for f in files}
    if ".jsonl" in suffixes:
        identity["text_field"] = settings.text_field
    if ".pdf" in suffixes:
        identity["pypdf"] = _pdf_library().__version__  # text extraction differs by version

    def documents(reader: DocumentReader) -> Iterator[str]:
        for file in files:
            yield from reader.read(file)

    return Source(name, identity, documents)


def capped(documents: Iterator[str], max_documents: int | None, max_bytes: int | None
            ) -> list[str]:
    """The documents in order, at most `max_documents` of them and `max_bytes` UTF-8 bytes."""
    kept: list[str] = []
    budget = max_bytes
    for document in documents:
        if max_documents is not None and len(kept) == max_documents:
            break
        if budget is not None:
            encoded = document.encode("utf-8")
            if len(encoded) >= budget:
                kept.append(encoded[:budget].decode("utf-8", "ignore"))  # cut on a character
                break
            budget -= len(encoded)
        kept.append(document)
    return [document for document in kept if document]


def split_documents(documents: Sequence[str], val_fraction: float
                    ) -> tuple[list[str], list[str]]:
    """(train, validation) documents.

    Several documents: round(n · val_fraction) of them (at least one when the fraction is
    positive, never all) are held out, spread evenly: document ⌊(2k+1)·n / 2m⌋ for
    k = 0..m−1. One document: the validation split is its last val_fraction of characters.
    """
    n = len(documents)
    if n == 1:
        text = documents[0]
        cut = len(text) - round(len(text) * val_fraction)
        return [text[:cut]], [text[cut:]] if cut < len(text) else []
    if val_fraction == 0:
        return list(documents), []
    held_out = min(max(1, round(n * val_fraction)), n - 1)
    val_indices = {(2 * k + 1) * n // (2 * held_out) for k in range(held_out)}
    train = [d for i, d in enumerate(documents) if i not in val_indices]
    val = [d for i, d in enumerate(documents) if i in val_indices]
    return train, val


