"""OCR speed and accuracy: pages per second through `data.prepare`, and the character error rate.

    python bench/bench_ocr.py [--pages-per-size 2] [--sizes 20,25,33]

Pages of running text (words, numbers, dates, punctuation; a fixed seed) are rendered with
Pillow in DejaVu Sans on a 1000×1400 page (A5 at 170 dpi) at each font size in pixels (20 px
≈ 8.5 pt, 25 px ≈ 10.5 pt, 33 px ≈ 14 pt at that resolution), saved as PNG files, and
prepared from a cold cache with data.ocr.workers 1 and 2: pages/s is pages over the whole
prepare's wall time. The same pages as one image-only PDF measure the scanned-PDF path
(rendered at 300 dpi, then recognised). The peer, side by side on the same pages: Tesseract
run the plain way, one page after another with its own OpenMP threads (no OMP_THREAD_LIMIT),
as a loop over `pytesseract.image_to_string` does. The CER is the Levenshtein distance between
the recognised and the rendered text (runs of spaces and blank lines not counted) over the
rendered text's length, per font size.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from matplotlib import font_manager  # noqa: E402
from PIL import Image, ImageDraw, ImageFont  # noqa: E402
from table import print_table  # noqa: E402  (bench/table.py: this script's folder is on sys.path)

from jaxgpt import data  # noqa: E402
from jaxgpt.data import ocr  # noqa: E402

PAGE = (1000, 1400)
MARGIN = 60
WORDS = ("the of and to in is that for on with as by at from this model data page text line table total "
         "invoice order shipped paid received report figure section chapter results method value error "
         "January March October Springfield Elm Street").split()


def page_text(rng: random.Random, font: ImageFont.FreeTypeFont) -> list[str]:
    """Lines of running text that fill a page at this font."""
    tokens = []
    for _ in range(2000):
        kind = rng.random()
        if kind < 0.08:
            tokens.append(f"{rng.randint(1, 9999):,}.{rng.randint(0, 99):02d}")
        elif kind < 0.12:
            tokens.append(f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}")
        else:
            word = rng.choice(WORDS)
            tokens.append(word.capitalize() if rng.random() < 0.1 else word)
        if rng.random() < 0.12:
            tokens[-1] += rng.choice(".,;:!?")
    lines, line, height = [], "", int(font.size * 1.5)
    for token in tokens:
        candidate = f"{line} {token}".strip()
        if font.getlength(candidate) > PAGE[0] - 2 * MARGIN:
            lines.append(line)
            line = token
            if (len(lines) + 1) * height > PAGE[1] - 2 * MARGIN:
                return lines
        else:
            line = candidate
    return lines


def render(lines: list[str], font: ImageFont.FreeTypeFont) -> Image.Image:
    image = Image.new("L", PAGE, 255)
    draw = ImageDraw.Draw(image)
    for k, line in enumerate(lines):
        draw.text((MARGIN, MARGIN + k * int(font.size * 1.5)), line, font=font, fill=0)
    return image


def edit_distance(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        current = [i]
        for j, y in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def normalised(text: str) -> str:
    return "\n".join(" ".join(line.split()) for line in text.splitlines() if line.strip())


def prepared_documents(source: Path, workers: int) -> tuple[float, list[str]]:
    """(seconds, documents) of a prepare of `source` into a new cache."""
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        corpus = data.prepare({"source": str(source), "cache_dir": cache, "val_fraction": 0.0,
                               "tokenizer": "char", "ocr": {"workers": workers}})
        seconds = time.perf_counter() - start
        ids = [int(i) for i in corpus.train]
    pieces, current = [], []
    for i in ids + [corpus.tokenizer.eos_id]:
        if i == corpus.tokenizer.eos_id:
            pieces.append(corpus.tokenizer.decode(current))
            current = []
        else:
            current.append(i)
    return seconds, pieces


def peer_seconds(images: list[Image.Image]) -> float:
    """Tesseract the plain way: one page after another, with its own OpenMP threads."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_THREAD_LIMIT"}
    start = time.perf_counter()
    for image in images:
        pixels = io.BytesIO()
        image.save(pixels, "PPM")
        subprocess.run(["tesseract", "stdin", "stdout", "-l", "eng"], input=pixels.getvalue(),
                       capture_output=True, check=True, env=env)
    return time.perf_counter() - start


def cpu_model() -> str:
    try:
        output = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "unknown (no lscpu)"
    return next((line.split(":", 1)[1].strip() for line in output.splitlines() if line.startswith("Model name")),
                "unknown")


def installed_mb(packages: list[str]) -> str:
    if shutil.which("dpkg-query") is None:
        return "?"
    output = subprocess.run(["dpkg-query", "-W", "-f=${Installed-Size}\n", *packages], capture_output=True,
                            text=True, check=False).stdout
    return f"{sum(int(n) for n in output.split() if n.isdigit()) / 1024:.0f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages-per-size", type=int, default=2)
    parser.add_argument("--sizes", default="20,25,33", help="font sizes in pixels")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    font_file = font_manager.findfont("DejaVu Sans")
    rng = random.Random(0)
    pages = []  # (font size, lines, image)
    for size in sizes:
        font = ImageFont.truetype(font_file, size)
        for _ in range(args.pages_per_size):
            lines = page_text(rng, font)
            pages.append((size, lines, render(lines, font)))
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores visible, {ocr.cpu_cores()} usable)")
    print(f"engine: {ocr.engine_version()}, {ocr.pdf_renderer_version()}; Debian packages tesseract-ocr, "
          f"libtesseract5, liblept5, tesseract-ocr-eng, tesseract-ocr-osd: "
          f"{installed_mb(['tesseract-ocr', 'libtesseract5', 'liblept5', 'tesseract-ocr-eng', 'tesseract-ocr-osd'])}")
    print(f"{len(pages)} pages of {PAGE[0]}x{PAGE[1]} px, font sizes {sizes} px\n")

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder, "pages")
        root.mkdir()
        for k, (_, _, image) in enumerate(pages):
            image.save(root / f"page{k:03d}.png")
        pdf = Path(folder, "scanned.pdf")
        pages[0][2].save(pdf, "PDF", resolution=170, save_all=True, append_images=[p[2] for p in pages[1:]])
        runs = {workers: prepared_documents(root, workers) for workers in (1, 2)}
        pdf_seconds, _ = prepared_documents(pdf, 2)
    peer = peer_seconds([image for _, _, image in pages])
    n = len(pages)
    print_table(("pages", "how", "seconds", "pages/s", "vs peer"), [
        ("PNG", "Tesseract, OpenMP threads, 1 page at a time (peer)", f"{peer:.1f}", f"{n / peer:.2f}", "1.00"),
        *[("PNG", f"data.prepare, ocr.workers={w}", f"{s:.1f}", f"{n / s:.2f}", f"{peer / s:.2f}")
          for w, (s, _) in runs.items()],
        ("PDF (image only)", "data.prepare, ocr.workers=2, 300 dpi", f"{pdf_seconds:.1f}", f"{n / pdf_seconds:.2f}",
         f"{peer / pdf_seconds:.2f}"),
    ])
    print()
    documents = runs[2][1]
    rows = []
    for size in sizes:
        pairs = [(normalised(doc), "\n".join(lines)) for doc, (s, lines, _) in zip(documents, pages, strict=True)
                 if s == size]
        errors = sum(edit_distance(got, expected) for got, expected in pairs)
        length = sum(len(expected) for _, expected in pairs)
        rows.append((f"{size} px", str(len(pairs)), str(length), str(errors), f"{100 * errors / length:.2f}%"))
    print_table(("font", "pages", "characters", "edits", "CER"), rows)


if __name__ == "__main__":
    main()
