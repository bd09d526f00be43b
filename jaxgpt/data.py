"""Data: sources → a token file on disk → deterministic batches → devices.

    corpus = prepare(cfg.data)         # read, tokenize and cache; later runs reuse the cache
    x, y = train_batch(corpus.train, seed=0, step=s, batch_size=B, block_size=T)
    for x, y, mask in eval_batches(corpus.val, batch_size=B, block_size=T): ...
    make = lambda step, rows: train_batch(corpus.train, seed=0, step=step, batch_size=B,
                                          block_size=T, rows=rows)
    with DeviceBatches(make, start_step=s, batch_size=B, sharding=sharding) as batches:
        for step, (x, y) in batches: ...   # global jax.Arrays, made ahead by a thread

**Sources** (`data.source`, see `default_data_config`):

- a path: a file, a directory (every file below it, sorted; names starting with "." are
  skipped) or a glob. Files of any extension are text, read as UTF-8 (undecodable bytes
  become U+FFFD, counted in one warning; files with a NUL byte in their first 8 KiB are
  binary and skipped), one document per file; `.jsonl` holds one document per line, in
  the field `data.text_field`; `.pdf` is one document, its text layer (needs the pdf
  extra: `pip install 'jaxgpt[pdf]'`). Empty documents are dropped.
- `stdlib`: the `.py` files of the running Python's standard library (no tests, no
  idlelib, no site-packages), sorted by path, one document each: ~11 MB of real code on
  every machine that has Python.
- `tfds:NAME[:SPLIT]` (split "train" by default; NAME may carry a config and version,
  `name/config:1.0.0`, and SPLIT may be a slice, `train[:10%]`): the text feature
  `data.tfds_text_feature` of each example, read through TFDS's ArrayRecord data source
  (no TensorFlow needed) from `data.tfds_data_dir`. A dataset that is not prepared is
  prepared first when that needs neither TensorFlow nor an unreachable network. To turn
  your own files into a TFDS dataset see `jaxgpt.tfds_local`.

**The cache**: `prepare` splits the documents into train and validation (held-out
documents spread evenly over the corpus, or the tail of a single document), trains the
tokenizer on the train split (or loads the one named), and writes, in
`<cache_dir>/<name>-<fingerprint>/`: `train.bin` and `val.bin` (the token ids, uint16 when
the vocabulary fits, else uint32, with one `<|eos|>` between consecutive documents and
none at either end), `tokenizer.json` and `meta.json`. The fingerprint hashes the source
(file paths, sizes and modification times; a TFDS dataset's identity), the tokenizer and
every setting that changes the tokens, so a matching cache is reused and any change makes
a new one. A build happens in a hidden `.partial` directory renamed into place when
complete, so an interrupted build leaves nothing that is later read. The corpus is held
in memory while it is tokenized.

**Batches** are pure functions of their arguments: a training batch of (seed, step), so a
run resumed at step s sees exactly the batches of an uninterrupted run, with no iterator
state to save; an evaluation batch of its index. Each takes `rows` so that a process can
make only its own rows of the global batch.

Bad input raises `FileNotFoundError` (a missing path) or `DataError` (a `ValueError`) with
a one-line message that says what is wrong and what to do.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import math
import os
import queue
import re
import shutil
import socket
import sysconfig
import threading
import urllib.parse
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from ml_collections import config_dict

from jaxgpt import tokenizers
from jaxgpt.tokenizers import Tokenizer

log = logging.getLogger(__name__)

CACHE_FORMAT = "jaxgpt-tokens"
CACHE_VERSION = 1
SPLITS = ("train", "val")
STDLIB_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}
)
BINARY_PROBE_BYTES = 8192  # a NUL byte in this prefix marks a binary file, as git judges
UNREACHABLE_PROBE_SECONDS = 5.0


class DataError(ValueError):
    """A data source, setting or cache that cannot be used; the message says what to do."""


# --- configuration ----------------------------------------------------------------------


def default_data_config() -> config_dict.ConfigDict:
    """The data section of a config, with its defaults.

    source: 'stdlib' | a file, directory or glob | 'tfds:NAME[:SPLIT]'.
    val_source: None (hold out part of `source`) or a second source for validation, e.g.
      'tfds:NAME:validation'; `val_fraction` is then unused.
    text_field: the field of each `.jsonl` line that holds the text.
    tfds_text_feature: the feature of a TFDS example that holds the text.
    tfds_data_dir: where TFDS datasets are prepared; None = TFDS's default
      (~/tensorflow_datasets, or $TFDS_DATA_DIR).
    tokenizer: 'char' | 'word' | 'bpe' (train a new one on the train split) or the path
      of a tokenizer file written by `Tokenizer.save`.
    vocab_size: ids of a new tokenizer, special ones included; None = every character or
      word seen (char, word). BPE needs one.
    val_fraction: in [0, 1): the fraction of documents held out for validation, or of the
      text when the corpus is a single document (its tail).
    max_documents, max_bytes: read at most this many documents / UTF-8 bytes of each
      source, in order (the document that crosses the byte cap is cut); None = all.
    cache_dir: where token files are cached; None = $XDG_CACHE_HOME/jaxgpt/data or
      ~/.cache/jaxgpt/data. Deleting it only costs a rebuild.
    eval_stride: the step between evaluation windows (1..block_size); None = block_size.
      Not used by `prepare`: pass it to `eval_batch`/`eval_batches`.
    """
    cfg = config_dict.ConfigDict()
    cfg.source = "stdlib"
    cfg.val_source = config_dict.placeholder(str)
    cfg.text_field = "text"
    cfg.tfds_text_feature = "text"
    cfg.tfds_data_dir = config_dict.placeholder(str)
    cfg.tokenizer = "char"
    cfg.vocab_size = config_dict.placeholder(int)
    cfg.val_fraction = 0.1
    cfg.max_documents = config_dict.placeholder(int)
    cfg.max_bytes = config_dict.placeholder(int)
    cfg.cache_dir = config_dict.placeholder(str)
    cfg.eval_stride = config_dict.placeholder(int)
    return cfg


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The data config, checked; keys a config leaves out take their defaults."""

    source: str
    val_source: str | None
    text_field: str
    tfds_text_feature: str
    tfds_data_dir: str | None
    tokenizer: str
    vocab_size: int | None
    val_fraction: float
    max_documents: int | None
    max_bytes: int | None
    cache_dir: Path

    @classmethod
    def from_config(cls, data_cfg: Mapping[str, Any]) -> _Settings:
        defaults = default_data_config()
        value = {field.name: data_cfg.get(field.name, defaults[field.name])
                 for field in dataclasses.fields(cls)}
        for key in ("source", "text_field", "tfds_text_feature", "tokenizer"):
            _check(isinstance(value[key], str) and value[key], key, value[key],
                   "a non-empty string")
        for key in ("val_source", "tfds_data_dir", "cache_dir"):
            _check(value[key] is None or (isinstance(value[key], str) and value[key]), key,
                   value[key], "None or a non-empty string")
        for key in ("vocab_size", "max_documents", "max_bytes"):
            v = value[key]
            _check(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0),
                   key, v, "None or a positive integer")
        fraction = value["val_fraction"]
        _check(isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
               and 0 <= fraction < 1, "val_fraction", fraction, "a number in [0, 1)")
        if value["tokenizer"] == "bpe" and value["vocab_size"] is None:
            raise DataError("data.tokenizer='bpe' needs data.vocab_size (e.g. 4096; at least "
                            "259: 256 bytes + 3 special tokens)")
        cache_dir = value["cache_dir"] or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or "~/.cache", "jaxgpt", "data")
        return cls(**{**value, "val_fraction": float(fraction),
                      "cache_dir": Path(cache_dir).expanduser()})

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's kind, or its file's name: part of the cache directory's name."""
        return self.tokenizer if self.tokenizer in tokenizers.KINDS else Path(self.tokenizer).stem


def _check(ok: Any, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise DataError(f"data.{key}={value!r}: must be {expected}")


# --- reading files ------------------------------------------------------------------------


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


# --- sources --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where documents come from: `identity` is cheap to compute and changes whenever the
    documents may have changed; `documents(reader)` reads them."""

    name: str
    identity: dict[str, Any]
    documents: Callable[[DocumentReader], Iterator[str]]


def _resolve_source(spec: str, settings: _Settings) -> _Source:
    if spec == "stdlib":
        return _files_source("stdlib", _stdlib_files(), settings)
    if spec.startswith("tfds:"):
        return _tfds_source(spec, settings)
    return _files_source(Path(spec).name or spec, list_files(spec), settings)


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in _walk(root, STDLIB_EXCLUDED_DIRS) if p.suffix == ".py"]
    if not files:
        raise DataError(f"this Python ships no .py files of its standard library in {root}; "
                        "set data.source to a file or directory of text")
    return files


def _files_source(name: str, files: list[Path], settings: _Settings) -> _Source:
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

    return _Source(name, identity, documents)


# A TFDS name may carry a config and a version (name/config:1.0.0); a split may be a slice.
_TFDS_SPEC = re.compile(r"tfds:(?P<name>[\w./-]+(?::[\d*]+\.[\d*]+\.[\d*]+)?)(?::(?P<split>.+))?")


def _tfds_source(spec: str, settings: _Settings) -> _Source:
    match = _TFDS_SPEC.fullmatch(spec)
    if match is None:
        raise DataError(f"data source {spec!r} is not tfds:NAME[:SPLIT] "
                        "(e.g. tfds:local_text_corpus:train)")
    name, split = match["name"], match["split"] or "train"
    import tensorflow_datasets as tfds

    from jaxgpt import tfds_local  # noqa: F401  registers local_text_corpus, to prepare it

    data_dir = settings.tfds_data_dir
    where = data_dir or "TFDS's default data directory"
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        raise DataError(f"unknown TFDS dataset {name!r}: tensorflow_datasets does not know it "
                        f"and it is not prepared in {where}; check the name, or set "
                        "data.tfds_data_dir to where it was prepared") from None
    except ValueError as err:  # e.g. an unknown config or version
        raise DataError(f"TFDS dataset {name!r}: {_first_line(err)}") from None
    if not builder.is_prepared():
        _prepare_tfds(builder, name)
    try:
        records = builder.as_data_source(split=split)
    except NotImplementedError:
        raise DataError(f"TFDS dataset {name!r} is prepared in {builder.data_dir} in a format "
                        "without random access; prepare it again with "
                        "file_format='array_record'") from None
    except ValueError as err:
        raise DataError(f"TFDS dataset {name!r}: {_first_line(err)}") from None
    feature = settings.tfds_text_feature
    features = list(builder.info.features.keys())
    if feature not in features:
        raise DataError(f"TFDS dataset {name!r} has no feature {feature!r} (its features: "
                        f"{', '.join(features)}); set data.tfds_text_feature")
    info_file = Path(builder.data_dir) / "dataset_info.json"
    identity = {
        "kind": "tfds",
        "dataset": builder.info.full_name,
        "split": split,
        "feature": feature,
        "data_dir": str(builder.data_dir),
        "examples": len(records),
        "prepared": info_file.stat().st_mtime_ns if info_file.exists() else None,
    }

    def documents(reader: DocumentReader) -> Iterator[str]:
        chunk = 1024  # records per read: fewer calls into ArrayRecord than one at a time
        for start in range(0, len(records), chunk):
            indices = list(range(start, min(start + chunk, len(records))))
            for record in records.__getitems__(indices):
                value = record[feature]
                if isinstance(value, bytes):
                    value = reader.decode(value, f"{name}:{split}")
                if not isinstance(value, str):
                    raise DataError(f"TFDS dataset {name!r}: feature {feature!r} holds "
                                    f"{type(value).__name__}, not text; set "
                                    "data.tfds_text_feature to a text feature")
                if value:
                    yield value

    return _Source(f"tfds-{name}-{split}", identity, documents)


def _prepare_tfds(builder: Any, name: str) -> None:
    """Prepare a TFDS dataset as ArrayRecord, failing at once where that cannot work here."""
    import tensorflow_datasets as tfds

    manual_dir = Path(builder.data_dir_root) / "downloads" / "manual"
    if builder.MANUAL_DOWNLOAD_INSTRUCTIONS:
        if not (manual_dir.is_dir() and any(manual_dir.iterdir())):
            raise DataError(f"TFDS dataset {name!r} is not prepared and needs its files in "
                            f"{manual_dir}: put them there, or prepare it (see "
                            "jaxgpt.tfds_local) into data.tfds_data_dir")
    else:
        # TFDS retries a failed download for minutes; an unreachable host fails here at once.
        _check_reachable(builder.url_infos or {}, name, builder.data_dir)
    log.info("preparing TFDS dataset %s in %s", name, builder.data_dir)
    try:
        builder.download_and_prepare(
            file_format="array_record",
            download_config=tfds.download.DownloadConfig(try_download_gcs=False),
        )
    except ModuleNotFoundError as err:
        raise DataError(f"preparing TFDS dataset {name!r} needs the Python module "
                        f"{err.name!r}: install it, or prepare the dataset where it is "
                        f"installed (file_format='array_record') and copy {builder.data_dir} "
                        "here") from None


def _check_reachable(urls: Mapping[str, Any], name: str, data_dir: Any) -> None:
    hosts = set()
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        if parts.hostname:
            hosts.add((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)))
    for host, port in sorted(hosts):
        try:
            socket.create_connection((host, port), timeout=UNREACHABLE_PROBE_SECONDS).close()
        except OSError as err:
            raise DataError(f"TFDS dataset {name!r} is not prepared, and preparing it downloads "
                            f"from {host}, which cannot be reached ({err}); connect to the "
                            f"network, or prepare it elsewhere and copy it to {data_dir}") \
                from None


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _capped(documents: Iterator[str], max_documents: int | None, max_bytes: int | None
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


# --- the cache ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A prepared corpus.

    tokenizer: the Tokenizer that made the tokens.
    train, val: the token ids of each split as read-only 1-D arrays (np.memmap of the
      cache files; an empty split is an empty array). Documents are separated by
      `tokenizer.eos_id`, so a new document follows each <|eos|>.
    meta: the contents of meta.json (fingerprint, token/byte/document counts per split, …).
    directory: the cache directory the arrays map.
    """

    tokenizer: Tokenizer
    train: np.ndarray
    val: np.ndarray
    meta: dict[str, Any]
    directory: Path

    @property
    def bytes_per_token(self) -> dict[str, float]:
        """UTF-8 bytes of each split's text / its token count (NaN for an empty split):
        the factor that turns a loss per token into one per byte (`bits_per_byte`)."""
        return {split: counts["bytes"] / counts["tokens"] if counts["tokens"] else math.nan
                for split, counts in self.meta["splits"].items()}


def prepare(data_cfg: Mapping[str, Any]) -> Corpus:
    """The corpus `data_cfg` describes (see `default_data_config`): reuse its cache when the
    fingerprint matches, else read, split, tokenize and write it."""
    settings = _Settings.from_config(data_cfg)
    given_tokenizer = None
    if settings.tokenizer in tokenizers.KINDS:
        tokenizer_identity: dict[str, Any] = {"kind": settings.tokenizer,
                                              "vocab_size": settings.vocab_size}
    else:
        path = Path(settings.tokenizer).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {settings.tokenizer!r} does not exist; set "
                                    "data.tokenizer to char, word, bpe or a saved tokenizer's "
                                    "path")
        given_tokenizer = tokenizers.load(path)
        tokenizer_identity = {"file_sha256": _sha256(path.read_bytes())}
    source = _resolve_source(settings.source, settings)
    val_source = _resolve_source(settings.val_source, settings) if settings.val_source else None
    fingerprint = _sha256(json.dumps({
        "format": [CACHE_FORMAT, CACHE_VERSION],
        "source": source.identity,
        "val_source": val_source.identity if val_source else None,
        "val_fraction": None if val_source else settings.val_fraction,
        "max_documents": settings.max_documents,
        "max_bytes": settings.max_bytes,
        "tokenizer": tokenizer_identity,
    }, sort_keys=True).encode())
    name = re.sub(r"[^\w.-]+", "-", f"{source.name}-{settings.tokenizer_name}")[:60]
    directory = settings.cache_dir / f"{name}-{fingerprint[:16]}"
    if not (directory / "meta.json").is_file():
        _build(directory, fingerprint, source, val_source, settings, given_tokenizer)
    corpus = open_corpus(directory, tokenizer=given_tokenizer)
    if corpus.meta["fingerprint"] != fingerprint:
        raise DataError(f"the token cache {directory} belongs to other data; delete it")
    return corpus


def open_corpus(directory: str | os.PathLike, tokenizer: Tokenizer | None = None) -> Corpus:
    """Map a cache directory written by `prepare`; with `tokenizer`, check that it is the one
    the tokens were made with (e.g. the tokenizer saved in a run being resumed)."""
    directory = Path(directory)
    try:
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{directory} is not a prepared corpus (no meta.json); run prepare") \
            from None
    except json.JSONDecodeError:
        raise DataError(f"{directory}/meta.json is damaged; delete {directory} to rebuild it") \
            from None
    if (meta.get("format"), meta.get("version")) != (CACHE_FORMAT, CACHE_VERSION):
        raise DataError(f"{directory} is not a token cache this jaxgpt reads (format "
                        f"{meta.get('format')!r} version {meta.get('version')!r}); delete it")
    tokenizer_file = directory / "tokenizer.json"
    cached = tokenizers.load(tokenizer_file)
    if _sha256(tokenizer_file.read_bytes()) != meta["tokenizer"]["sha256"] or (
        tokenizer is not None and tokenizer != cached
    ):
        expected = tokenizer or "the tokenizer recorded in its meta.json"
        raise DataError(f"the token cache {directory} was made with another tokenizer than "
                        f"{expected}; delete the directory to rebuild it, or use the tokenizer "
                        f"it holds ({cached})")
    dtype = np.dtype(meta["dtype"])
    arrays = {}
    for split in SPLITS:
        count = meta["splits"][split]["tokens"]
        path = directory / f"{split}.bin"
        if not path.is_file() or path.stat().st_size != count * dtype.itemsize:
            raise DataError(f"{path} is missing or has the wrong size for {count} tokens; "
                            f"delete {directory} to rebuild it")
        if count:
            arrays[split] = np.memmap(path, dtype=dtype, mode="r", shape=(count,))
        else:  # mmap cannot map an empty file
            arrays[split] = np.empty(0, dtype)
            arrays[split].flags.writeable = False
    return Corpus(cached, arrays["train"], arrays["val"], meta, directory)


def _build(directory: Path, fingerprint: str, source: _Source, val_source: _Source | None,
           settings: _Settings, tokenizer: Tokenizer | None) -> None:
    """Write the cache for `fingerprint` into a private partial directory, then rename it
    into place: a reader sees either nothing or a complete cache."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(directory)
    partial = directory.parent / f".{directory.name}.{socket.gethostname()}.{os.getpid()}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        reader = DocumentReader(settings.text_field)
        documents = _capped(source.documents(reader), settings.max_documents, settings.max_bytes)
        if not documents:
            raise DataError(f"the corpus {settings.source!r} is empty: it holds no text")
        if val_source is None:
            train_docs, val_docs = split_documents(documents, settings.val_fraction)
        else:
            train_docs = documents
            val_docs = _capped(val_source.documents(reader), settings.max_documents,
                               settings.max_bytes)
        reader.warn()
        log.info("tokenizing %s: %d training and %d validation documents", source.name,
                 len(train_docs), len(val_docs))
        if tokenizer is None:
            tokenizer = tokenizers.train_tokenizer(settings.tokenizer, train_docs,
                                                   settings.vocab_size)
        tokenizer.save(partial / "tokenizer.json")
        dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
        splits = {split: _write_tokens(partial / f"{split}.bin", docs, tokenizer, dtype)
                  for split, docs in zip(SPLITS, (train_docs, val_docs))}
        meta = {
            "format": CACHE_FORMAT,
            "version": CACHE_VERSION,
            "fingerprint": fingerprint,
            "source": settings.source,
            "val_source": settings.val_source,
            "val_fraction": settings.val_fraction,
            "max_documents": settings.max_documents,
            "max_bytes": settings.max_bytes,
            "dtype": np.dtype(dtype).name,
            "tokenizer": {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size,
                          "eos_id": tokenizer.eos_id,
                          "sha256": _sha256((partial / "tokenizer.json").read_bytes())},
            "splits": splits,
        }
        (partial / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        if directory.exists() and not (directory / "meta.json").exists():
            shutil.rmtree(directory)  # never published by a build; only a stray copy
        try:
            partial.rename(directory)
        except OSError:
            if not (directory / "meta.json").is_file():
                raise
            # Another process published the same fingerprint first; its cache is equal.
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _remove_abandoned_builds(directory: Path) -> None:
    """Delete partial builds of `directory` left by processes of this host that died."""
    host = socket.gethostname()
    for partial in directory.parent.glob(f".{glob.escape(directory.name)}.*.partial"):
        owner_host, _, pid = partial.name[len(directory.name) + 2:-len(".partial")].rpartition(".")
        if owner_host == host and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_tokens(path: Path, documents: Sequence[str], tokenizer: Tokenizer,
                  dtype: type) -> dict[str, int]:
    """Write the documents' ids with <|eos|> between documents; return the split's counts."""
    eos = np.array([tokenizer.eos_id], dtype)
    tokens = text_bytes = 0
    with open(path, "wb") as file:
        for i, document in enumerate(documents):
            ids = np.asarray(tokenizer.encode(document), dtype)
            if i:
                file.write(eos.tobytes())
                tokens += 1
            file.write(ids.tobytes())
            tokens += len(ids)
            text_bytes += len(document.encode("utf-8"))
    return {"tokens": tokens, "bytes": text_bytes, "documents": len(documents)}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- batches --------------------------------------------------------------------------------


def train_batch(tokens: np.ndarray, *, seed: int, step: int, batch_size: int, block_size: int,
                rows: slice | tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), int32 arrays (rows, block_size): windows of block_size + 1 tokens at
    random positions, inputs their first block_size tokens and targets their last.

    Row r of step `step` starts at h(seed, step, r) mod (len(tokens) − block_size), h a
    64-bit hash (SplitMix64's mixer), so the batch is a pure function of (seed, step) and
    every row can be made on its own: `rows` (a slice or (start, stop) of 0..batch_size)
    gives exactly those rows of the full batch.
    """
    _check_sizes(batch_size, block_size)
    if not (isinstance(step, (int, np.integer)) and step >= 0):
        raise DataError(f"step={step!r}: must be an integer ≥ 0")
    n_starts = len(tokens) - block_size  # window starts 0 … len − block_size − 1
    if n_starts < 1:
        raise DataError(f"the split has {len(tokens)} tokens, fewer than block_size + 1 = "
                        f"{block_size + 1}; use a smaller block_size or more text")
    row_ids = np.arange(*_row_range(rows, batch_size), dtype=np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps mod 2⁶⁴ by design
        key = _mix64(_mix64(np.uint64(int(seed) % 2**64)) + np.uint64(step))
        starts = _mix64(key + row_ids * _GOLDEN_GAMMA) % np.uint64(n_starts)
    windows = np.asarray(tokens[starts.astype(np.int64)[:, None] + np.arange(block_size + 1)])
    return windows[:, :-1].astype(np.int32), windows[:, 1:].astype(np.int32)


_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment: 2⁶⁴ / golden ratio


def _mix64(x):
    """SplitMix64's finalizer: a bijection of uint64 whose outputs look independent."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def num_eval_batches(num_tokens: int, *, batch_size: int, block_size: int,
                     stride: int | None = None) -> int:
    """How many batches `eval_batches` yields for a split of `num_tokens` tokens."""
    windows = _num_eval_windows(num_tokens, block_size, _stride(stride, block_size))
    return -(-windows // batch_size)


def eval_batch(tokens: np.ndarray, index: int, *, batch_size: int, block_size: int,
               stride: int | None = None, rows: slice | tuple[int, int] | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch `index` of the evaluation windows: (inputs, targets) int32 and mask bool, each
    (rows, block_size).

    Window w starts at token w·stride (stride ≤ block_size, default block_size). The mask
    marks the targets that count: all of window 0's, and of later windows the last
    `stride` (the earlier ones were counted by the window before, which also gives those
    the longer context). Over all windows, every token after the first is a counted target
    exactly once. A window that runs past the end is padded with id 0 and the padding
    masked out; rows past the last window (in the last batch) are all padding.
    """
    _check_sizes(batch_size, block_size)
    stride = _stride(stride, block_size)
    n = len(tokens)
    if n < 2:
        raise DataError(f"the split has {n} token(s); evaluation needs at least 2 (one input "
                        "and one target): raise data.val_fraction or give more text")
    first, last = _row_range(rows, batch_size)
    window = np.arange(index * batch_size + first, index * batch_size + last)
    starts = window * stride
    offsets = np.arange(block_size + 1)
    positions = starts[:, None] + offsets
    windows = np.where(positions < n, np.asarray(tokens[np.minimum(positions, n - 1)]), 0)
    # Targets that exist: position j of a window holds the target at token start + j + 1.
    exists = positions[:, 1:] < n
    first_counted = np.where(window == 0, 0, block_size - stride)[:, None]
    in_range = (window < _num_eval_windows(n, block_size, stride))[:, None]
    mask = exists & (offsets[None, :-1] >= first_counted) & in_range
    inputs = np.where(in_range, windows[:, :-1], 0).astype(np.int32)
    targets = np.where(exists & in_range, windows[:, 1:], 0).astype(np.int32)
    return inputs, targets, mask


def eval_batches(tokens: np.ndarray, *, batch_size: int, block_size: int,
                 stride: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every `eval_batch` of the split, in order (see `eval_batch`)."""
    count = num_eval_batches(len(tokens), batch_size=batch_size, block_size=block_size,
                             stride=stride)
    for index in range(count):
        yield eval_batch(tokens, index, batch_size=batch_size, block_size=block_size,
                         stride=stride)


def _num_eval_windows(num_tokens: int, block_size: int, stride: int) -> int:
    """1 + ⌈(n − 1 − block_size) / stride⌉: window 0 counts targets 1…block_size, window w
    the `stride` after those of window w − 1, until target n − 1 is counted."""
    return 1 + max(0, -(-(num_tokens - 1 - block_size) // stride))


def _stride(stride: int | None, block_size: int) -> int:
    if stride is None:
        return block_size
    if not (isinstance(stride, int) and 1 <= stride <= block_size):
        raise DataError(f"eval stride {stride!r} must be an integer in 1…block_size="
                        f"{block_size}")
    return stride


def _check_sizes(batch_size: Any, block_size: Any) -> None:
    for name, value in (("batch_size", batch_size), ("block_size", block_size)):
        if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
                and value > 0):
            raise DataError(f"{name}={value!r}: must be a positive integer")


def _row_range(rows: slice | tuple[int, int] | None, batch_size: int) -> tuple[int, int]:
    if rows is None:
        return 0, batch_size
    if isinstance(rows, slice):
        start, stop, step = rows.indices(batch_size)
        if step != 1:
            raise DataError(f"rows={rows!r}: must be a contiguous range (step 1)")
    else:
        start, stop = rows
    if not 0 <= start <= stop <= batch_size:
        raise DataError(f"rows={rows!r}: must lie within 0…batch_size={batch_size}")
    return start, stop


def bits_per_byte(loss: float, bytes_per_token: float) -> float:
    """BPB = loss / (ln 2 · bytes_per_token): a mean loss in nats per token, as bits per
    UTF-8 byte of text, comparable across tokenizers."""
    return loss / (math.log(2) * bytes_per_token)


# --- devices --------------------------------------------------------------------------------


def process_rows(sharding: jax.sharding.Sharding, batch_size: int) -> list[slice]:
    """The rows of a (batch_size, …) global batch held by this process's devices under
    `sharding` (which splits the batch dimension and replicates the others), as sorted
    contiguous slices: the process-local data of `jax.make_array_from_process_local_data`
    is these rows, in this order."""
    try:
        indices = sharding.addressable_devices_indices_map((batch_size, 1))
    except ValueError as err:
        raise DataError(f"batch_size={batch_size} cannot be laid out by {sharding}: "
                        f"{_first_line(err)}; make it a multiple of the batch shards") from None
    spans = sorted({index[0].indices(batch_size)[:2] for index in indices.values()})
    merged: list[list[int]] = []
    for start, stop in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [slice(start, stop) for start, stop in merged]


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


class DeviceBatches:
    """(step, batch) for step = start_step, start_step + 1, … (up to end_step, or forever),
    each batch made ahead of time by a background thread so the devices never wait.

    make_batch(step, rows) returns a tuple of NumPy arrays: rows `rows` (a slice) of the
    global batch of that step — e.g. `train_batch(..., step=step, rows=rows)` or
    `eval_batch(tokens, step, ..., rows=rows)`. Each process calls it only for the rows its
    devices hold, and the pieces become global jax.Arrays of leading dimension batch_size
    laid out by `sharding` (`jax.make_array_from_process_local_data`).

    At most `size` batches wait on the devices. An exception in make_batch is raised by
    the `next` that would have returned that step. Use as a context manager, or call
    close(), which stops the thread and waits for it.
    """

    def __init__(self, make_batch: Callable[[int, slice], tuple[np.ndarray, ...]], *,
                 start_step: int, batch_size: int, sharding: jax.sharding.Sharding,
                 end_step: int | None = None, size: int = 2):
        if not (isinstance(size, int) and size >= 1):
            raise DataError(f"prefetch size={size!r}: must be a positive integer")
        self._make_batch = make_batch
        self._sharding = sharding
        self._batch_size = batch_size
        self._rows = process_rows(sharding, batch_size)
        self._step, self._end_step = start_step, end_step
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._produce, name="jaxgpt-device-batches",
                                        daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            step = self._step
            while not self._stop.is_set() and (self._end_step is None or step < self._end_step):
                self._queue.put((step, self._device_batch(step)))
                step += 1
            self._queue.put(_END)
        except BaseException as error:  # surfaced in the consumer's thread
            self._queue.put(_Failure(error))

    def _device_batch(self, step: int) -> tuple[jax.Array, ...]:
        pieces = [self._make_batch(step, rows) for rows in self._rows]
        arrays = []
        for parts in zip(*pieces):
            local = parts[0] if len(parts) == 1 else np.concatenate(parts)
            global_shape = (self._batch_size, *local.shape[1:])
            arrays.append(jax.make_array_from_process_local_data(self._sharding, local,
                                                                 global_shape))
        return tuple(arrays)

    def __iter__(self) -> DeviceBatches:
        return self

    def __next__(self) -> tuple[int, tuple[jax.Array, ...]]:
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if item is _END or isinstance(item, _Failure):
            self._finished = True
            self._thread.join()
            if item is _END:
                raise StopIteration
            raise item.error
        return item

    def close(self) -> None:
        """Stop the thread and wait for it; batches made ahead are dropped."""
        self._finished = True
        self._stop.set()
        while self._thread.is_alive():
            try:  # make room, so that a producer blocked on a full queue can see the stop
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.01)

    def __enter__(self) -> DeviceBatches:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
