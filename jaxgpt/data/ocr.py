"""OCR: the text of images and of scanned PDF pages, recognised by Tesseract, cached per file.

The engine is Tesseract 5 (the `tesseract` program: `apt-get install tesseract-ocr`, further
languages as `tesseract-ocr-LANG`), run once per page with OMP_THREAD_LIMIT=1. The pages are
recognised in parallel by `data.ocr.workers` such processes at once (threads of this process
only hand them pages and wait), which beats Tesseract's own OpenMP threads several times on a
busy machine. Images are read by Pillow, PDF pages rendered by PDFium (pypdfium2) at 300 dpi;
both are in the ocr extra (`pip install 'jaxgpt[ocr]'`). Tesseract gives each word a confidence
in [0, 100]; a page's is the mean over its words, a file's the mean over all its words.

An image larger than Pillow's decompression-bomb limit (`PIL.Image.MAX_IMAGE_PIXELS`, up to
twice that) is read, as Pillow allows, and named once in the reader's warning (Pillow's own
warning, which names no file and comes again for each opening, is silenced while OCR reads).

The recognised pages of a file are kept in `<data cache>/ocr/<key>.json`, the key hashing the
file's contents, the engine's version, the language and the rendering resolution: a second
prepare of the same files runs no OCR, and another Tesseract or language recognises anew.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import io
import json
import logging
import os
import shutil
import subprocess
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from jaxgpt.data_config import OcrConfig
from jaxgpt.errors import DataError, one_line
from jaxgpt.files import write_json

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".webp"})
PDF_DPI = 300  # the resolution Tesseract is trained for
SCANNED_BELOW = 5  # a PDF page whose text layer has fewer letters and digits is recognised (auto)
CACHE_VERSION = 1
INSTALL_HINT = ("install Tesseract and the ocr extra: apt-get install tesseract-ocr (Debian, Ubuntu; "
                "'brew install tesseract' on macOS) and pip install 'jaxgpt[ocr]'; or set data.ocr.mode='never'")
_PDFIUM = threading.Lock()  # PDFium is not thread-safe: one call into it at a time


class BadFile(Exception):
    """A file that cannot be read as an image or PDF page; the message says why."""


@dataclasses.dataclass(frozen=True)
class PageText:
    """The recognised text of a page, its words' mean confidence (None: no words) and count."""

    text: str
    confidence: float | None
    words: int


def file_confidence(pages: Sequence[PageText]) -> float | None:
    """The mean confidence of every word of `pages` (None when they hold no word)."""
    words = sum(page.words for page in pages)
    if not words:
        return None
    return sum(page.confidence * page.words for page in pages if page.words) / words


def is_scanned(text_layer: str) -> bool:
    """Whether a PDF page's text layer is empty or nearly so (a page number, a stray mark)."""
    return sum(character.isalnum() for character in text_layer) < SCANNED_BELOW


# --- the engine ------------------------------------------------------------------------------


def engine_version() -> str:
    """The engine and its version, e.g. 'tesseract 5.3.0'; a DataError saying what to install
    when Tesseract or the ocr extra is missing."""
    binary = shutil.which("tesseract")
    if binary is None:
        raise DataError(f"OCR needs Tesseract, and no 'tesseract' program is on PATH: {INSTALL_HINT}")
    _pillow()
    return _version_of(binary)


@functools.cache
def _version_of(binary: str) -> str:
    result = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    first_line = (result.stdout or result.stderr).strip().split("\n")[0]
    if result.returncode or not first_line.startswith("tesseract "):
        raise DataError(f"{binary} --version failed ({first_line or result.returncode}); {INSTALL_HINT}")
    return first_line.strip()


def check_language(lang: str) -> None:
    """A DataError naming the package to install when Tesseract lacks a language of `lang`."""
    installed = _languages(shutil.which("tesseract"))
    missing = [name for name in lang.split("+") if name not in installed]
    if missing:
        packages = " ".join(f"tesseract-ocr-{name.lower().replace('_', '-')}" for name in missing)
        raise DataError(f"data.ocr.lang={lang!r}: Tesseract has no {', '.join(missing)} (it has "
                        f"{', '.join(sorted(installed))}); install it, e.g. apt-get install {packages}")


@functools.cache
def _languages(binary: str) -> frozenset[str]:
    result = subprocess.run([binary, "--list-langs"], capture_output=True, text=True, check=False)
    return frozenset(line.strip() for line in result.stdout.splitlines()[1:] if line.strip())


def recognise(image: Any, lang: str, dpi: int | None = None) -> PageText:
    """The text Tesseract reads in `image` (a PIL image), with its words' mean confidence."""
    pixels = io.BytesIO()
    image.save(pixels, "PPM")  # uncompressed: nothing to encode here or decode there
    command = [shutil.which("tesseract") or "tesseract", "stdin", "stdout", "-l", lang]
    command += ["--dpi", str(dpi)] if dpi else []
    result = subprocess.run([*command, "tsv"], input=pixels.getvalue(), capture_output=True, check=False,
                            env={**os.environ, "OMP_THREAD_LIMIT": "1"})
    if result.returncode:
        problem = result.stderr.decode("utf-8", "replace").strip().splitlines() or [f"exit {result.returncode}"]
        raise BadFile(f"Tesseract failed: {problem[-1]}")
    return parse_tsv(result.stdout.decode("utf-8", "replace"))


def parse_tsv(tsv: str) -> PageText:
    """Tesseract's TSV output as text (words joined by spaces, lines by newlines, a blank line
    between paragraphs) with the mean confidence of its words."""
    paragraphs: dict[tuple[str, ...], dict[str, list[str]]] = {}
    confidences = []
    for row in tsv.splitlines()[1:]:
        fields = row.split("\t")
        if len(fields) != 12 or fields[0] != "5" or not fields[11].strip():
            continue  # level 5 rows are words; the others are pages, blocks, paragraphs, lines
        page, block, paragraph, line = fields[1:5]
        paragraphs.setdefault((page, block, paragraph), {}).setdefault(line, []).append(fields[11])
        confidences.append(max(0.0, float(fields[10])))
    text = "\n\n".join("\n".join(" ".join(words) for words in lines.values()) for lines in paragraphs.values())
    confidence = sum(confidences) / len(confidences) if confidences else None
    return PageText(text, confidence, len(confidences))


# --- pages -----------------------------------------------------------------------------------


def _pillow():
    try:
        from PIL import Image, ImageOps
    except ImportError:
        raise DataError(f"OCR needs Pillow to read images: {INSTALL_HINT}") from None
    return Image, ImageOps


def pixel_limit() -> int | None:
    """Pillow's decompression-bomb limit: it warns above this many pixels, refuses above twice."""
    return _pillow()[0].MAX_IMAGE_PIXELS


def pdf_renderer_version() -> str | None:
    """pypdfium2's version (each pins its PDFium), or None when it is not installed."""
    try:
        import pypdfium2  # noqa: F401  (installed and importable, not only listed)
    except ImportError:
        return None
    return f"pypdfium2 {importlib.metadata.version('pypdfium2')}"


def _pdfium():
    try:
        import pypdfium2
    except ImportError:
        raise DataError(f"rendering scanned PDF pages for OCR needs pypdfium2: {INSTALL_HINT}") from None
    return pypdfium2


_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, MemoryError)


def image_page_count(path: Path) -> int:
    """The pages (frames) of an image file: 1, or more for a multi-page TIFF."""
    image_module, _ = _pillow()
    try:
        with image_module.open(path) as image:
            return getattr(image, "n_frames", 1)
    except (*_IMAGE_ERRORS, image_module.DecompressionBombError) as err:
        raise BadFile(f"not a readable image ({one_line(err)})") from None


def load_image_page(path: Path, index: int) -> Any:
    """Page `index` of an image file as an 8-bit grayscale PIL image: upright by its EXIF
    orientation, and transparency laid on white (dark text on a clear background stays dark)."""
    image_module, image_ops = _pillow()
    try:
        with image_module.open(path) as image:
            image.seek(index)
            page = image_ops.exif_transpose(image)
            if page.mode in ("RGBA", "LA", "PA") or "transparency" in page.info:
                page = page.convert("RGBA")
                page = image_module.alpha_composite(image_module.new("RGBA", page.size, "white"), page)
            return page.convert("L")
    except (*_IMAGE_ERRORS, image_module.DecompressionBombError) as err:
        raise BadFile(f"not a readable image ({one_line(err)})") from None


def render_pdf_page(path: Path, index: int, dpi: int = PDF_DPI) -> Any:
    """Page `index` of a PDF rendered as an 8-bit grayscale PIL image at `dpi`."""
    pdfium = _pdfium()
    with _PDFIUM:
        try:
            document = pdfium.PdfDocument(path)
        except pdfium.PdfiumError as err:
            raise BadFile(f"PDFium cannot open it ({one_line(err)})") from None
        try:
            return document[index].render(scale=dpi / 72, grayscale=True).to_pil().convert("L")
        except pdfium.PdfiumError as err:
            raise BadFile(f"PDFium cannot render page {index + 1} ({one_line(err)})") from None
        finally:
            document.close()


def cpu_cores() -> int:
    """The cores this process may run on (data.ocr.workers' default)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def identity(settings: OcrConfig, suffixes: set[str]) -> dict[str, Any]:
    """What of the OCR can change the documents of a source whose files have these suffixes
    (lower case), for the token cache's fingerprint: {} when it has no image or PDF. A source
    that needs the engine (images; PDFs under ocr.mode='always') without it, its language or the
    ocr extra is a DataError now, before anything is read."""
    pdfs, images = ".pdf" in suffixes, bool(suffixes & IMAGE_SUFFIXES)
    if settings.mode == "never" or not (pdfs or images):
        return {"ocr": "never"} if pdfs or images else {}
    try:
        engine = engine_version()
        check_language(settings.lang)
        if pdfs and settings.mode == "always":
            _pdfium()
    except DataError:
        if images or settings.mode == "always":
            raise
        engine = None  # PDFs with text layers need no engine; a scanned page will say so
    return {"ocr": settings.mode, "ocr_lang": settings.lang, "ocr_engine": engine,
            "pdf_renderer": pdf_renderer_version() if pdfs else None,
            "ocr_drop_below": settings.min_confidence if settings.drop_low_confidence else None}


# --- the cache and the pool ------------------------------------------------------------------


def _cache_key(path: Path, engine: str, lang: str, dpi: int | None) -> str:
    digest = hashlib.sha256(json.dumps([CACHE_VERSION, engine, lang, dpi]).encode())
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Recognizer:
    """Recognises the pages of files through the cache, `workers` pages at once.

    `image(path)` and `pdf_pages(path, indices)` start the work on a file's pages at once and
    return a function that waits for them: its PageTexts, in page order (a BadFile when the
    file cannot be read). `close()` stops the pool and logs pages, seconds and characters.
    `large_images` maps each image read above Pillow's decompression-bomb limit to its pixels.
    """

    def __init__(self, settings: OcrConfig, directory: Path):
        self.lang = settings.lang
        self.workers = settings.workers or cpu_cores()
        self.directory = directory
        self._engine: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._bar: Any = None
        self._lock = threading.Lock()
        self._started = 0.0
        self._quiet: tuple | None = None  # the warnings filter that silences Pillow's, while this reads
        self.recognised = self.cached = self.characters = 0
        self.large_images: dict[Path, int] = {}

    def image(self, path: Path) -> Callable[[], list[PageText]]:
        """Every page of an image file (a multi-page TIFF has several)."""
        if self._quiet is None:
            before = list(warnings.filters)
            warnings.filterwarnings("ignore", category=_pillow()[0].DecompressionBombWarning)
            self._quiet = warnings.filters[0] if warnings.filters[0] not in before else ()  # (): the caller's own

        def load(index: int) -> Any:
            page = load_image_page(path, index)
            limit = pixel_limit()
            if limit is not None and page.width * page.height > limit:
                with self._lock:
                    self.large_images[path] = page.width * page.height
            return page

        return self._pages(path, None, load, None)

    def pdf_pages(self, path: Path, indices: list[int]) -> Callable[[], list[PageText]]:
        """The pages `indices` (from 0) of a PDF, rendered at PDF_DPI."""
        return self._pages(path, indices, lambda index: render_pdf_page(path, index), PDF_DPI)

    def _pages(self, path: Path, indices: list[int] | None, load: Callable[[int], Any],
               dpi: int | None) -> Callable[[], list[PageText]]:
        """`indices` None: every page of an image file, whose count the cache also keeps."""
        key = _cache_key(path, self.engine(), self.lang, dpi)
        known, page_count = self._load(key)
        if indices is None:
            page_count = page_count if page_count is not None else image_page_count(path)
            indices = list(range(page_count))
        futures = {index: self._submit(load, index, dpi) for index in indices if index not in known}
        self.cached += len(indices) - len(futures)

        def wait() -> list[PageText]:
            pages = {**known, **{index: future.result() for index, future in futures.items()}}
            if futures:
                self._save(key, path, page_count, pages)
            return [pages[index] for index in indices]

        return wait

    def engine(self) -> str:
        if self._engine is None:
            self._engine = engine_version()
            check_language(self.lang)
        return self._engine

    def _submit(self, load: Callable[[int], Any], index: int, dpi: int | None) -> Future:
        if self._pool is None:
            from tqdm.auto import tqdm

            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="ocr")
            self._bar = tqdm(total=0, desc="OCR", unit="page", dynamic_ncols=True)
            self._started = time.perf_counter()
        with self._lock:
            self._bar.total += 1
            self._bar.refresh()
        return self._pool.submit(self._recognise, load, index, dpi)

    def _recognise(self, load: Callable[[int], Any], index: int, dpi: int | None) -> PageText:
        page = None
        try:
            page = recognise(load(index), self.lang, dpi)
            return page
        finally:  # a page that fails is done too, as far as the bar goes
            with self._lock:
                if page is not None:
                    self.recognised += 1
                    self.characters += len(page.text)
                    self._bar.set_postfix(chars=self.characters, refresh=False)
                self._bar.update(1)

    def _load(self, key: str) -> tuple[dict[int, PageText], int | None]:
        """The pages of the cache entry `key` recognised so far, and its page count if kept."""
        try:
            entry = json.loads((self.directory / f"{key}.json").read_text(encoding="utf-8"))
            pages = {int(index): PageText(**page) for index, page in entry["pages"].items()}
            return pages, entry.get("page_count")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}, None  # not recognised yet, or a damaged entry: recognise anew

    def _save(self, key: str, path: Path, page_count: int | None, pages: dict[int, PageText]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        entry: dict[str, Any] = {"file": str(path), "engine": self._engine, "lang": self.lang,
                                 "pages": {str(index): dataclasses.asdict(page) for index, page in pages.items()}}
        if page_count is not None:
            entry["page_count"] = page_count
        write_json(self.directory / f"{key}.json", entry, ensure_ascii=False)

    def close(self) -> None:
        if self._quiet in warnings.filters:
            warnings.filters.remove(self._quiet)  # an "ignore" leaves nothing in the warnings' registries
        self._quiet = None
        if self._pool is None:
            if self.cached:
                log.info("OCR: %d page(s) read from the cache %s", self.cached, self.directory)
            return
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._bar.close()
        seconds = time.perf_counter() - self._started
        log.info("OCR (%s, %s, %d workers): %d page(s) recognised in %.1f s (%.2f pages/s), %d characters; "
                 "%d page(s) from the cache", self._engine, self.lang, self.workers, self.recognised, seconds,
                 self.recognised / max(seconds, 1e-9), self.characters, self.cached)
        self._pool = None
