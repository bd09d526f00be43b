"""Data: every source kind, the token cache, batches against their invariants, devices.

Corpora are tiny files written to tmp_path, and the expected documents are the texts the
tests wrote. Multi-device tests run in subprocesses with fake CPU devices, so this process
keeps its single device.
"""

import contextlib
import hashlib
import importlib.util
import io
import json
import math
import platform
import signal
import subprocess
import sys
import sysconfig
import threading
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec
from processes import finished, free_port, with_devices

from jaxgpt import data, tokenizers
from jaxgpt.data import DataError, cache, shards
from jaxgpt.data.sources import stdlib_files
from jaxgpt.data.split import TrainSample, assign_splits
from jaxgpt.tokenizers import Tokenizer

fast = settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])

DOCS = {
    "a.txt": "The first document.\nIt has two lines.\n",
    "notes/b.md": "# Second\n\nUnicode: café, 東京, 🙂\n",
    "notes/deeper/c.py": "def third():\n    return 3\n",
    "d.tex": "\\section{Fourth} $x^2$\n",
}
# The order of a directory walk: sorted by path components.
DOCS_IN_ORDER = [DOCS[name] for name in sorted(DOCS, key=lambda name: Path(name).parts)]


def write_files(root, files):
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return root


def config(tmp_path, **overrides):
    """A data config with its cache in tmp_path and, unless overridden, no validation split."""
    return {"cache_dir": str(tmp_path / "cache"), "val_fraction": 0.0, **overrides}


def documents(tokens, tokenizer):
    """The documents of a token array: the runs of ids between <|eos|>, decoded."""
    ids = np.asarray(tokens).tolist()
    if not ids:
        return []
    pieces = [[]]
    for i in ids:
        if i == tokenizer.eos_id:
            pieces.append([])
        else:
            pieces[-1].append(i)
    return [tokenizer.decode(piece) for piece in pieces]


def cache_entries(tmp_path):
    root = tmp_path / "cache"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []




# --- path sources ---------------------------------------------------------------------------


def test_directory_gives_each_text_file_as_a_document_separated_by_eos(tmp_path):
    root = write_files(tmp_path / "corpus",
                       {**DOCS, ".hidden.txt": "secret", ".git/config": "secret", "empty.txt": ""})
    corpus = data.prepare(config(tmp_path, source=str(root)))
    assert documents(corpus.train, corpus.tokenizer) == DOCS_IN_ORDER
    tokens = np.asarray(corpus.train)
    assert np.sum(tokens == corpus.tokenizer.eos_id) == len(DOCS) - 1  # between documents only
    assert tokens[0] != corpus.tokenizer.eos_id and tokens[-1] != corpus.tokenizer.eos_id
    assert corpus.train.dtype == np.uint16 and len(corpus.val) == 0
    assert corpus.meta["splits"]["train"]["documents"] == len(DOCS)


def test_file_and_glob_sources(tmp_path):
    root = write_files(tmp_path / "corpus", DOCS)
    one = data.prepare(config(tmp_path, source=str(root / "a.txt")))
    assert documents(one.train, one.tokenizer) == [DOCS["a.txt"]]
    markdown = data.prepare(config(tmp_path, source=str(root / "**" / "*.md")))
    assert documents(markdown.train, markdown.tokenizer) == [DOCS["notes/b.md"]]
    notes = data.prepare(config(tmp_path, source=str(root / "notes" / "*")))
    assert documents(notes.train, notes.tokenizer) == [DOCS["notes/b.md"],
                                                       DOCS["notes/deeper/c.py"]]


def test_undecodable_bytes_are_replaced_and_counted_in_one_warning(tmp_path):
    root = write_files(tmp_path / "corpus", {
        "1.txt": b"caf\xe9 au lait \xff\xfe",  # three invalid bytes, each its own sequence
        "2.txt": b"ok \x80 then",
        "3.txt": "a real U+FFFD \ufffd is text, not a repair",
        "4.bin": b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR",
    })
    with pytest.warns(UserWarning) as caught:
        corpus = data.prepare(config(tmp_path, source=str(root)))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "replaced 4 undecodable byte sequence(s)" in message and "2 file(s)" in message
    assert "skipped 1 binary file(s)" in message
    assert documents(corpus.train, corpus.tokenizer) == [
        "caf\ufffd au lait \ufffd\ufffd", "ok \ufffd then",
        "a real U+FFFD \ufffd is text, not a repair"]


def test_jsonl_gives_one_document_per_line_from_the_configured_field(tmp_path):
    lines = [{"body": "first record", "id": 1}, {"body": "second\nrecord", "id": 2},
             {"body": "", "id": 3}, {"body": "lone \ud800 surrogate", "id": 4}]
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines[:2]) + "\n\n"
                    + "\n".join(json.dumps(line) for line in lines[2:]) + "\n", encoding="utf-8")
    with pytest.warns(UserWarning, match="replaced 1 undecodable"):
        corpus = data.prepare(config(tmp_path, source=str(path), files={"text_field": "body"}))
    assert documents(corpus.train, corpus.tokenizer) == [
        "first record", "second\nrecord", "lone \ufffd surrogate"]


def test_jsonl_errors_name_the_line_and_the_field(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"text": "fine"}\n{"content": "no text field"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"records.jsonl:2 has no field 'text'.*'content'"):
        data.prepare(config(tmp_path, source=str(path)))
    path.write_text('{"text": "fine"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(DataError, match=r"records.jsonl:2 is not valid JSON"):
        data.prepare(config(tmp_path, source=str(path)))
    path.write_text('{"text": 42}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"records.jsonl:1: field 'text' holds int, not text"):
        data.prepare(config(tmp_path, source=str(path)))


def pdf_bytes(pages):
    """A minimal PDF whose pages draw the given lines in Helvetica: a real text layer."""
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", "",
               "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for lines in pages:
        drawn = " ".join(f"({line}) Tj 0 -14 Td" for line in lines)
        stream = f"BT /F1 12 Tf 72 720 Td {drawn} ET"
        objects.append(f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream")
        objects.append("<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
                       f"/Resources << /Font << /F1 3 0 R >> >> /Contents {len(objects)} 0 R >>")
        kids.append(f"{len(objects)} 0 R")
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(kids)} >>"
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n".encode("latin-1")
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{offset:010d} 00000 n \n" for offset in offsets).encode()
    out += (f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n"
            "%%EOF\n").encode()
    return bytes(out)


@pytest.mark.skipif(importlib.util.find_spec("pypdf") is None,
                    reason="the pdf extra (pypdf) is not installed: pip install -e '.[pdf]'")
def test_pdf_gives_its_text_layer_as_one_document(tmp_path):
    root = write_files(tmp_path / "corpus", {
        "paper.pdf": pdf_bytes([["Attention is all", "you need"], ["Page two text"]]),
        "readme.txt": "plain text beside it",
    })
    corpus = data.prepare(config(tmp_path, source=str(root)))
    pdf_text, plain = documents(corpus.train, corpus.tokenizer)
    words = pdf_text.split()
    assert words == ["Attention", "is", "all", "you", "need", "Page", "two", "text"]
    assert plain == "plain text beside it"


def test_pdf_without_the_extra_says_which_extra_to_install(tmp_path, monkeypatch):
    (tmp_path / "paper.pdf").write_bytes(pdf_bytes([["text"]]))
    monkeypatch.setitem(sys.modules, "pypdf", None)  # makes `import pypdf` fail
    with pytest.raises(DataError, match=r"pip install 'jaxgpt\[pdf\]'"):
        data.prepare(config(tmp_path, source=str(tmp_path / "paper.pdf")))


def test_stdlib_is_the_standard_library_python_files_in_path_order(tmp_path):
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"test", "tests", "idlelib", "site-packages", "dist-packages"}

    def installed(relative: Path) -> bool:  # the build's configuration and a site's hooks (see the next test)
        top = relative.parts[0]
        return (top.startswith("config-3") if len(relative.parts) > 1
                else top.startswith("_sysconfigdata_") or top in ("sitecustomize.py", "usercustomize.py"))

    expected_files = sorted(
        path for path in root.rglob("*.py")
        if not any(part in skipped or part.startswith(".") for part in path.relative_to(root).parts[:-1])
        and not installed(path.relative_to(root)))
    texts = (path.read_text(encoding="utf-8") for path in expected_files)
    expected = [text for text in texts if text][:25]  # empty files are no documents
    corpus = data.prepare(config(tmp_path, source="stdlib", max_documents=25))
    assert documents(corpus.train, corpus.tokenizer) == expected
    assert stdlib_files() == stdlib_files()  # the same files in the same order, whatever the walk's order


def test_stdlib_of_one_python_installed_under_two_prefixes_is_one_corpus(tmp_path):
    """An installation writes its prefix into the build's configuration (`_sysconfigdata_*.py`,
    `config-3.X-*/python-config.py`), and a site may add its hooks: none of them is read, so the corpus
    of one Python is the same wherever it was installed."""
    sources = {"abc.py": "class ABC: ...\n", "json/__init__.py": "def dumps(o): ...\n",
               "configparser.py": "class ConfigParser: ...\n", "sysconfig.py": "def get_paths(): ...\n"}
    corpora = []
    for prefix in ("/usr/local", "/home/alice/.pyenv/versions/3.11.7"):
        root = write_files(tmp_path / prefix.strip("/").replace("/", "_"), {
            **sources, "_sysconfigdata__linux_x86_64-linux-gnu.py": f"build_time_vars = {{'prefix': '{prefix}'}}\n",
            "config-3.11-x86_64-linux-gnu/python-config.py": f"prefix = '{prefix}'\n",
            "sitecustomize.py": f"# {prefix}\n"})
        files = stdlib_files(root)
        corpora.append([(file.relative_to(root).as_posix(), file.read_text()) for file in files])
    assert corpora[0] == corpora[1] == [(name, sources[name]) for name in sorted(sources)]


def test_a_stdlib_corpus_records_which_pythons_standard_library_it_is(tmp_path, monkeypatch):
    """The figures measured on `stdlib` are those of one Python's standard library (each version
    ships other files): the prepared corpus says which, and `python -m jaxgpt.data` prints it."""
    from jaxgpt.data.__main__ import main

    files = stdlib_files()
    corpus = data.prepare(config(tmp_path, source="stdlib", max_documents=2))
    described = corpus.meta["source_description"]
    assert described == (f"the standard library of {platform.python_implementation()} {platform.python_version()} "
                         f"in {sysconfig.get_paths()['stdlib']}: {len(files)} files, "
                         f"{sum(file.stat().st_size for file in files):,} bytes")
    text = write_files(tmp_path / "text", {"a.txt": "Nothing to say.\n"})
    assert "source_description" not in data.prepare(config(tmp_path, source=str(text))).meta  # a path says it all
    out = io.StringIO()
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # the program sets its own
    terminate = signal.getsignal(signal.SIGTERM)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["jaxgpt.data", "--config.data.source=stdlib", "--config.data.max_documents=2",
                     "--config.data.tokenizer=char", f"--config.data.cache_dir={tmp_path / 'cache'}"]) == 0
    signal.signal(signal.SIGTERM, terminate)
    assert f"source: {described}\n" in out.getvalue()


def test_limits_cap_documents_and_bytes(tmp_path):
    root = write_files(tmp_path / "corpus", DOCS)
    two = data.prepare(config(tmp_path, source=str(root), max_documents=2))
    assert documents(two.train, two.tokenizer) == DOCS_IN_ORDER[:2]
    root = write_files(tmp_path / "cafe", {"1.txt": "abc", "2.txt": "café au lait", "3.txt": "x"})
    # 7 bytes: "abc" and the first 4 bytes of "café", which end inside the 2-byte "é".
    capped = data.prepare(config(tmp_path, source=str(root), max_bytes=7))
    assert documents(capped.train, capped.tokenizer) == ["abc", "caf"]


# --- TFDS -----------------------------------------------------------------------------------


def build_local_tfds(manual_dir, data_dir, config_name=None):
    """Prepare a local corpus as a TFDS dataset with TFDS's own API, offline."""
    import tensorflow_datasets as tfds

    from jaxgpt.data import tfds_local

    tfds.disable_progress_bar()
    kwargs = {"config": tfds_local.LocalTextCorpusConfig(name=config_name)} if config_name else {}
    builder = tfds.builder("local_text_corpus", data_dir=str(data_dir), **kwargs)
    builder.download_and_prepare(
        file_format="array_record",
        download_config=tfds.download.DownloadConfig(manual_dir=str(manual_dir)))
    return builder


def test_tfds_source_reads_a_dataset_built_offline_from_local_files(tmp_path):
    manual = write_files(tmp_path / "files", DOCS)
    build_local_tfds(manual, tmp_path / "tfds")
    corpus = data.prepare(config(tmp_path, source="tfds:local_text_corpus",
                                 tfds={"data_dir": str(tmp_path / "tfds")}))
    assert documents(corpus.train, corpus.tokenizer) == DOCS_IN_ORDER
    sliced = data.prepare(config(tmp_path, source="tfds:local_text_corpus:train[:2]",
                                 tfds={"data_dir": str(tmp_path / "tfds")}))
    assert documents(sliced.train, sliced.tokenizer) == DOCS_IN_ORDER[:2]


def test_tfds_splits_named_configs_and_a_separate_validation_source(tmp_path):
    manual = write_files(tmp_path / "files", {"train/a.txt": "training text one",
                                              "train/b.txt": "training text two, more",
                                              "validation/c.txt": "one more text"})
    build_local_tfds(manual, tmp_path / "tfds", config_name="mine")
    corpus = data.prepare(config(tmp_path, source="tfds:local_text_corpus/mine:train",
                                 val_source="tfds:local_text_corpus/mine:validation",
                                 tfds={"data_dir": str(tmp_path / "tfds")}))
    assert documents(corpus.train, corpus.tokenizer) == ["training text one",
                                                         "training text two, more"]
    assert documents(corpus.val, corpus.tokenizer) == ["one more text"]


def test_tfds_dataset_that_is_not_prepared_is_prepared_from_the_manual_dir(tmp_path):
    data_dir = tmp_path / "tfds"
    write_files(data_dir / "downloads" / "manual", {"x.txt": "prepared on demand"})
    corpus = data.prepare(config(tmp_path, source="tfds:local_text_corpus",
                                 tfds={"data_dir": str(data_dir)}))
    assert documents(corpus.train, corpus.tokenizer) == ["prepared on demand"]


def test_tfds_bad_input(tmp_path):
    data_dir = str(tmp_path / "tfds")
    with pytest.raises(DataError, match="unknown TFDS dataset 'no_such_corpus_xyz'"):
        data.prepare(config(tmp_path, source="tfds:no_such_corpus_xyz", tfds={"data_dir": data_dir}))
    with pytest.raises(DataError, match=r"not prepared and needs its files in .*manual"):
        data.prepare(config(tmp_path, source="tfds:local_text_corpus", tfds={"data_dir": data_dir}))
    build_local_tfds(write_files(tmp_path / "files", DOCS), data_dir)
    with pytest.raises(DataError, match="validation"):
        data.prepare(config(tmp_path, source="tfds:local_text_corpus:validation",
                            tfds={"data_dir": data_dir}))
    with pytest.raises(DataError, match=r"no feature 'body' \(its features: .*text"):
        data.prepare(config(tmp_path, source="tfds:local_text_corpus",
                            tfds={"text_feature": "body", "data_dir": data_dir}))
    with pytest.raises(DataError, match="not tfds:NAME"):
        data.prepare(config(tmp_path, source="tfds:"))


def _register_test_builders():
    import tensorflow_datasets as tfds

    class JaxgptTestDownloads(tfds.core.GeneratorBasedBuilder):
        """Downloads from a host that cannot exist (.invalid is reserved, RFC 2606)."""

        VERSION = tfds.core.Version("1.0.0")
        url_infos = {"https://corpus.invalid/text.txt": None}

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            raise AssertionError("the unreachable host must stop preparation before this")

        def _generate_examples(self):
            yield from ()

    class JaxgptTestNeedsTensorflow(JaxgptTestDownloads):
        url_infos = None

        def _split_generators(self, dl_manager):
            import tensorflow  # noqa: F401  as builders that decode with TF do

            return {}


_register_test_builders()


def test_tfds_preparation_that_cannot_work_here_fails_at_once_saying_why(tmp_path):
    data_dir = str(tmp_path / "tfds")
    with pytest.raises(DataError, match=r"downloads from corpus.invalid, which cannot be reached"):
        data.prepare(config(tmp_path, source="tfds:jaxgpt_test_downloads", tfds={"data_dir": data_dir}))
    if importlib.util.find_spec("tensorflow") is None:
        with pytest.raises(DataError, match=r"needs the Python module 'tensorflow'"):
            data.prepare(config(tmp_path, source="tfds:jaxgpt_test_needs_tensorflow",
                                tfds={"data_dir": data_dir}))


# --- splits, tokenizers, token files --------------------------------------------------------


def test_single_document_holds_out_its_tail(tmp_path):
    text = "".join(f"line {i}: to be or not to be\n" for i in range(40))
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    corpus = data.prepare(config(tmp_path, source=str(tmp_path / "one.txt"), val_fraction=0.1))
    cut = len(text) - round(0.1 * len(text))
    assert documents(corpus.train, corpus.tokenizer) == [text[:cut]]
    assert documents(corpus.val, corpus.tokenizer) == [text[cut:]]


@given(n=st.integers(2, 60), fraction=st.floats(0.01, 0.99))
def test_held_out_documents_partition_the_corpus_and_spread_out(n, fraction):
    docs = [f"document {i}" for i in range(n)]
    train, val = data.split_documents(docs, fraction)
    assert sorted(train + val) == sorted(docs) and not set(train) & set(val)
    assert len(val) == min(max(1, round(n * fraction)), n - 1)
    positions = sorted(docs.index(d) for d in val)
    # Evenly spread: each held-out document sits within its own 1/len(val) of the corpus.
    for k, position in enumerate(positions):
        assert k * n // len(val) <= position < (k + 1) * n / len(val)


def hashed_into_val(index, fraction):
    """The rule DataConfig documents for a text corpus, written out here on its own."""
    digest = hashlib.blake2b(index.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def test_held_out_documents_become_the_validation_split(tmp_path):
    files = {f"doc{i:02d}.txt": f"document number {i}\n" for i in range(40)}
    root = write_files(tmp_path / "corpus", files)
    # Byte-level BPE has no <|unk|>, so the held-out documents decode exactly.
    corpus = data.prepare(config(tmp_path, source=str(root), val_fraction=0.2, tokenizer="bpe",
                                 vocab_size=270))
    train, val = documents(corpus.train, corpus.tokenizer), documents(corpus.val, corpus.tokenizer)
    docs = list(files.values())
    expected_val = [d for i, d in enumerate(docs) if hashed_into_val(i, 0.2)]
    assert val == expected_val and 2 <= len(val) <= 16
    assert train == [d for d in docs if d not in expected_val]


@fast
@given(n=st.integers(2, 40), fraction=st.floats(0.01, 0.99))
def test_streaming_split_keeps_order_and_always_holds_out_a_document(n, fraction):
    docs = [f"document {i}" for i in range(n)]
    assigned = list(assign_splits(docs, fraction))
    assert [d for _, d in assigned] == docs
    val = [i for i, (which, _) in enumerate(assigned) if which == "val"]
    hashed = [i for i in range(n) if hashed_into_val(i, fraction)]
    assert val == (hashed if hashed else [n - 1])  # none hashed into val: the last document is


def test_streaming_split_holds_out_about_the_fraction():
    assigned = [which for which, _ in assign_splits(map(str, range(20_000)), 0.1)]
    assert abs(assigned.count("val") - 2000) < 4 * math.sqrt(20_000 * 0.1 * 0.9)
    assert all(which == "train" for which, _ in assign_splits(map(str, range(50)), 0.0))


def test_the_tokenizer_sample_is_read_as_it_is_iterated_and_again_from_memory():
    pulled = []  # the items the source has given so far

    def items():
        for item in [("train", "ab"), ("val", "x"), ("train", "cdé"), ("train", "fgh"), ("train", "never read")]:
            pulled.append(item)
            yield item

    sample = TrainSample(items(), max_bytes=7)
    documents = iter(sample)
    assert next(documents) == "ab" and len(pulled) == 1  # the rest of the source not read yet
    # "ab" (2 bytes) and "cdé" (4) make 6; "fgh" crosses the limit of 7 and is cut to "f".
    assert list(documents) == ["cdé", "f"] and len(pulled) == 4
    assert list(sample) == ["ab", "cdé", "f"] and len(pulled) == 4  # a second pass: from memory
    assert (sample.documents, sample.bytes, sample.read) == (["ab", "cdé", "f"], 7, None)  # full: read again later
    whole = TrainSample(iter([("train", "ab"), ("val", "x")]), max_bytes=7).finish()
    assert (whole.documents, whole.bytes, whole.read) == (["ab"], 2, [("train", "ab"), ("val", "x")])


def test_a_sample_read_once_lets_each_document_go_and_keeps_what_it_read_in_a_file(tmp_path):
    items = [("train", "ab"), ("val", "x\n\ud800y"), ("train", "cdé"), ("val", ""), ("train", "東京")]
    sample = TrainSample(iter(items), max_bytes=100, keep=False, spill=tmp_path / "read.tmp")
    assert not sample.empty() and sample.documents == ["ab"]  # read, not given yet
    assert list(sample) == ["ab", "cdé", "東京"]
    assert sample.documents == [None, None, None] and sample.bytes == 2 + 4 + 6  # counted, not held
    with pytest.raises(RuntimeError, match="read once"):
        next(iter(sample))
    assert len(sample.read) == 5 and list(sample.read) == items == list(sample.read)  # from the file, in order
    sample.discard_read()
    assert sample.read is None and not (tmp_path / "read.tmp").exists()
    full = TrainSample(iter(items), max_bytes=5, keep=False, spill=tmp_path / "full.tmp")
    assert list(full) == ["ab", "cd"] and full.read is None  # full: the corpus is read again, the file gone
    assert not (tmp_path / "full.tmp").exists()
    assert TrainSample(iter([("val", "x")]), max_bytes=5, spill=tmp_path / "empty.tmp").empty()


def test_bytes_per_token_is_text_bytes_over_tokens(tmp_path):
    root = write_files(tmp_path / "corpus", DOCS)
    corpus = data.prepare(config(tmp_path, source=str(root)))
    text_bytes = sum(len(d.encode("utf-8")) for d in DOCS.values())
    tokens = sum(len(d) for d in DOCS.values()) + len(DOCS) - 1  # characters + separators
    assert corpus.bytes_per_token["train"] == pytest.approx(text_bytes / tokens)
    assert math.isnan(corpus.bytes_per_token["val"])
    # A loss of 2 ln 2 nats per token over 2 bytes per token is 1 bit per byte.
    assert data.bits_per_byte(2 * math.log(2), 2.0) == pytest.approx(1.0)


def test_tokenizers_trained_on_train_split_or_loaded_and_ids_widen_past_uint16(tmp_path):
    words = " ".join(f"w{i}" for i in range(70_000))
    (tmp_path / "words.txt").write_text(words, encoding="utf-8")
    wide = data.prepare(config(tmp_path, source=str(tmp_path / "words.txt"), tokenizer="word"))
    assert wide.tokenizer.vocab_size > 65536 and wide.train.dtype == np.uint32
    assert np.asarray(wide.train).max() >= 65536
    assert documents(wide.train, wide.tokenizer) == [words]

    root = write_files(tmp_path / "corpus", DOCS)
    bpe = data.prepare(config(tmp_path, source=str(root), tokenizer="bpe", vocab_size=300))
    assert bpe.tokenizer.kind == "bpe" and bpe.tokenizer.vocab_size == 300
    assert documents(bpe.train, bpe.tokenizer) == DOCS_IN_ORDER
    saved = tmp_path / "tok.json"
    bpe.tokenizer.save(saved)
    loaded = data.prepare(config(tmp_path, source=str(root), tokenizer=str(saved)))
    assert loaded.tokenizer == bpe.tokenizer
    np.testing.assert_array_equal(loaded.train, bpe.train)


def test_char_tokenizer_is_trained_on_the_train_split_only(tmp_path):
    root = write_files(tmp_path / "corpus", {"a.txt": "aaaa", "b.txt": "bbbb", "c.txt": "cccc"})
    corpus = data.prepare(config(tmp_path, source=str(root), val_fraction=0.34))
    held_out = documents(corpus.val, corpus.tokenizer)
    assert held_out == [""]  # its characters were never seen: all <|unk|>, decoded to nothing
    assert np.all(np.asarray(corpus.val) == corpus.tokenizer.unk_id)


def test_token_arrays_are_read_only(tmp_path):
    corpus = data.prepare(config(tmp_path, source=str(write_files(tmp_path / "c", DOCS)),
                                 val_fraction=0.25))
    for split in (corpus.train, corpus.val):
        with pytest.raises((ValueError, TypeError)):
            split[0] = 1


# --- the cache ------------------------------------------------------------------------------


def test_cache_is_reused_when_nothing_changed(tmp_path, encode_calls):
    root = write_files(tmp_path / "corpus", DOCS)
    first = data.prepare(config(tmp_path, source=str(root)))
    assert len(encode_calls) == len(DOCS)
    encode_calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an intact cache passes its checks without a word
        again = data.prepare(config(tmp_path, source=str(root), eval_stride=3))  # not a token setting
    assert encode_calls == [] and again.directory == first.directory
    np.testing.assert_array_equal(again.train, first.train)
    assert cache_entries(tmp_path) == [first.directory.name]


def test_meta_records_the_blake2b_checksum_of_each_token_file(tmp_path):
    corpus = data.prepare(config(tmp_path, source=str(write_files(tmp_path / "c", DOCS)), val_fraction=0.25))
    for split in ("train", "val"):
        (shard,) = corpus.meta["splits"][split]["shards"]
        content = (corpus.directory / f"{split}-00000.bin").read_bytes()
        assert shard == {"file": f"{split}-00000.bin", "tokens": len(content) // 2,
                         "blake2b": hashlib.blake2b(content, digest_size=16).hexdigest(),
                         "start": [shard["start"][0], 0]}  # a split's first shard starts at its first document


def change_ids(path, fraction, vocab_size):
    """Change `fraction` of a uint16 token file's ids, in place, each to another id of the
    vocabulary: damage that no range check can see."""
    tokens = np.memmap(path, dtype=np.uint16, mode="r+")
    rng = np.random.default_rng(0)
    where = rng.choice(len(tokens), size=round(fraction * len(tokens)), replace=False)
    tokens[where] = (tokens[where] + rng.integers(1, vocab_size, len(where))) % vocab_size
    tokens.flush()
    return len(where)


@pytest.fixture
def small_chunks(monkeypatch):
    """Check token files 4 ids at a time, so that even tiny files take many chunks."""
    monkeypatch.setattr(shards, "CHECK_CHUNK_BYTES", 8)


def test_ids_changed_to_other_valid_ids_are_found_and_prepare_rebuilds(tmp_path, encode_calls, small_chunks):
    root = write_files(tmp_path / "corpus", DOCS)
    first = data.prepare(config(tmp_path, source=str(root)))
    path, vocab_size, original = first.directory / "train-00000.bin", first.tokenizer.vocab_size, np.array(first.train)
    changed = change_ids(path, 0.1, vocab_size)
    damaged = np.fromfile(path, np.uint16)
    assert changed >= 10 and np.count_nonzero(damaged != original) == changed
    assert damaged.max() < vocab_size

    with pytest.raises(DataError) as refused:
        data.open_corpus(first.directory)
    assert str(refused.value) == (f"the token cache {first.directory} is damaged (train-00000.bin does not match "
                                  f"its checksum); delete {first.directory} to rebuild it")
    encode_calls.clear()
    with pytest.warns(UserWarning, match=r"train-00000.bin does not match its checksum\): rebuilding only the damaged"):
        rebuilt = data.prepare(config(tmp_path, source=str(root)))
    assert encode_calls and rebuilt.directory == first.directory
    assert documents(rebuilt.train, rebuilt.tokenizer) == DOCS_IN_ORDER  # the source's tokens again
    assert cache_entries(tmp_path) == [rebuilt.directory.name]  # the damaged copy is gone
    encode_calls.clear()
    assert data.prepare(config(tmp_path, source=str(root))).meta == rebuilt.meta and encode_calls == []


def test_an_id_outside_the_vocabulary_is_named_with_its_file_and_position(tmp_path, small_chunks):
    root = write_files(tmp_path / "corpus", DOCS)
    first = data.prepare(config(tmp_path, source=str(root), val_fraction=0.25))
    vocab_size, original = first.tokenizer.vocab_size, np.array(first.val)
    tokens = np.memmap(first.directory / "val-00000.bin", dtype=np.uint16, mode="r+")
    tokens[[5, 9]] = vocab_size + 7, vocab_size  # in the second and third chunks of 4 ids
    tokens.flush()
    with pytest.raises(DataError, match=rf"is damaged \(val-00000.bin holds id {vocab_size + 7} at position 5, "
                                        rf"outside the tokenizer's {vocab_size} ids\); delete .* to rebuild it"):
        data.open_corpus(first.directory)
    with pytest.warns(UserWarning, match=f"val-00000.bin holds id {vocab_size + 7}"):
        rebuilt = data.prepare(config(tmp_path, source=str(root), val_fraction=0.25))
    np.testing.assert_array_equal(rebuilt.val, original)


def test_a_tokenizer_that_gives_ids_outside_its_vocabulary_writes_no_cache(tmp_path, monkeypatch):
    root = write_files(tmp_path / "corpus", DOCS)
    tokenizer = tokenizers.train_tokenizer("char", list(DOCS.values()))
    original = Tokenizer.encode
    calls = []

    def off_by_one(self, text, *args, **kwargs):
        calls.append(text)
        ids = original(self, text, *args, **kwargs)
        return ids + [self.vocab_size] if len(calls) == 2 else ids

    monkeypatch.setattr(Tokenizer, "encode", off_by_one)
    with pytest.raises(DataError, match=rf"the char tokenizer gave id {tokenizer.vocab_size}, outside its "
                                        rf"{tokenizer.vocab_size} ids, for document 2 of the train split"):
        data.prepare(config(tmp_path, source=str(root)), tokenizer=tokenizer)
    assert cache_entries(tmp_path) == []


def as_version_1(directory):
    """Make a cache look as jaxgpt's first cache format wrote it: version 1, no checksums."""
    meta = json.loads((directory / "meta.json").read_text())
    meta["version"] = 1
    for counts in meta["splits"].values():
        del counts["shards"]
    (directory / "meta.json").write_text(json.dumps(meta))


def test_a_cache_of_the_first_version_is_never_trusted(tmp_path, encode_calls, monkeypatch):
    root = write_files(tmp_path / "corpus", DOCS)
    current, readable = cache.CACHE_VERSION, cache.READABLE_VERSIONS
    monkeypatch.setattr(cache, "CACHE_VERSION", 1)
    monkeypatch.setattr(cache, "READABLE_VERSIONS", (1,))
    old = data.prepare(config(tmp_path, source=str(root)))
    as_version_1(old.directory)
    monkeypatch.setattr(cache, "CACHE_VERSION", current)
    monkeypatch.setattr(cache, "READABLE_VERSIONS", readable)

    encode_calls.clear()
    new = data.prepare(config(tmp_path, source=str(root)))
    assert encode_calls and new.directory != old.directory  # the version is part of the fingerprint
    assert documents(new.train, new.tokenizer) == DOCS_IN_ORDER
    with pytest.raises(DataError, match=rf"{old.directory} is not one this jaxgpt reads \(format 'jaxgpt-tokens' "
                                        rf"version 1, not 'jaxgpt-tokens' version {current}\); delete"):
        data.open_corpus(old.directory)

    as_version_1(new.directory)  # an old cache where this version's belongs is replaced, not refused
    encode_calls.clear()
    with pytest.warns(UserWarning, match="version 1.*building it anew"):
        again = data.prepare(config(tmp_path, source=str(root)))
    assert encode_calls and again.directory == new.directory and again.meta["version"] == current
    assert documents(again.train, again.tokenizer) == DOCS_IN_ORDER


def test_cache_is_rebuilt_when_the_source_or_tokenizer_changes(tmp_path, encode_calls):
    root = write_files(tmp_path / "corpus", DOCS)
    first = data.prepare(config(tmp_path, source=str(root)))

    (root / "a.txt").write_text("Changed text.\n", encoding="utf-8")
    encode_calls.clear()
    changed = data.prepare(config(tmp_path, source=str(root)))
    assert encode_calls and changed.directory != first.directory
    assert documents(changed.train, changed.tokenizer)[0] == "Changed text.\n"

    encode_calls.clear()
    word = data.prepare(config(tmp_path, source=str(root), tokenizer="word"))
    assert encode_calls and word.tokenizer.kind == "word" and word.directory != changed.directory

    saved = tmp_path / "tok.json"
    tokenizers.train_tokenizer("char", "abc").save(saved)
    by_file = data.prepare(config(tmp_path, source=str(root), tokenizer=str(saved)))
    tokenizers.train_tokenizer("char", "xyz").save(saved)  # same path, another tokenizer
    encode_calls.clear()
    rebuilt = data.prepare(config(tmp_path, source=str(root), tokenizer=str(saved)))
    assert encode_calls and rebuilt.directory != by_file.directory
    assert rebuilt.tokenizer == tokenizers.load(saved)


def test_interrupted_build_leaves_only_a_build_directory_that_is_never_read(tmp_path, monkeypatch):
    root = write_files(tmp_path / "corpus", DOCS)
    calls = []
    original = Tokenizer.encode

    def interrupt_third_document(self, text, *args, **kwargs):
        calls.append(text)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", interrupt_third_document)
    with pytest.raises(KeyboardInterrupt):
        data.prepare(config(tmp_path, source=str(root)))
    (partial,) = cache_entries(tmp_path)  # no cache: a build directory to resume from
    assert partial.startswith(".") and partial.endswith(".partial")
    with pytest.raises(DataError, match="not a prepared corpus"):
        data.open_corpus(tmp_path / "cache" / partial)
    monkeypatch.undo()
    corpus = data.prepare(config(tmp_path, source=str(root)))
    assert documents(corpus.train, corpus.tokenizer) == DOCS_IN_ORDER
    assert cache_entries(tmp_path) == [corpus.directory.name]


KILLED_BUILD = """
import os, signal, sys
from jaxgpt import data
from jaxgpt.tokenizers import Tokenizer
original, calls = Tokenizer.encode, []
def encode_then_die(self, text, *args, **kwargs):
    calls.append(text)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup runs, as after a power cut
    return original(self, text, *args, **kwargs)
Tokenizer.encode = encode_then_die
data.prepare({"source": sys.argv[1], "cache_dir": sys.argv[2], "val_fraction": 0.0})
"""


def test_killed_build_leaves_only_a_partial_directory_that_is_never_read(tmp_path, encode_calls):
    root = write_files(tmp_path / "corpus", DOCS)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_BUILD, str(root), str(tmp_path / "cache")],
        capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    (partial,) = cache_entries(tmp_path)
    assert partial.startswith(".") and partial.endswith(".partial")
    assert (tmp_path / "cache" / partial / "progress.json").exists()  # killed mid-build
    corpus = data.prepare(config(tmp_path, source=str(root)))
    assert encode_calls  # finished anew (no shard was complete), not read from the partial directory
    assert documents(corpus.train, corpus.tokenizer) == DOCS_IN_ORDER
    assert cache_entries(tmp_path) == [corpus.directory.name]  # the dead build's leftovers went


def test_cache_made_with_another_tokenizer_is_refused(tmp_path):
    root = write_files(tmp_path / "corpus", DOCS)
    corpus = data.prepare(config(tmp_path, source=str(root)))
    other = tokenizers.train_tokenizer("word", list(DOCS.values()))
    with pytest.raises(DataError, match="made with another tokenizer"):
        data.open_corpus(corpus.directory, tokenizer=other)
    assert data.open_corpus(corpus.directory, tokenizer=corpus.tokenizer).meta == corpus.meta
    other.save(corpus.directory / "tokenizer.json")  # swapped behind the cache's back
    with pytest.raises(DataError, match="made with another tokenizer"):
        data.prepare(config(tmp_path, source=str(root)))


# --- bad input ------------------------------------------------------------------------------


def test_missing_paths_raise_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.prepare(config(tmp_path, source=str(tmp_path / "nowhere.txt")))
    with pytest.raises(FileNotFoundError, match="no file matches"):
        data.prepare(config(tmp_path, source=str(tmp_path / "*.nothing")))
    (tmp_path / "a.txt").write_text("text", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match="tokenizer file"):
        data.prepare(config(tmp_path, source=str(tmp_path / "a.txt"),
                            tokenizer=str(tmp_path / "tok.json")))


def test_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no files"):
        data.prepare(config(tmp_path, source=str(tmp_path / "empty")))
    write_files(tmp_path / "blank", {"a.txt": "", "b.jsonl": "\n\n"})
    with pytest.raises(DataError, match="is empty"):
        data.prepare(config(tmp_path, source=str(tmp_path / "blank")))


def test_a_corpus_whose_every_file_was_skipped_says_which_and_why(tmp_path):
    root = write_files(tmp_path / "skipped", {"data.bin": b"\x00\x01 binary", "scan.png": b"\x89PNG\r\n\x1a\n\x00\x00"})
    (root / "link.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(DataError) as raised:
        data.prepare(config(tmp_path, source=str(root), ocr={"mode": "never"}))
    message = str(raised.value)
    assert "every file was skipped" in message and "val_fraction" not in message and "\n" not in message
    assert f"2 binary file(s): {root / 'data.bin'}, {root / 'scan.png'}" in message
    assert "data.ocr.mode='auto'" in message  # why an image is a binary file here
    assert f"{root / 'link.txt'} (a broken symbolic link to {tmp_path / 'gone.txt'})" in message


def test_a_broken_symbolic_link_is_skipped_like_any_unreadable_file_or_refused(tmp_path):
    root = write_files(tmp_path / "corpus", {"a.txt": "kept text"})
    (root / "b.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.warns(UserWarning, match=r"skipped 1 unreadable file\(s\): .*b.txt \(a broken symbolic link to"):
        corpus = data.prepare(config(tmp_path, source=str(root)))
    assert documents(corpus.train, corpus.tokenizer) == ["kept text"]
    with pytest.raises(DataError, match=r"cannot read .*b.txt: a broken symbolic link .*on_bad_file='warn'"):
        data.prepare(config(tmp_path, source=str(root), files={"on_bad_file": "error"}))


def test_a_vocab_size_beyond_what_the_text_can_teach_is_said_and_the_real_size_recorded(tmp_path):
    root = write_files(tmp_path / "corpus", DOCS)
    with pytest.warns(UserWarning, match=r"data.vocab_size=100,000 is more than the bpe tokenizer can learn") as said:
        corpus = data.prepare(config(tmp_path, source=str(root), tokenizer="bpe", vocab_size=100_000))
    text_bytes = sum(len(text.encode("utf-8")) for text in DOCS.values())
    learned = corpus.tokenizer.vocab_size
    assert learned < 256 + text_bytes + 3  # bytes, at most one merge per byte of text, 3 specials
    assert f"{text_bytes:,} bytes of training text: it has {learned:,} ids" in str(said[0].message)
    assert corpus.meta["tokenizer"]["vocab_size"] == learned


@pytest.mark.parametrize("key, value, message", [
    ("val_fraction", 1.0, r"data.val_fraction=1.0: must be a number in \[0, 1\)"),
    ("vocab_size", 0, "data.vocab_size=0: must be None or a positive integer"),
    ("max_bytes", -5, "data.max_bytes=-5"),
    ("source", "", "data.source=''"),
    ("tokenizer", "bpe", "needs data.vocab_size"),
])
def test_impossible_settings_are_named(tmp_path, key, value, message):
    with pytest.raises(DataError, match=message):
        data.prepare(config(tmp_path, **{key: value}))


def test_corpus_shorter_than_a_window_is_an_error():
    tokens = np.arange(10, dtype=np.uint16)
    with pytest.raises(DataError, match="fewer than block_size \\+ 1 = 11"):
        data.train_batch(tokens, seed=0, step=0, batch_size=2, block_size=10)
    data.train_batch(tokens, seed=0, step=0, batch_size=2, block_size=9)  # exactly one window
    with pytest.raises(DataError, match="at least 2"):
        next(data.eval_batches(tokens[:1], batch_size=2, block_size=4))
    with pytest.raises(DataError, match="eval stride 5"):
        next(data.eval_batches(tokens, batch_size=2, block_size=4, stride=5))


# --- training batches -----------------------------------------------------------------------


def positions(n):
    """A token array whose value at each position is the position: windows show their start."""
    return np.arange(n, dtype=np.uint32)


def test_train_windows_are_contiguous_and_targets_are_inputs_shifted_by_one():
    n, block = 500, 16
    for step in range(20):
        x, y = data.train_batch(positions(n), seed=7, step=step, batch_size=8, block_size=block)
        assert x.shape == y.shape == (8, block) and x.dtype == y.dtype == np.int32
        starts = x[:, 0]
        np.testing.assert_array_equal(x, starts[:, None] + np.arange(block))
        np.testing.assert_array_equal(y, x + 1)
        assert np.all((0 <= starts) & (starts + block + 1 <= n))


def test_train_batch_is_a_pure_function_of_seed_and_step(tmp_path):
    tokens = positions(10_000)

    def batch(seed, step, tokens=tokens):
        return data.train_batch(tokens, seed=seed, step=step, batch_size=8, block_size=32)[0]

    first = batch(1, 5)
    np.random.seed(123)  # NumPy's global state plays no part
    np.random.random(10)
    np.testing.assert_array_equal(first, batch(1, 5))
    assert len({batch(1, step)[:, 0].tobytes() for step in range(50)}) == 50
    assert len(set(batch(1, 5)[:, 0])) == 8  # rows are drawn independently, not repeated
    assert not np.array_equal(batch(1, 5), batch(2, 5))
    tokens.tofile(tmp_path / "tokens.bin")
    mapped = np.memmap(tmp_path / "tokens.bin", dtype=tokens.dtype, mode="r")
    np.testing.assert_array_equal(batch(1, 5, tokens=mapped), batch(1, 5))


def test_train_window_starts_cover_every_position_evenly():
    block, n_starts, steps, rows = 4, 10, 400, 8
    counts = np.zeros(n_starts, int)
    for step in range(steps):
        x, _ = data.train_batch(positions(block + n_starts), seed=0, step=step,
                                batch_size=rows, block_size=block)
        counts += np.bincount(x[:, 0], minlength=n_starts)
    expected = steps * rows / n_starts  # 320 draws per start; a fair die strays ±~50
    assert np.all(np.abs(counts - expected) < 0.25 * expected), counts


@fast
@given(batch_size=st.integers(1, 12), data_=st.data())
def test_train_rows_equal_the_rows_of_the_full_batch(batch_size, data_):
    start = data_.draw(st.integers(0, batch_size))
    stop = data_.draw(st.integers(start, batch_size))
    full = data.train_batch(positions(300), seed=3, step=11, batch_size=batch_size, block_size=8)
    for rows in (slice(start, stop), (start, stop)):
        part = data.train_batch(positions(300), seed=3, step=11, batch_size=batch_size,
                                block_size=8, rows=rows)
        for got, want in zip(part, full, strict=True):
            np.testing.assert_array_equal(got, want[start:stop])


# --- evaluation batches ---------------------------------------------------------------------


@fast
@given(n=st.integers(2, 150), block=st.integers(1, 12), batch_size=st.integers(1, 5),
       data_=st.data())
def test_eval_windows_count_every_target_exactly_once(n, block, batch_size, data_):
    stride = data_.draw(st.one_of(st.none(), st.integers(1, block)))
    counted = []
    batches = list(data.eval_batches(positions(n), batch_size=batch_size, block_size=block,
                                     stride=stride))
    assert len(batches) == data.num_eval_batches(n, batch_size=batch_size, block_size=block,
                                                 stride=stride)
    for x, y, mask in batches:
        assert x.shape == y.shape == mask.shape == (batch_size, block) and mask.dtype == bool
        np.testing.assert_array_equal(y[mask], x[mask] + 1)  # the next token of its input
        assert np.all(y[~mask & (y != 0)] == x[~mask & (y != 0)] + 1)  # unpadded, uncounted
        counted += y[mask].tolist()
    assert sorted(counted) == list(range(1, n))
    assert batches[-1][2][0].any()  # no batch is padding only


def test_eval_stride_counts_only_the_last_stride_targets_after_the_first_window():
    x, y, mask = next(data.eval_batches(positions(20), batch_size=3, block_size=8, stride=4))
    np.testing.assert_array_equal(x[:, 0], [0, 4, 8])
    assert mask[0].all()
    np.testing.assert_array_equal(mask[1:], np.tile([False] * 4 + [True] * 4, (2, 1)))
    # The last window of a 10-token split: targets 9 and then padding.
    x, y, mask = next(data.eval_batches(positions(10), batch_size=2, block_size=8))
    np.testing.assert_array_equal(y[1], [9, 0, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(mask[1], [True] + [False] * 7)


def test_eval_batch_rows_equal_the_rows_of_the_full_batch():
    for index in range(3):
        full = data.eval_batch(positions(60), index, batch_size=4, block_size=8, stride=5)
        part = data.eval_batch(positions(60), index, batch_size=4, block_size=8, stride=5,
                               rows=slice(1, 3))
        for got, want in zip(part, full, strict=True):
            np.testing.assert_array_equal(got, want[1:3])


# --- devices --------------------------------------------------------------------------------


def one_device_sharding():
    mesh = jax.make_mesh((1,), ("data",))
    return NamedSharding(mesh, PartitionSpec("data"))


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "jaxgpt-device-batches"]


def test_device_batches_from_a_resumed_step_equal_the_pure_batches():
    tokens = positions(1000)

    def make(step, rows):
        return data.train_batch(tokens, seed=5, step=step, batch_size=4, block_size=8, rows=rows)

    with data.DeviceBatches(make, start_step=7, end_step=12, batch_size=4,
                            sharding=one_device_sharding()) as batches:
        seen = []
        for step, (x, y) in batches:
            assert isinstance(x, jax.Array) and x.shape == (4, 8)
            want_x, want_y = make(step, slice(0, 4))
            np.testing.assert_array_equal(np.asarray(x), want_x)
            np.testing.assert_array_equal(np.asarray(y), want_y)
            seen.append(step)
    assert seen == [7, 8, 9, 10, 11]
    assert prefetch_threads() == []


def test_device_batches_raise_the_thread_exception_at_its_step_and_close_cleanly():
    def make(step, rows):
        if step == 3:
            raise RuntimeError("no batch 3")
        return (np.full((2, 4), step, np.int32),)

    batches = data.DeviceBatches(make, start_step=0, batch_size=2, sharding=one_device_sharding())
    assert [next(batches)[0] for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="no batch 3"):
        next(batches)
    batches.close()
    assert prefetch_threads() == []

    # A producer blocked on a full queue is released by close.
    endless = data.DeviceBatches(lambda step, rows: (np.zeros((2, 4), np.int32),),
                                 start_step=0, batch_size=2, sharding=one_device_sharding(), size=1)
    endless.close()
    assert prefetch_threads() == []
    with pytest.raises(StopIteration):
        next(endless)


EIGHT_DEVICES = """
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxgpt import data
assert jax.device_count() == 8
tokens = np.arange(3000, dtype=np.uint16)
mesh = jax.make_mesh((4, 2), ("data", "model"))
for spec in (P("data"), P(("data", "model"))):
    sharding = NamedSharding(mesh, spec)
    def make(step, rows):
        return data.train_batch(tokens, seed=3, step=step, batch_size=16, block_size=8, rows=rows)
    def make_eval(index, rows):
        return data.eval_batch(tokens, index, batch_size=16, block_size=8, stride=6, rows=rows)
    for maker in (make, make_eval):
        with data.DeviceBatches(maker, start_step=5, end_step=8, batch_size=16,
                                sharding=sharding) as batches:
            steps = []
            for step, arrays in batches:
                steps.append(step)
                for array, want in zip(arrays, maker(step, slice(0, 16))):
                    assert array.sharding == sharding and array.shape == want.shape
                    np.testing.assert_array_equal(np.asarray(array), want)
                    for shard in array.addressable_shards:
                        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
            assert steps == [5, 6, 7], steps
print("ok")
"""


def test_sharded_batches_on_eight_devices_equal_the_unsharded_batch():
    assert finished(with_devices(EIGHT_DEVICES)).strip() == "ok"


TWO_PROCESSES = """
import sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
process, port = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process)
from jaxgpt import data
tokens = np.arange(3000, dtype=np.uint16)
# Devices in id order: process 0 holds devices 0-3, so rows 0-3 of the batch.
sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
requested = set()
def make(step, rows):
    requested.add((rows.start, rows.stop))
    return data.train_batch(tokens, seed=1, step=step, batch_size=8, block_size=4, rows=rows)
with data.DeviceBatches(make, start_step=2, end_step=5, batch_size=8, sharding=sharding) as b:
    for step, arrays in b:
        full = data.train_batch(tokens, seed=1, step=step, batch_size=8, block_size=4)
        for array, want in zip(arrays, full):
            assert array.shape == (8, 4)
            for shard in array.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
assert requested == {(4 * process, 4 * process + 4)}, requested
jax.distributed.shutdown()
print("ok")
"""


def test_each_of_two_processes_makes_only_its_own_rows():
    port = free_port()  # where both processes meet
    workers = [with_devices(TWO_PROCESSES, process, port, devices=4) for process in (0, 1)]
    assert [finished(worker).strip() for worker in workers] == ["ok", "ok"]
