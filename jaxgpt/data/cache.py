"""The token cache: a corpus read, split, tokenized and written once, then memory-mapped.

`prepare` splits the documents into train and validation (held-out documents spread evenly
over the corpus, or the tail of a single document), trains the tokenizer on the train split
(or uses the one given), and writes, in `<cache_dir>/<name>-<fingerprint>/`: `train.bin` and
`val.bin` (the token ids, uint16 when the vocabulary fits, else uint32, with one `<|eos|>`
between consecutive documents and none at either end), `tokenizer.json` and `meta.json`. The
fingerprint hashes the source (file paths, sizes and modification times; a TFDS dataset's
identity), the tokenizer and every setting that changes the tokens, so a matching cache is
reused and any change makes a new one. A build happens in a hidden `.partial` directory
renamed into place when complete, so an interrupted build leaves nothing that is later read.
The corpus is held in memory while it is tokenized.

Integrity: meta.json records each split's BLAKE2b-128 checksum (`b2sum -l 128 train.bin`
prints the same), and every id is checked to lie within the tokenizer's vocabulary when the
cache is written and each time it is opened (one pass over the memory map, about a second
per GB). A cache that fails either check, or that another version of jaxgpt wrote, is
damaged: `open_corpus` refuses it, and `prepare` warns, deletes it and builds it anew.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt import tokenizers
from jaxgpt.config import DataConfig
from jaxgpt.data import records
from jaxgpt.data.examples import Examples, open_examples, write_examples
from jaxgpt.data.generated import generated_file, is_generated
from jaxgpt.data.sources import DocumentReader, Source, capped, files_source, list_files, split_documents, stdlib_files
from jaxgpt.data.tfds import tfds_source
from jaxgpt.errors import DataError
from jaxgpt.tokenizers import Tokenizer

log = logging.getLogger(__name__)

CACHE_FORMAT = "jaxgpt-tokens"
CACHE_VERSION = 2  # 2: meta.json records each split's checksum
SPLITS = ("train", "val")
CHECKSUM_BYTES = 16  # BLAKE2b-128: accidental damage goes unnoticed with probability 2⁻¹²⁸
CHECK_CHUNK_BYTES = 1 << 20  # the memory map is checked 1 MiB at a time, which stays in cache


class DamagedCacheError(DataError):
    """A cache directory whose token files cannot be trusted (damaged, or another version's):
    `open_corpus` says to delete it; `prepare` deletes and rebuilds it."""

    def __init__(self, directory: Path, problem: str):
        super().__init__(f"the token cache {directory} {problem}; delete {directory} to rebuild it")
        self.problem = problem


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A prepared corpus.

    tokenizer: the Tokenizer that made the tokens.
    train, val: the token ids of each split as read-only 1-D arrays (np.memmap of the
      cache files; an empty split is an empty array). Documents are separated by
      `tokenizer.eos_id`, so a new document follows each <|eos|>.
    meta: the contents of meta.json (fingerprint; per split the token, byte and document
      counts and the checksum; …).
    directory: the cache directory the arrays map.
    examples: of a records corpus (data.format='records'), each split's Examples (the tokens
      of each example and the loss mask); None for a text corpus.
    """

    tokenizer: Tokenizer
    train: np.ndarray
    val: np.ndarray
    meta: dict[str, Any]
    directory: Path
    examples: dict[str, Examples] | None = None

    @property
    def records(self) -> bool:
        return self.examples is not None

    @property
    def bytes_per_token(self) -> dict[str, float]:
        """UTF-8 bytes of each split's text / its token count (NaN for an empty split):
        the factor that turns a loss per token into one per byte (`bits_per_byte`)."""
        if self.records:  # the loss counts completions only: their bytes per token
            return {split: counts["completion_bytes"] / counts["completion_tokens"] if counts["completion_tokens"]
                    else math.nan for split, counts in self.meta["splits"].items()}
        return {split: counts["bytes"] / counts["tokens"] if counts["tokens"] else math.nan
                for split, counts in self.meta["splits"].items()}


def prepare(data_cfg: Mapping[str, Any], tokenizer: Tokenizer | None = None) -> Corpus:
    """The corpus `data_cfg` describes (a data section, see jaxgpt.config.DataConfig): reuse
    its cache when the fingerprint matches, else read, split, tokenize and write it.

    The tokens are made by `tokenizer` when one is given (data.tokenizer is then not read),
    else by the tokenizer data.tokenizer names: a kind to train on the train split, or a
    saved tokenizer's file. A cache that fails `open_corpus`'s checks (damaged, or another
    version's) is deleted and built anew, with a warning."""
    settings = DataConfig.from_mapping(data_cfg)
    if tokenizer is None and settings.tokenizer not in tokenizers.KINDS:
        tokenizer = _load_tokenizer_file(settings.tokenizer)
    if tokenizer is None:
        tokenizer_identity: dict[str, Any] = {"kind": settings.tokenizer, "vocab_size": settings.vocab_size}
        tokenizer_name = settings.tokenizer
    else:
        tokenizer_identity = {"sha256": tokenizer_hash(tokenizer)}
        tokenizer_name = f"{tokenizer.kind}{tokenizer.vocab_size}"
    source = resolve_source(settings.source, settings)
    val_source = resolve_source(settings.val_source, settings) if settings.val_source else None
    identity = {}
    if settings.format == "records":  # a text corpus's fingerprint stays as it was
        identity["records"] = records.templates(settings).identity()
    fingerprint = _sha256(json.dumps({
        **identity,
        "format": [CACHE_FORMAT, CACHE_VERSION],
        "source": source.identity,
        "val_source": val_source.identity if val_source else None,
        "val_fraction": None if val_source else settings.val_fraction,
        "max_documents": settings.max_documents,
        "max_bytes": settings.max_bytes,
        "tokenizer": tokenizer_identity,
    }, sort_keys=True).encode())
    name = re.sub(r"[^\w.-]+", "-", f"{source.name}-{tokenizer_name}")[:60]
    directory = settings.cache_path / f"{name}-{fingerprint[:16]}"
    if not (directory / "meta.json").is_file():
        _build(directory, fingerprint, source, val_source, settings, tokenizer)
    try:
        corpus = open_corpus(directory, tokenizer=tokenizer)
    except DamagedCacheError as err:
        warnings.warn(f"the token cache {directory} {err.problem}: deleting it and building it anew", stacklevel=2)
        _discard(directory)
        _build(directory, fingerprint, source, val_source, settings, tokenizer)
        corpus = open_corpus(directory, tokenizer=tokenizer)
    if corpus.meta["fingerprint"] != fingerprint:
        raise DataError(f"the token cache {directory} belongs to other data; delete it")
    return corpus


def _load_tokenizer_file(spec: str) -> Tokenizer:
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {spec!r} does not exist; set data.tokenizer to "
                                f"{', '.join(tokenizers.KINDS)} or a saved tokenizer's path")
    return tokenizers.load(path)


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    """SHA-256 of a tokenizer's contents (its saved form, keys sorted): equal tokenizers have
    equal hashes, whatever file they were read from."""
    return _sha256(json.dumps(tokenizer.to_dict(), sort_keys=True, ensure_ascii=False).encode("utf-8"))


def resolve_source(spec: str, settings: DataConfig) -> Source:
    """The Source a data.source (or data.val_source) string names."""
    if spec == "stdlib":
        return files_source("stdlib", stdlib_files(), settings)
    if spec.startswith("tfds:"):
        return tfds_source(spec, settings)
    if is_generated(spec):
        return files_source(spec.replace(":", "-"), [generated_file(spec, settings.cache_path)], settings)
    return files_source(Path(spec).name or spec, list_files(spec), settings)


def open_corpus(directory: str | os.PathLike, tokenizer: Tokenizer | None = None) -> Corpus:
    """Map a cache directory written by `prepare`, after checking each split against its
    checksum and the tokenizer's vocabulary (a `DamagedCacheError` says which file failed);
    with `tokenizer`, check that it is the one the tokens were made with (e.g. the tokenizer
    saved in a run being resumed)."""
    directory = Path(directory)
    try:
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{directory} is not a prepared corpus (no meta.json); run prepare") \
            from None
    except json.JSONDecodeError:
        raise DamagedCacheError(directory, "is damaged (meta.json is not valid JSON)") from None
    if (meta.get("format"), meta.get("version")) != (CACHE_FORMAT, CACHE_VERSION):
        raise DamagedCacheError(directory, f"is not one this jaxgpt reads (format {meta.get('format')!r} version "
                                           f"{meta.get('version')!r}, not {CACHE_FORMAT!r} version {CACHE_VERSION})")
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
            raise DamagedCacheError(directory, f"is damaged ({path.name} is missing or has the wrong size for "
                                               f"{count} tokens)")
        if count:
            arrays[split] = np.memmap(path, dtype=dtype, mode="r", shape=(count,))
        else:  # mmap cannot map an empty file
            arrays[split] = np.empty(0, dtype)
            arrays[split].flags.writeable = False
        problem = _check_tokens(arrays[split], meta["splits"][split].get("blake2b"), cached.vocab_size)
        if problem:
            raise DamagedCacheError(directory, f"is damaged ({path.name} {problem})")
    examples = None
    if "records" in meta:
        examples = {split: open_examples(directory, split, arrays[split], meta) for split in SPLITS}
        for problem in examples.values():
            if isinstance(problem, str):
                raise DamagedCacheError(directory, f"is damaged ({problem})")
    return Corpus(cached, arrays["train"], arrays["val"], meta, directory, examples)


def _check_tokens(tokens: np.ndarray, checksum: str | None, vocab_size: int) -> str | None:
    """What is wrong with a split's token array, or None: an id outside the vocabulary (the
    first one), or a checksum other than the one recorded. One pass, a chunk at a time."""
    digest = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    step = max(1, CHECK_CHUNK_BYTES // tokens.itemsize)
    for start in range(0, len(tokens), step):
        chunk = tokens[start:start + step]
        digest.update(chunk)
        if chunk.max() >= vocab_size:
            position = int(np.argmax(chunk >= vocab_size))
            return (f"holds id {chunk[position]} at position {start + position}, outside the tokenizer's "
                    f"{vocab_size} ids")
    if checksum is None:
        return "has no checksum in meta.json"
    if digest.hexdigest() != checksum:
        return "does not match its checksum"
    return None


def _build(directory: Path, fingerprint: str, source: Source, val_source: Source | None,
           settings: DataConfig, tokenizer: Tokenizer | None) -> None:
    """Write the cache for `fingerprint` into a private partial directory, then rename it
    into place: a reader sees either nothing or a complete cache."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(directory)
    partial = _partial_path(directory)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        write = _write_records if settings.format == "records" else _write_documents
        tokenizer, dtype, splits, extra = write(partial, source, val_source, settings, tokenizer)
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
            **extra,
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


def _write_documents(partial: Path, source: Source, val_source: Source | None, settings: DataConfig,
                     tokenizer: Tokenizer | None):
    """A text corpus: documents → (tokenizer, dtype, per-split counts, more meta)."""
    reader = DocumentReader(settings.text_field, settings)
    documents = capped(source.documents(reader), settings.max_documents, settings.max_bytes)
    if not documents:
        raise DataError(f"the corpus {settings.source!r} is empty: it holds no text")
    if val_source is None:
        train_docs, val_docs = split_documents(documents, settings.val_fraction)
    else:
        train_docs = documents
        val_docs = capped(val_source.documents(reader), settings.max_documents, settings.max_bytes)
    reader.warn()
    log.info("tokenizing %s: %d training and %d validation documents", source.name, len(train_docs), len(val_docs))
    tokenizer, dtype = _tokenizer_for(partial, train_docs, settings, tokenizer)
    splits = {split: _write_tokens(partial / f"{split}.bin", docs, tokenizer, dtype)
              for split, docs in zip(SPLITS, (train_docs, val_docs), strict=True)}
    return tokenizer, dtype, splits, {}


def _write_records(partial: Path, source: Source, val_source: Source | None, settings: DataConfig,
                   tokenizer: Tokenizer | None):
    """A records corpus: records → examples (jaxgpt.data.records) → tokens, masks and origins."""
    forms = records.templates(settings)
    train_files = _records_files(settings.source, settings)
    val_files = _records_files(settings.val_source, settings) if settings.val_source else []
    train = _read_examples(train_files, forms, settings.max_documents)
    if val_source is None:
        if len(train) < 2:
            raise DataError(f"{settings.source!r} holds {len(train)} record(s): at least 2 are needed, one to hold "
                            "out for validation (or give data.val_source)")
        train, val = split_documents(train, settings.val_fraction)
    else:
        val = _read_examples(val_files, forms, settings.max_documents, first_file=len(train_files))
    files = train_files + val_files
    texts = [prompt + completion for _, turns in train for prompt, completion in turns]
    tokenizer, dtype = _tokenizer_for(partial, texts, settings, tokenizer)
    if tokenizer.eos_id is None:
        raise DataError(f"the {tokenizer.kind} tokenizer has no <|eos|>, which ends every completion: use another")
    splits = {split: write_examples(partial, split, part, tokenizer, dtype)
              for split, part in zip(SPLITS, (train, val), strict=True)}
    log.info("records of %s: %d training and %d validation examples", source.name, len(train), len(val))
    return tokenizer, dtype, splits, {"records": {"files": [str(f) for f in files], "templates": forms.identity()}}


def _records_files(spec: str, settings: DataConfig) -> list[Path]:
    if is_generated(spec):
        return [generated_file(spec, settings.cache_path)]
    if spec == "stdlib" or spec.startswith("tfds:"):
        raise DataError(f"data.format='records' reads .jsonl, .json, .csv or .tsv files, not {spec!r}: set "
                        "data.source to them")
    return list_files(spec)


def _read_examples(files: list[Path], forms: records.Templates, limit: int | None, first_file: int = 0):
    """[(record, its turns)] of the files' records, at most `limit` of them."""
    examples, first = [], None
    for record in records.read_records(files, first_file):
        if limit is not None and len(examples) == limit:
            break
        first = record.fields if first is None else first
        examples.append((record, records.example_turns(record, forms, first)))
    return examples


def _tokenizer_for(partial: Path, texts: Sequence[str], settings: DataConfig, tokenizer: Tokenizer | None):
    """The tokenizer (given, or trained on `texts`), saved in the partial cache, and the dtype of its ids."""
    if tokenizer is None:
        tokenizer = tokenizers.train_tokenizer(settings.tokenizer, texts, settings.vocab_size)
    tokenizer.save(partial / "tokenizer.json")
    return tokenizer, np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32


def _partial_path(directory: Path) -> Path:
    """This process's private directory beside `directory`; a dead process's is removed by
    the next build (`_remove_abandoned_builds`)."""
    return directory.parent / f".{directory.name}.{socket.gethostname()}.{os.getpid()}.partial"


def _discard(directory: Path) -> None:
    """Delete a published cache: renamed out of the way first (atomically, so no reader sees
    half a cache), then removed. Readers that mapped its files keep reading them."""
    doomed = _partial_path(directory)
    shutil.rmtree(doomed, ignore_errors=True)
    try:
        directory.rename(doomed)
    except FileNotFoundError:
        return  # another process discarded it first
    shutil.rmtree(doomed, ignore_errors=True)


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
                  dtype: type) -> dict[str, Any]:
    """Write the documents' ids with <|eos|> between documents; return the split's counts and
    the checksum of the file."""
    eos = np.array([tokenizer.eos_id], dtype).tobytes()
    digest = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    tokens = text_bytes = 0
    with open(path, "wb") as file:
        for i, document in enumerate(documents):
            ids = np.asarray(tokenizer.encode(document), np.int64)
            if len(ids) and not 0 <= ids.min() <= ids.max() < tokenizer.vocab_size:
                bad = ids.min() if ids.min() < 0 else ids.max()
                raise DataError(f"the {tokenizer.kind} tokenizer gave id {bad}, outside its {tokenizer.vocab_size} "
                                f"ids, for document {i + 1} of {path.name}; the tokenizer is inconsistent: "
                                "train it anew or use another")
            written = (eos if i else b"") + ids.astype(dtype).tobytes()
            file.write(written)
            digest.update(written)
            tokens += len(ids) + (1 if i else 0)
            text_bytes += len(document.encode("utf-8"))
    return {"tokens": tokens, "bytes": text_bytes, "documents": len(documents), "blake2b": digest.hexdigest()}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()

