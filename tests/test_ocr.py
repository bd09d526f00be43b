"""OCR: images and scanned PDF pages become documents of the text Tesseract reads in them.

The images are text the tests render with Pillow in DejaVu Sans (the font matplotlib ships),
and recognition is judged by the character error rate against that text, computed here. The
tests that run Tesseract skip when it is not installed (apt-get install tesseract-ocr), except
in CI, which installs it: there they fail instead.
"""

import importlib.util
import io
import os
import shutil
import sys
import warnings

import pytest
from conftest import corpus_documents
from matplotlib import font_manager
from matplotlib.figure import Figure
from PIL import Image, ImageDraw, ImageFont

from jaxgpt import data
from jaxgpt.config import OcrConfig
from jaxgpt.data import DataError, ocr

needs_tesseract = pytest.mark.skipif(
    shutil.which("tesseract") is None and not os.environ.get("CI"),
    reason="Tesseract is not installed: apt-get install tesseract-ocr (CI installs it)")
needs_pdf = pytest.mark.skipif(
    importlib.util.find_spec("pypdf") is None or importlib.util.find_spec("pypdfium2") is None,
    reason="the ocr extra is not installed: pip install -e '.[ocr]'")

FONT = font_manager.findfont("DejaVu Sans")
INVOICE = ["Invoice 2024-07-15: total $1,234.56 (paid).",
           "Ship to: 42 Elm St., Springfield; ref #A93-117!",
           "Questions? Call 555-0199, ext. 8."]
PANGRAM = ["The quick brown fox jumps over the lazy dog.",
           "Pack my box with five dozen liquor jugs (1990)."]


def render(lines, size=22):
    """Black text on white, one line per entry, with margins."""
    font = ImageFont.truetype(FONT, size)
    width = max(int(font.getlength(line)) for line in lines) + 2 * size
    image = Image.new("L", (width, int(size * (1.6 * len(lines) + 2))), 255)
    draw = ImageDraw.Draw(image)
    for k, line in enumerate(lines):
        draw.text((size, size + 1.6 * size * k), line, font=font, fill=0)
    return image


def edit_distance(a, b):
    """Levenshtein distance: insertions, deletions and substitutions of characters."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        current = [i]
        for j, y in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def cer(recognised, lines):
    """Character error rate of `recognised` against the lines drawn (blank lines and runs of
    spaces do not count: layout is not the text)."""
    expected = "\n".join(lines)
    got = "\n".join(" ".join(line.split()) for line in recognised.splitlines() if line.strip())
    return edit_distance(got, expected) / len(expected)


def config(tmp_path, **overrides):
    return {"cache_dir": str(tmp_path / "cache"), "val_fraction": 0.0, "tokenizer": "char", **overrides}


def documents(corpus):
    return corpus_documents(corpus)


@pytest.fixture
def engine_calls(monkeypatch):
    """The size of every image given to the engine (threads share this list)."""
    calls = []
    real = ocr.recognise

    def counting(image, *args, **kwargs):
        calls.append(image.size)
        return real(image, *args, **kwargs)

    monkeypatch.setattr(ocr, "recognise", counting)
    return calls


@pytest.fixture
def fake_engine(monkeypatch):
    """An engine without Tesseract: it 'reads' an image as its width, with that confidence."""
    monkeypatch.setattr(ocr, "engine_version", lambda: "fake 1")
    monkeypatch.setattr(ocr, "check_language", lambda lang: None)
    monkeypatch.setattr(ocr, "recognise", lambda image, lang, dpi=None: ocr.PageText(
        f"width {image.width}", float(image.width), 2))


def text_pdf(text):
    """A one-page PDF whose text is a real text layer (matplotlib's PDF backend)."""
    figure = Figure(figsize=(5, 1))
    figure.text(0.05, 0.5, text)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="pdf")
    return buffer.getvalue()


def merged_pdf(*pdfs):
    import pypdf

    writer = pypdf.PdfWriter()
    for pdf in pdfs:
        writer.append(pypdf.PdfReader(io.BytesIO(pdf)))
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


def image_pdf(image):
    """A one-page PDF that is only a picture: no text layer."""
    buffer = io.BytesIO()
    image.save(buffer, "PDF", resolution=100)
    return buffer.getvalue()


# --- recognition ------------------------------------------------------------------------------


@needs_tesseract
def test_png_jpeg_and_tiff_pages_become_documents_within_5_percent_cer(tmp_path, caplog):
    root = tmp_path / "scans"
    root.mkdir()
    render(INVOICE).save(root / "a.png")
    render(PANGRAM, size=18).convert("RGB").save(root / "b.jpg", quality=90)
    render(PANGRAM).save(root / "c.tif", save_all=True, append_images=[render(INVOICE, size=26)])
    (root / "d.txt").write_text("typed text beside the scans")
    caplog.set_level("INFO", logger="jaxgpt.data")
    corpus = data.prepare(config(tmp_path, source=str(root)))
    docs = documents(corpus)
    assert len(docs) == 5 and docs[-1] == "typed text beside the scans"
    for recognised, lines in zip(docs, [INVOICE, PANGRAM, PANGRAM, INVOICE], strict=False):
        assert cer(recognised, lines) <= 0.05, recognised
    # the log gives each file's mean confidence, high for clean print
    confidences = [float(r.getMessage().rsplit(" ", 1)[1]) for r in caplog.records
                   if r.getMessage().startswith("OCR ") and "mean confidence" in r.getMessage()]
    assert len(confidences) == 3 and min(confidences) > 80


@needs_tesseract
@needs_pdf
def test_a_mixed_pdf_gives_its_text_layer_and_its_scanned_page_in_order(tmp_path, engine_calls):
    layer = "Chapter 7, typed: 12 apples + 30 pears = 42 fruits."
    pdf = tmp_path / "mixed.pdf"
    pdf.write_bytes(merged_pdf(text_pdf(layer), image_pdf(render(INVOICE))))
    (document,) = documents(data.prepare(config(tmp_path, source=str(pdf))))
    first, _, second = document.partition("\n")
    assert first == layer
    assert cer(second, INVOICE) <= 0.05, second
    assert len(engine_calls) == 1  # only the page without a text layer

    (layer_only,) = documents(data.prepare(config(tmp_path, source=str(pdf), ocr={"mode": "never"})))
    assert layer_only.strip() == layer
    (everything,) = documents(data.prepare(config(tmp_path, source=str(pdf), ocr={"mode": "always"})))
    assert len(engine_calls) == 2  # the text page now; the scanned one came from the cache
    assert cer(everything, [layer, *INVOICE]) <= 0.05, everything


# --- the cache --------------------------------------------------------------------------------


@needs_tesseract
def test_a_second_prepare_runs_no_ocr_until_the_engine_changes(tmp_path, engine_calls, monkeypatch):
    root = tmp_path / "scans"
    root.mkdir()
    render(INVOICE).save(root / "a.png")
    render(PANGRAM).save(root / "b.png")
    first = data.prepare(config(tmp_path, source=str(root)))
    assert len(engine_calls) == 2
    # another setting: the token cache is built anew, but no page is recognised again
    second = data.prepare(config(tmp_path, source=str(root), max_documents=10))
    assert second.directory != first.directory and len(engine_calls) == 2
    assert documents(second) == documents(first) and cer(documents(first)[0], INVOICE) <= 0.05
    # a damaged OCR cache entry is recognised anew, not trusted
    for entry in (tmp_path / "cache" / "ocr").glob("*.json"):
        entry.write_text('{"pages": {"0": {"text": 1}}}')
    data.prepare(config(tmp_path, source=str(root), max_documents=11))
    assert len(engine_calls) == 4
    # another engine version: a new token cache and the pages recognised again
    monkeypatch.setattr(ocr, "engine_version", lambda: "tesseract 99.0")
    third = data.prepare(config(tmp_path, source=str(root)))
    assert third.directory != first.directory and len(engine_calls) == 6


def test_the_token_cache_fingerprint_follows_the_ocr_settings(tmp_path, fake_engine, monkeypatch):
    render(["x"]).save(tmp_path / "scan.png")
    source = str(tmp_path / "scan.png")
    directories = {data.prepare(config(tmp_path, source=source, **settings)).directory for settings in [
        {}, {"ocr": {"mode": "always"}}, {"ocr": {"min_confidence": 50.0, "drop_low_confidence": True}}]}
    monkeypatch.setattr(ocr, "engine_version", lambda: "fake 2")
    directories.add(data.prepare(config(tmp_path, source=source)).directory)
    assert len(directories) == 4
    # a threshold that only lists files changes no document: the same cache
    listed = data.prepare(config(tmp_path, source=source, ocr={"min_confidence": 50.0})).directory
    assert listed in directories


# --- bad files, missing engine, settings --------------------------------------------------------


@needs_tesseract
def test_a_corrupt_image_is_a_warning_naming_it_or_a_one_line_error(tmp_path):
    root = tmp_path / "scans"
    root.mkdir()
    render(INVOICE).save(root / "good.png")
    png = (root / "good.png").read_bytes()
    (root / "truncated.png").write_bytes(png[: len(png) // 2])
    (root / "noise.jpg").write_bytes(bytes(range(256)) * 4)
    (root / "notes.txt").write_text("typed notes")
    with pytest.warns(UserWarning, match="unreadable file") as caught:
        corpus = data.prepare(config(tmp_path, source=str(root)))
    message = str(caught[0].message)
    assert "truncated.png" in message and "noise.jpg" in message and "good.png" not in message
    good, notes = documents(corpus)
    assert cer(good, INVOICE) <= 0.05 and notes == "typed notes"

    with pytest.raises(DataError, match=r"noise\.jpg.*data\.files\.on_bad_file='warn'") as raised:
        data.prepare(config(tmp_path, source=str(root), files={"on_bad_file": "error"}))
    assert "\n" not in str(raised.value)


@needs_tesseract
def test_an_image_above_pillows_decompression_bomb_limit_is_read_and_named_in_one_warning(tmp_path, monkeypatch):
    root = tmp_path / "scans"
    root.mkdir()
    render(INVOICE).save(root / "big.png")
    width, height = Image.open(root / "big.png").size
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", width * height * 3 // 4)  # above it, as a 12000² scan is
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning counts, however often it comes
        corpus = data.prepare(config(tmp_path, source=str(root)))
    bombs = [str(w.message) for w in caught if "decompression" in str(w.message).lower()]
    assert len(bombs) == 1 and f"big.png ({width * height:,} pixels)" in bombs[0], bombs
    (text,) = documents(corpus)
    assert cer(text, INVOICE) <= 0.05  # read all the same
    assert not [f for f in warnings.filters if f[2] is Image.DecompressionBombWarning]  # the filters as they were


@needs_pdf
def test_without_the_engine_an_image_source_is_a_one_line_error_saying_what_to_install(tmp_path, monkeypatch):
    root = tmp_path / "in"
    root.mkdir()
    render(["x"]).save(root / "scan.png")
    (root / "typed.pdf").write_bytes(text_pdf("A typed page needs no OCR."))
    (root / "scanned.pdf").write_bytes(image_pdf(render(["y"])))
    monkeypatch.setenv("PATH", str(tmp_path / "no-programs-here"))
    with pytest.raises(DataError, match=r"apt-get install tesseract-ocr.*pip install 'jaxgpt\[ocr\]'") as raised:
        data.prepare(config(tmp_path, source=str(root / "scan.png")))
    assert "\n" not in str(raised.value)
    with pytest.raises(DataError, match="apt-get install tesseract-ocr"):
        data.prepare(config(tmp_path, source=str(root / "scanned.pdf")))
    # a PDF with a text layer needs no engine; under ocr.mode='never' an image is a binary file
    (typed,) = documents(data.prepare(config(tmp_path, source=str(root / "typed.pdf"))))
    assert typed.strip() == "A typed page needs no OCR."
    with pytest.warns(UserWarning, match="skipped 1 binary file"):
        data.prepare(config(tmp_path, source=str(root), ocr={"mode": "never"}))


def test_without_the_ocr_extra_the_error_says_which_extra(tmp_path, monkeypatch):
    render(["x"]).save(tmp_path / "scan.png")
    monkeypatch.setitem(sys.modules, "PIL", None)  # makes `from PIL import Image` fail
    monkeypatch.setattr(ocr.shutil, "which", lambda name: "/usr/bin/tesseract")
    with pytest.raises(DataError, match=r"needs Pillow.*pip install 'jaxgpt\[ocr\]'"):
        data.prepare(config(tmp_path, source=str(tmp_path / "scan.png")))


@needs_pdf
def test_without_the_pdf_renderer_a_scanned_pdf_says_which_extra(tmp_path, monkeypatch, fake_engine):
    (tmp_path / "scanned.pdf").write_bytes(image_pdf(render(["y"])))
    monkeypatch.setitem(sys.modules, "pypdfium2", None)
    with pytest.raises(DataError, match=r"needs pypdfium2.*pip install 'jaxgpt\[ocr\]'"):
        data.prepare(config(tmp_path, source=str(tmp_path / "scanned.pdf")))


def test_low_confidence_files_are_listed_and_dropped_when_asked(tmp_path, fake_engine):
    root = tmp_path / "scans"
    root.mkdir()
    Image.new("L", (40, 30), 255).save(root / "blurry.png")  # the fake engine: confidence 40
    Image.new("L", (90, 30), 255).save(root / "sharp.png")  # confidence 90
    with pytest.warns(UserWarning, match=r"1 file\(s\) have a mean OCR confidence below") as caught:
        kept = data.prepare(config(tmp_path, source=str(root), ocr={"min_confidence": 60}))
    assert "blurry.png (40.0)" in str(caught[0].message) and "sharp.png" not in str(caught[0].message)
    assert documents(kept) == ["width 40", "width 90"]
    with pytest.warns(UserWarning, match="dropped them"):
        dropped = data.prepare(config(tmp_path, source=str(root), ocr={"min_confidence": 60,
                                                                       "drop_low_confidence": True}))
    assert documents(dropped) == ["width 90"]


@needs_tesseract
def test_a_language_tesseract_lacks_names_the_package_to_install(tmp_path):
    render(["x"]).save(tmp_path / "scan.png")
    with pytest.raises(DataError, match="apt-get install tesseract-ocr-xyz"):
        data.prepare(config(tmp_path, source=str(tmp_path / "scan.png"), ocr={"lang": "xyz"}))


@pytest.mark.parametrize("section, key, value, message", [
    ("ocr", "mode", "sometimes", "data.ocr.mode='sometimes': must be 'auto', 'always' or 'never'"),
    ("ocr", "lang", "", "data.ocr.lang=''"),
    ("ocr", "lang", "eng deu", "joined by '\\+'"),
    ("ocr", "workers", 0, "data.ocr.workers=0: must be None or a positive integer"),
    ("ocr", "min_confidence", 101, r"data.ocr.min_confidence=101: must be None or a number in \[0, 100\]"),
    ("ocr", "min_confidence", "high", "data.ocr.min_confidence='high'"),
    ("ocr", "drop_low_confidence", "yes", "data.ocr.drop_low_confidence='yes': must be True or False"),
    ("files", "on_bad_file", "ignore", "data.files.on_bad_file='ignore': must be 'warn' or 'error'"),
])
def test_bad_ocr_settings_are_one_line_errors(tmp_path, section, key, value, message):
    with pytest.raises(DataError, match=message) as raised:
        data.prepare(config(tmp_path, **{section: {key: value}}))
    assert "\n" not in str(raised.value)


def test_dropping_low_confidence_files_needs_a_threshold():
    with pytest.raises(DataError, match="needs data.ocr.min_confidence"):
        OcrConfig(drop_low_confidence=True)


def test_tesseract_tsv_becomes_lines_and_paragraphs_with_the_mean_word_confidence():
    header = "level\tpage_num\tblock_num\tpar_num\tline_num\tword_num\tleft\ttop\twidth\theight\tconf\ttext"
    rows = [(1, 1, 0, 0, 0, 0, -1, ""), (5, 1, 1, 1, 1, 1, 90, "Hello"), (5, 1, 1, 1, 1, 2, 80, "world"),
            (4, 1, 1, 1, 2, 0, -1, ""), (5, 1, 1, 1, 2, 1, 70, "again"), (5, 1, 2, 1, 1, 1, 60, "New"),
            (5, 1, 2, 1, 1, 2, 0, " ")]
    tsv = "\n".join([header] + ["\t".join(map(str, (*r[:6], 0, 0, 1, 1, *r[6:]))) for r in rows])
    page = ocr.parse_tsv(tsv)
    assert page.text == "Hello world\nagain\n\nNew"
    assert page.words == 4 and page.confidence == pytest.approx((90 + 80 + 70 + 60) / 4)
    assert ocr.parse_tsv(header).confidence is None
