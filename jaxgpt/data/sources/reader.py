"""Files read as documents: the reading every local-file source shares.

Files of any extension are text, read as UTF-8 (undecodable bytes become U+FFFD, counted in one
warning; files with a NUL byte in their first 8 KiB are binary and skipped), one document per
file; `.jsonl` holds one document per line, in the field `data.files.text_field`; `.pdf` is one
document, its text layer (needs the pdf extra: `pip install 'jaxgpt[pdf]'`), page by page.
Under `data.ocr.mode` 'auto' (the default) an image (`.png .jpg .jpeg .tif .tiff .bmp .webp`)
gives one document per page of the text OCR reads in it, and a PDF page without a text layer
is read by OCR (under 'always' every PDF page is; under 'never' images are binary files); see
jaxgpt.data.ocr. A file that cannot be read (a corrupt image or PDF, a broken symbolic link, a
file this user may not read) is skipped with a warning, or with `data.files.on_bad_file='error'`
stops the preparation. Empty documents are dropped.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from jaxgpt.data import ocr
from jaxgpt.data_config import DataConfig
from jaxgpt.errors import DataError, one_line

log = logging.getLogger(__name__)

BINARY_PROBE_BYTES = 8192  # a NUL byte in this prefix marks a binary file, as git judges
FILES_AHEAD_PER_WORKER = 2  # files read ahead of the one being returned, so the OCR workers stay busy
NAMED_AT_MOST = 20  # files a warning names; the rest are counted


class DocumentReader:
    """Reads files as documents and counts what it had to repair, for one warning at the end.

    `read_files(files)` gives the documents of the files in order (see the module docstring),
    the pages that need OCR recognised in parallel a few files ahead; `read(path)` those of
    one file. `warn()` then reports, once for everything read, the undecodable byte sequences
    replaced by U+FFFD, the binary files skipped, the PDFs without a text layer (under
    ocr.mode='never'), the files that could not be read (data.files.on_bad_file='warn') and those
    whose OCR confidence is below data.ocr.min_confidence. `settings` None: DataConfig's defaults.
    """

    def __init__(self, settings: DataConfig | None = None):
        self.settings = settings or DataConfig()
        self.text_field = self.settings.files.text_field
        self.replaced = 0
        self.files_with_replacements: list[Path | str] = []
        self.binary_files: list[Path] = []
        self.pdfs_without_text: list[Path] = []
        self.unreadable: list[tuple[Path, str]] = []
        self.low_confidence: list[tuple[Path, float]] = []
        self.large_images: dict[Path, int] = {}

    def read(self, path: Path) -> list[str]:
        return list(self.read_files([path]))

    def read_files(self, files: Iterable[Path]) -> Iterator[str]:
        recognizer = ocr.Recognizer(self.settings.ocr, self.settings.cache_path / "ocr")
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
            self.large_images.update(recognizer.large_images)

    def findings(self) -> list[tuple[bool, str]]:
        """What reading found, one note per kind, each with whether it left a file's text out:
        the one list that both the warning and the empty corpus's error read."""
        found = []
        if self.replaced:
            files = self.files_with_replacements
            found.append((False, f"replaced {self.replaced} undecodable byte sequence(s) with U+FFFD in "
                                 f"{len(files)} file(s), e.g. {files[0]}"))
        if self.binary_files:
            found.append((True, f"skipped {len(self.binary_files)} binary file(s): "
                                f"{_listed(map(str, self.binary_files))}{self._images_hint()}"))
        if self.pdfs_without_text:
            found.append((True, f"skipped {len(self.pdfs_without_text)} PDF(s) without a text layer: "
                                f"{_listed(map(str, self.pdfs_without_text))} (scanned pages need OCR: "
                                "data.ocr.mode='auto')"))
        if self.unreadable:
            found.append((True, f"skipped {len(self.unreadable)} unreadable file(s): "
                                + _listed(f"{path} ({problem})" for path, problem in self.unreadable)))
        if self.large_images:
            found.append((False, f"read {len(self.large_images)} image(s) larger than Pillow's decompression-bomb "
                                 f"limit of {ocr.pixel_limit():,} pixels: "
                                 + _listed(f"{path} ({n:,} pixels)" for path, n in self.large_images.items())))
        if self.low_confidence:
            dropped = self.settings.ocr.drop_low_confidence
            kept = "dropped them" if dropped else "kept them (data.ocr.drop_low_confidence=True drops them)"
            found.append((dropped, f"{len(self.low_confidence)} file(s) have a mean OCR confidence below "
                                   f"data.ocr.min_confidence={self.settings.ocr.min_confidence}: "
                                   + _listed(f"{path} ({confidence:.1f})" for path, confidence in self.low_confidence)
                                   + f"; {kept}"))
        return found

    def warn(self) -> None:
        notes = [note for _, note in self.findings()]
        if notes:
            warnings.warn("reading the corpus: " + "; ".join(notes), stacklevel=3)

    def skipped(self) -> str:
        """The files whose text was left out, and why, in words ('' when none was)."""
        return "; ".join(note for left_out, note in self.findings() if left_out)

    def _images_hint(self) -> str:
        if any(path.suffix.lower() in ocr.IMAGE_SUFFIXES for path in self.binary_files):
            return " (images are read by OCR under data.ocr.mode='auto' or 'always', not 'never')"
        return ""

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
        if suffix in ocr.IMAGE_SUFFIXES and self.settings.ocr.mode != "never":
            recognised = recognizer.image(path)

            def image_documents() -> list[str]:
                pages = recognised()
                return [page.text for page in pages if page.text] if self._confident(path, pages) else []

            return image_documents
        return lambda: self._text_documents(path)  # read when its turn comes: text needs no read-ahead

    def _start_pdf(self, path: Path, recognizer: ocr.Recognizer) -> Callable[[], list[str]]:
        """A PDF as one document, page by page: its text layer, or under ocr.mode='auto' for a page
        without one (or under 'always' for every page), the text recognised in its picture."""
        layers = _pdf_page_texts(path)
        mode = self.settings.ocr.mode
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
        """Log a file's OCR confidence; False when it is below data.ocr.min_confidence and such
        files are dropped."""
        confidence = ocr.file_confidence(pages)
        if confidence is None:
            return True
        log.info("OCR %s: %d page(s), mean confidence %.1f", path, len(pages), confidence)
        threshold = self.settings.ocr.min_confidence
        if threshold is None or confidence >= threshold:
            return True
        self.low_confidence.append((path, confidence))
        return not self.settings.ocr.drop_low_confidence

    def _bad_file(self, path: Path, problem: ocr.BadFile) -> list[str]:
        if self.settings.files.on_bad_file == "error":
            raise DataError(f"cannot read {path}: {problem}; remove it from the corpus, or set "
                            "data.files.on_bad_file='warn' to skip it with a warning")
        self.unreadable.append((path, str(problem)))
        return []

    def _text_documents(self, path: Path) -> Iterable[str]:
        try:
            if path.suffix.lower() == ".jsonl":
                return self._jsonl_documents(path, open(path, "rb"))  # the generator closes it
            raw = path.read_bytes()
        except OSError as error:
            raise ocr.BadFile(_unreadable(path, error)) from None
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

    def _jsonl_documents(self, path: Path, file: BinaryIO) -> Iterator[str]:
        """The documents of a .jsonl file open as `file`, read a line at a time (the file is never
        held whole)."""
        with file:
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
                            f"{fields}); set data.files.text_field to the field with the text")
        document = record[self.text_field]
        if not isinstance(document, str):
            raise DataError(f"{path}:{number}: field {self.text_field!r} holds "
                            f"{type(document).__name__}, not text; set data.files.text_field to "
                            "the field with the text")
        if _LONE_SURROGATE.search(document):  # JSON can escape them; UTF-8 cannot hold them
            document, count = _LONE_SURROGATE.subn("\ufffd", document)
            self.replaced += count
            self._repaired(path)
        return document


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _unreadable(path: Path, error: OSError) -> str:
    """Why a file cannot be read, in words."""
    if path.is_symlink() and not path.exists():
        return f"a broken symbolic link to {os.readlink(path)}"
    return error.strerror or type(error).__name__


def pdf_library():
    try:
        import pypdf
    except ImportError:
        raise DataError("reading PDF files needs the pdf extra: pip install 'jaxgpt[pdf]'") \
            from None
    return pypdf


def _pdf_page_texts(path: Path) -> list[str]:
    """The text layer of each page of a PDF (pages without one give '')."""
    pypdf = pdf_library()
    try:
        return [page.extract_text() for page in pypdf.PdfReader(path).pages]
    except pypdf.errors.PyPdfError as err:
        raise ocr.BadFile(f"not a readable PDF ({one_line(err)})") from None


def _listed(items: Iterable[str]) -> str:
    items = list(items)
    more = f" and {len(items) - NAMED_AT_MOST} more" if len(items) > NAMED_AT_MOST else ""
    return ", ".join(items[:NAMED_AT_MOST]) + more
