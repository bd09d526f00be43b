"""Sources: where the documents of a corpus come from, read as text.

- a path: a file, a directory (every file below it, sorted; names starting with "." are
  skipped) or a glob. Files of any extension are text, read as UTF-8 (undecodable bytes
  become U+FFFD, counted in one warning; files with a NUL byte in their first 8 KiB are
  binary and skipped), one document per file; `.jsonl` holds one document per line, in the
  field `data.text_field`; `.pdf` is one document, its text layer (needs the pdf extra:
  `pip install 'jaxgpt[pdf]'`), page by page. Under `data.ocr` 'auto' (the default) an image
  (`.png .jpg .jpeg .tif .tiff .bmp .webp`) gives one document per page of the text OCR reads
  in it, and a PDF page without a text layer is read by OCR (under 'always' every PDF page is;
  under 'never' images are binary files); see jaxgpt.data.ocr. A file that cannot be read (a
  corrupt image or PDF) is skipped with a warning, or with `data.on_bad_file='error'` stops
  the preparation. Empty documents are dropped.
- `stdlib`: the `.py` files of the running Python's standard library (no tests, no idlelib,
  no site-packages), sorted by path, one document each: ~11 MB of real code on every machine
  that has Python.

A `Source` has a cheap identity (what the token cache's fingerprint hashes) and a generator
of its documents, read lazily (a `.jsonl` file a line at a time); `capped` then chooses what
is read, lazily too, and jaxgpt.data.split (text) or `split_documents` (records) what is held
out.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
import sysconfig
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from jaxgpt.config import DataConfig
from jaxgpt.data import ocr
from jaxgpt.errors import DataError, one_line

log = logging.getLogger(__name__)

STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"})
BINARY_PROBE_BYTES = 8192  # a NUL byte in this prefix marks a binary file, as git judges
FILES_AHEAD_PER_WORKER = 2  # files read ahead of the one being returned, so the OCR workers stay busy
NAMED_AT_MOST = 20  # files a warning names; the rest are counted


class DocumentReader:
    """Reads files as documents and counts what it had to repair, for one warning at the end.

    `read_files(files)` gives the documents of the files in order (see the module docstring),
    the pages that need OCR recognised in parallel a few files ahead; `read(path)` those of
    one file. `warn()` then reports, once for everything read, the undecodable byte sequences
    replaced by U+FFFD, the binary files skipped, the PDFs without a text layer (under
    ocr='never'), the files that could not be read (data.on_bad_file='warn') and those whose
    OCR confidence is below data.ocr_min_confidence. `settings` None: DataConfig's defaults.
    """

    def __init__(self, text_field: str = "text", settings: DataConfig | None = None):
        self.text_field = text_field
        self.settings = settings or DataConfig(text_field=text_field)
        self.replaced = 0
        self.files_with_replacements: list[Path | str] = []
        self.binary_files: list[Path] = []
        self.pdfs_without_text: list[Path] = []
        self.unreadable: list[tuple[Path, str]] = []
        self.low_confidence: list[tuple[Path, float]] = []

    def read(self, path: Path) -> list[str]:
        return list(self.read_files([path]))

    def read_files(self, files: Iterable[Path]) -> Iterator[str]:
        recognizer = ocr.Recognizer(self.settings)
        ahead: deque[Callable[[], Iterable[str]]] = deque()
        try:
            for file in files:
                ahead.append(self._begin(file, recognizer))
                while len(ahead) > FILES_AHEAD_PER_WORKER * recognizer.workers:
                    yield from ahead.popleft()()
            while ahead:
                yield from ahead.popleft()()
        finally:
            recognizer.close()

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
                         f"{self.pdfs_without_text[0]} (scanned pages need OCR: set data.ocr='auto')")
        if self.unreadable:
            notes.append(f"skipped {len(self.unreadable)} unreadable file(s): "
                         + _listed(f"{path} ({problem})" for path, problem in self.unreadable))
        if self.low_confidence:
            kept = ("dropped them" if self.settings.ocr_drop_low_confidence
                    else "kept them (data.ocr_drop_low_confidence=True drops them)")
            notes.append(f"{len(self.low_confidence)} file(s) have a mean OCR confidence below "
                         f"data.ocr_min_confidence={self.settings.ocr_min_confidence}: "
                         + _listed(f"{path} ({confidence:.1f})" for path, confidence in self.low_confidence)
                         + f"; {kept}")
        if notes:
            warnings.warn("reading the corpus: " + "; ".join(notes), stacklevel=3)

    def _begin(self, path: Path, recognizer: ocr.Recognizer) -> Callable[[], Iterable[str]]:
        """Start reading `path`; the function returned finishes it and gives its documents."""
        try:
            finish = self._start(path, recognizer)
        except ocr.BadFile as bad:
            skipped = self._bad_file(path, bad)
            return lambda: skipped

        def documents() -> list[str]:
            try:
                return finish()
            except ocr.BadFile as bad:
                return self._bad_file(path, bad)

        return documents

    def _start(self, path: Path, recognizer: ocr.Recognizer) -> Callable[[], Iterable[str]]:
        suffix = path.suffix.lower()
        if suffix == ".pdf":
            return self._start_pdf(path, recognizer)
        if suffix in ocr.IMAGE_SUFFIXES and self.settings.ocr != "never":
            recognised = recognizer.image(path)

            def image_documents() -> list[str]:
                pages = recognised()
                return [page.text for page in pages if page.text] if self._confident(path, pages) else []

            return image_documents
        return lambda: self._text_documents(path)  # read when its turn comes: text needs no read-ahead

    def _start_pdf(self, path: Path, recognizer: ocr.Recognizer) -> Callable[[], list[str]]:
        """A PDF as one document, page by page: its text layer, or under ocr='auto' for a page
        without one (or under 'always' for every page), the text recognised in its picture."""
        layers = _pdf_page_texts(path)
        mode = self.settings.ocr
        scanned = [i for i, layer in enumerate(layers)
                   if mode == "always" or (mode == "auto" and ocr.is_scanned(layer))]
        if not scanned:
            text = "\n".join(layers)
            if not text.strip():
                self.pdfs_without_text.append(path)
            return lambda: [text] if text.strip() else []
        recognised_pages = recognizer.pdf_pages(path, scanned)

        def documents() -> list[str]:
            recognised = dict(zip(scanned, recognised_pages(), strict=True))
            if not self._confident(path, list(recognised.values())):
                return []
            text = "\n".join(recognised[i].text if i in recognised else layer for i, layer in enumerate(layers))
            return [text] if text.strip() else []

        return documents

    def _confident(self, path: Path, pages: list[ocr.PageText]) -> bool:
        """Log a file's OCR confidence; False when it is below data.ocr_min_confidence and such
        files are dropped."""
        confidence = ocr.file_confidence(pages)
        if confidence is None:
            return True
        log.info("OCR %s: %d page(s), mean confidence %.1f", path, len(pages), confidence)
        threshold = self.settings.ocr_min_confidence
        if threshold is None or confidence >= threshold:
            return True
        self.low_confidence.append((path, confidence))
        return not self.settings.ocr_drop_low_confidence

    def _bad_file(self, path: Path, problem: ocr.BadFile) -> list[str]:
        if self.settings.on_bad_file == "error":
            raise DataError(f"cannot read {path}: {problem}; remove it from the corpus, or set "
                            "data.on_bad_file='warn' to skip it with a warning")
        self.unreadable.append((path, str(problem)))
        return []

    def _text_documents(self, path: Path) -> Iterable[str]:
        if path.suffix.lower() == ".jsonl":
            return self._jsonl_documents(path)
        raw = path.read_bytes()
        if b"\0" in raw[:BINARY_PROBE_BYTES]:
            self.binary_files.append(path)
            return []
        text = self.decode(raw, path)
        return [text] if text else []

    def decode(self, raw: bytes, origin: Path | str) -> str:
        """`raw` as UTF-8 text (a leading byte-order mark dropped), repairs counted."""
        try:
            return raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            text = raw.decode("utf-8-sig", "replace")
            # U+FFFD that the file itself holds is text, not a repair.
            self.replaced += text.count("\ufffd") - raw.count("\ufffd".encode())
            self._repaired(origin)
            return text

    def _repaired(self, origin: Path | str) -> None:
        if not self.files_with_replacements or self.files_with_replacements[-1] != origin:
            self.files_with_replacements.append(origin)

    def _jsonl_documents(self, path: Path) -> Iterator[str]:
        """The documents of a .jsonl file, read a line at a time (the file is never held whole)."""
        with open(path, "rb") as file:
            if b"\0" in file.read(BINARY_PROBE_BYTES):
                self.binary_files.append(path)
                return
            file.seek(0)
            for number, raw in enumerate(file, start=1):
                line = self.decode(raw, path)
                if line.strip():
                    document = self._jsonl_document(line, path, number)
                    if document:
                        yield document

    def _jsonl_document(self, line: str, path: Path, number: int) -> str:
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
            self._repaired(path)
        return document


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _pdf_library():
    try:
        import pypdf
    except ImportError:
        raise DataError("reading PDF files needs the pdf extra: pip install 'jaxgpt[pdf]'") \
            from None
    return pypdf


def _pdf_page_texts(path: Path) -> list[str]:
    """The text layer of each page of a PDF (pages without one give '')."""
    pypdf = _pdf_library()
    try:
        return [page.extract_text() for page in pypdf.PdfReader(path).pages]
    except pypdf.errors.PyPdfError as err:
        raise ocr.BadFile(f"not a readable PDF ({one_line(err)})") from None


def _listed(items: Iterable[str]) -> str:
    items = list(items)
    more = f" and {len(items) - NAMED_AT_MOST} more" if len(items) > NAMED_AT_MOST else ""
    return ", ".join(items[:NAMED_AT_MOST]) + more


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
    if suffixes & (ocr.IMAGE_SUFFIXES | {".pdf"}):
        identity["on_bad_file"] = settings.on_bad_file  # 'warn' may have skipped a file that 'error' refuses
    identity.update(ocr.identity(settings, suffixes))  # images and scanned pages: the engine, language, …

    def documents(reader: DocumentReader) -> Iterator[str]:
        yield from reader.read_files(files)

    return Source(name, identity, documents)


def capped(documents: Iterable[str], max_documents: int | None, max_bytes: int | None
           ) -> Iterator[str]:
    """The documents in order, lazily, at most `max_documents` of them and `max_bytes` UTF-8
    bytes (the document that crosses the cap is cut on a character); empty ones dropped."""
    budget = max_bytes
    for count, document in enumerate(documents):
        if max_documents is not None and count == max_documents:
            return
        if budget is not None:
            encoded = document.encode("utf-8")
            if len(encoded) >= budget:
                last = encoded[:budget].decode("utf-8", "ignore")
                if last:
                    yield last
                return
            budget -= len(encoded)
        if document:
            yield document


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


