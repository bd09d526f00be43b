"""The token cache: a corpus read, split, tokenized and written once, then memory-mapped.

`prepare` splits the documents into train and validation, trains the tokenizer on a sample of
the train split (or uses the one given), and writes, in `<cache_dir>/<name>-<fingerprint>/`:
the token ids (uint16 when the vocabulary fits, else uint32), `tokenizer.json` and
`meta.json`. A text corpus is streamed (jaxgpt.data.stream): documents are split as they
pass (jaxgpt.data.split), encoded by `data.workers` processes, and written as shards
`train-00000.bin …` and `val-00000.bin …` of at most `data.shard_tokens` ids, with one
`<|eos|>` between consecutive documents of a split and none at either end; meta.json indexes
them (file, tokens, checksum) and `Corpus.train`/`val` read them as one array. A records
corpus is read in memory and written as `train.bin`/`val.bin` with its masks
(jaxgpt.data.examples). The fingerprint hashes the source's identity (each kind gives its
own: local files' paths, sizes and modification times; a TFDS dataset's name, split and
preparation; …), the tokenizer (and, for one trained here, its sample's size) and every
setting that changes the tokens, so a matching cache is reused and any change makes a new one.

A build happens in the hidden directory `.<name>-<fingerprint>.partial`, renamed into place
when complete, so nothing half-written is ever read as a cache. The builder holds an
exclusive lock on the file `.lock` in it (jaxgpt.lock: the kernel's flock, released however
the process ends): a second process preparing the same corpus waits for the first and then
uses its cache; a build stopped in any way (Ctrl-C, kill -9, a full disk) is resumed by the
next one from its last finished shard (jaxgpt.data.stream), or published as it is when it had
written its meta.json, the last file of a build.

Integrity: meta.json records each file's BLAKE2b-128 checksum (`b2sum -l 128 FILE` prints
the same), and every id is checked to lie within the tokenizer's vocabulary when the cache
is written and each time it is opened (one read of each file, about a second per GB). A
cache that fails either check, or that a version of jaxgpt that this one cannot read wrote,
is damaged: `open_corpus` refuses it, and `prepare` rebuilds the damaged shards of a text
cache alone (jaxgpt.data.repair), or else warns, deletes it and builds it anew.
`open_corpus` still reads the single-file caches of version 2.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt import tokenizers
from jaxgpt.data import records
from jaxgpt.data.encode import UNGUARDED, WORKER_ENV
from jaxgpt.data.examples import Examples, open_examples, write_examples
from jaxgpt.data.repair import rebuild_damaged
from jaxgpt.data.shards import ShardedTokens, check_tokens, concatenated
from jaxgpt.data.sources import Source, record_files, resolve
from jaxgpt.data.split import split_documents
from jaxgpt.data.stream import PROGRESS_FILE, Progress, ids_dtype, trained_tokenizer, write_text
from jaxgpt.data_config import DataConfig
from jaxgpt.errors import DataError
from jaxgpt.files import write_atomically
from jaxgpt.lock import LOCK_FILE, FileLock, describe
from jaxgpt.tokenizers import Tokenizer

log = logging.getLogger(__name__)

CACHE_FORMAT = "jaxgpt-tokens"
CACHE_VERSION = 3  # 2: meta.json records each split's checksum; 3: text splits in shards, streamed
READABLE_VERSIONS = (2, 3)
SPLITS = ("train", "val")


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
    train, val: the token ids of each split, read-only and 1-D: the np.memmap of its file
      when it has one (an empty split is an empty array), else a `ShardedTokens` that reads
      its shards as one array (len, indices, slices and index arrays, which may cross from
      one shard into the next, as a training window may). Documents are separated by
      `tokenizer.eos_id`, so a new document follows each <|eos|>.
    meta: the contents of meta.json (fingerprint; per split the token, byte and document
      counts and its shards, each with its tokens and checksum; the tokenizer's sample; …).
    directory: the cache directory the arrays map.
    examples: of a records corpus (data.format='records'), each split's Examples (the tokens
      of each example and the loss mask); None for a text corpus.
    """

    tokenizer: Tokenizer
    train: np.ndarray | ShardedTokens
    val: np.ndarray | ShardedTokens
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


def prepare(data_cfg: Mapping[str, Any], tokenizer: Tokenizer | None = None,
            on_progress: Progress | None = None) -> Corpus:
    """The corpus `data_cfg` describes (a data section, see jaxgpt.config.DataConfig): reuse
    its cache when the fingerprint matches, else read, split, tokenize and write it (or
    finish writing it, after a build that was stopped).

    The tokens are made by `tokenizer` when one is given (data.tokenizer is then not read),
    else by the tokenizer data.tokenizer names: a kind to train on the train split's sample,
    or a saved tokenizer's file. `on_progress(documents, bytes)` is called as a text corpus's
    documents are written. A cache that fails `open_corpus`'s checks (damaged, or another
    version's) has its damaged shards rebuilt, or else is deleted and built anew, with a
    warning either way."""
    if os.environ.get(WORKER_ENV):  # an encoding worker importing an unguarded script: its parent says why
        raise DataError(UNGUARDED)
    settings = DataConfig.from_mapping(data_cfg)
    if tokenizer is None and settings.tokenizer not in tokenizers.KINDS:
        tokenizer = _load_tokenizer_file(settings.tokenizer)
    source = resolve(settings.source, settings)
    val_source = resolve(settings.val_source, settings) if settings.val_source else None
    directory, fingerprint = _cache_directory(settings, source, val_source, tokenizer)
    build = (directory, fingerprint, source, val_source, settings, tokenizer, on_progress)
    if not (directory / "meta.json").is_file():
        _build(*build)
    try:
        corpus = open_corpus(directory, tokenizer=tokenizer)
    except DamagedCacheError as err:
        corpus = _repaired(directory, settings, source, val_source, tokenizer)
        if corpus is None:
            warnings.warn(f"the token cache {directory} {err.problem}: deleting it and building it anew",
                          stacklevel=2)
            _discard(directory)
            _build(*build)
            corpus = open_corpus(directory, tokenizer=tokenizer)
    if corpus.meta["fingerprint"] != fingerprint:
        raise DataError(f"the token cache {directory} belongs to other data; delete it")
    return corpus


def _cache_directory(settings: DataConfig, source: Source, val_source: Source | None,
                     tokenizer: Tokenizer | None) -> tuple[Path, str]:
    """(the directory of the cache of these settings, its fingerprint)."""
    fingerprint = _fingerprint(settings, source, val_source, tokenizer)
    tokenizer_name = settings.tokenizer if tokenizer is None else f"{tokenizer.kind}{tokenizer.vocab_size}"
    name = re.sub(r"[^\w.-]+", "-", f"{source.name}-{tokenizer_name}")[:60]
    return settings.cache_path / f"{name}-{fingerprint[:16]}", fingerprint


def known_tokenizer(data_cfg: Mapping[str, Any]) -> Tokenizer | None:
    """The tokenizer `prepare(data_cfg)` makes the tokens with, where it exists without reading
    the data: the tokenizer file data.tokenizer names, or the tokenizer of the token cache
    written already (None otherwise). Nothing is read but the sources' identities and files."""
    settings = DataConfig.from_mapping(data_cfg)
    if settings.tokenizer not in tokenizers.KINDS:
        return _load_tokenizer_file(settings.tokenizer)
    tokenizer = None
    source = resolve(settings.source, settings)
    val_source = resolve(settings.val_source, settings) if settings.val_source else None
    directory, _ = _cache_directory(settings, source, val_source, tokenizer)
    if not (directory / "meta.json").is_file() or not (directory / "tokenizer.json").is_file():
        return None
    return tokenizers.load(directory / "tokenizer.json")


def _repaired(directory: Path, settings: DataConfig, source: Source, val_source: Source | None,
              tokenizer: Tokenizer | None) -> Corpus | None:
    """The cache with its damaged shards rebuilt (jaxgpt.data.repair), holding its build lock;
    None when it cannot be mended so."""
    if settings.format != "text":
        return None
    partial = _build_directory(directory)
    with FileLock(partial / LOCK_FILE, on_wait=lambda holder: _waiting(partial, holder)):
        try:
            try:
                return open_corpus(directory, tokenizer=tokenizer)  # mended while this process waited
            except DataError:
                pass
            if not rebuild_damaged(directory, settings, source, val_source):
                return None
            try:
                return open_corpus(directory, tokenizer=tokenizer)
            except DamagedCacheError:
                return None
        finally:
            shutil.rmtree(partial, ignore_errors=True)


def _fingerprint(settings: DataConfig, source: Source, val_source: Source | None, tokenizer: Tokenizer | None) -> str:
    """SHA-256 of everything that decides the tokens (not of what only lays them out: workers,
    shard_tokens, encode_batch_bytes)."""
    if tokenizer is None:
        tokenizer_identity: dict[str, Any] = {"kind": settings.tokenizer, "vocab_size": settings.vocab_size}
        if settings.format == "text":  # records train on every record
            tokenizer_identity["sample_bytes"] = settings.tokenizer_sample_bytes
    else:
        tokenizer_identity = {"sha256": tokenizer_hash(tokenizer)}
    identity = {}
    if settings.format == "records":
        identity["records"] = records.templates(settings.records).identity()
    return _sha256(json.dumps({
        **identity,
        "format": [CACHE_FORMAT, CACHE_VERSION],
        "source": source.identity,
        "val_source": val_source.identity if val_source else None,
        "val_fraction": None if val_source else settings.val_fraction,
        "max_documents": settings.max_documents,
        "max_bytes": settings.max_bytes,
        "tokenizer": tokenizer_identity,
    }, sort_keys=True).encode())


def _load_tokenizer_file(spec: str) -> Tokenizer:
    """A saved tokenizer's file, or a directory holding GPT-2's vocab.json + merges.txt."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        return tokenizers.BPETokenizer.from_gpt2(path / "vocab.json", path / "merges.txt")
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {spec!r} does not exist; set data.tokenizer to "
                                f"{', '.join(tokenizers.KINDS)}, a saved tokenizer's path or a directory "
                                "holding GPT-2's vocab.json + merges.txt")
    return tokenizers.load(path)


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    """SHA-256 of a tokenizer's contents (its saved form, keys sorted): equal tokenizers have
    equal hashes, whatever file they were read from."""
    return _sha256(json.dumps(tokenizer.to_dict(), sort_keys=True, ensure_ascii=False).encode("utf-8"))


def open_corpus(directory: str | os.PathLike, tokenizer: Tokenizer | None = None) -> Corpus:
    """Map a cache directory written by `prepare` (this version's, or a single-file cache of
    version 2), after checking each token file against its checksum and the tokenizer's
    vocabulary (a `DamagedCacheError` says which file failed); with `tokenizer`, check that
    it is the one the tokens were made with (e.g. the tokenizer saved in a run being resumed)."""
    directory = Path(directory)
    try:
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{directory} is not a prepared corpus (no meta.json); run prepare") \
            from None
    except json.JSONDecodeError:
        raise DamagedCacheError(directory, "is damaged (meta.json is not valid JSON)") from None
    if meta.get("format") != CACHE_FORMAT or meta.get("version") not in READABLE_VERSIONS:
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
    arrays = {split: _open_split(directory, split, meta["splits"][split], dtype, cached.vocab_size)
              for split in SPLITS}
    examples = None
    if "records" in meta:
        examples = {split: open_examples(directory, split, arrays[split], meta) for split in SPLITS}
        for problem in examples.values():
            if isinstance(problem, str):
                raise DamagedCacheError(directory, f"is damaged ({problem})")
    return Corpus(cached, arrays["train"], arrays["val"], meta, directory, examples)


def _open_split(directory: Path, split: str, counts: dict[str, Any], dtype: np.dtype,
                vocab_size: int) -> np.ndarray | ShardedTokens:
    """A split's tokens, each of its files checked: its shards, or its one file `{split}.bin`."""
    files = counts.get("shards", [{"file": f"{split}.bin", "tokens": counts["tokens"],
                                   "blake2b": counts.get("blake2b")}])
    if sum(file["tokens"] for file in files) != counts["tokens"]:
        raise DamagedCacheError(directory, f"is damaged (the {split} shards do not add up to {counts['tokens']} "
                                           "tokens)")
    parts = []
    for file in files:
        path, count = directory / file["file"], file["tokens"]
        if not path.is_file() or path.stat().st_size != count * dtype.itemsize:
            raise DamagedCacheError(directory, f"is damaged ({path.name} is missing or has the wrong size for "
                                               f"{count} tokens)")
        problem = check_tokens(path, count, dtype, file["blake2b"], vocab_size)
        if problem:
            raise DamagedCacheError(directory, f"is damaged ({path.name} {problem})")
        parts.append(np.memmap(path, dtype=dtype, mode="r", shape=(count,)) if count else np.empty(0, dtype))
    if len(parts) == 1 and not len(parts[0]):
        parts = []  # mmap cannot map an empty file
    return concatenated(parts, dtype)


def _build(directory: Path, fingerprint: str, source: Source, val_source: Source | None,
           settings: DataConfig, tokenizer: Tokenizer | None, on_progress: Progress | None) -> None:
    """Write the cache for `fingerprint` in its build directory, holding its lock, then rename
    it into place: a reader sees either nothing or a complete cache. A stopped build of the
    same fingerprint is resumed (text) or started again (records); one stopped after it wrote
    its meta.json is published as it is."""
    partial = _build_directory(directory)
    with FileLock(partial / LOCK_FILE, on_wait=lambda holder: _waiting(partial, holder)):
        if (directory / "meta.json").is_file():  # another process built it while this one waited
            shutil.rmtree(partial, ignore_errors=True)
            return
        if not _written(partial, fingerprint):
            try:
                _write(partial, fingerprint, source, val_source, settings, tokenizer, on_progress)
            except DataError:  # bad input fails again: nothing to resume (Ctrl-C, kill -9, a full disk: resumed)
                shutil.rmtree(partial, ignore_errors=True)
                raise
            except OSError as error:
                raise _stopped_by(error, partial) from None
        (partial / PROGRESS_FILE).unlink(missing_ok=True)
        if directory.exists():
            shutil.rmtree(directory)  # never published by a build (no meta.json): only a stray copy
        partial.rename(directory)
        (directory / LOCK_FILE).unlink()


def _build_directory(directory: Path) -> Path:
    """The hidden directory where `directory` is built (its parent made, or a one-line error)."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DataError(f"cannot make the token cache's directory {directory.parent} ({error.strerror}: "
                        f"{error.filename}); set data.cache_dir to a directory this user can write") from None
    return directory.parent / f".{directory.name}.partial"


def _written(partial: Path, fingerprint: str) -> bool:
    """Whether `partial` holds a whole cache of `fingerprint` (a build stopped as it published)."""
    if not (partial / "meta.json").is_file():
        return False
    try:
        return open_corpus(partial).meta["fingerprint"] == fingerprint
    except (DataError, OSError, KeyError):
        return False


def _write(partial: Path, fingerprint: str, source: Source, val_source: Source | None, settings: DataConfig,
           tokenizer: Tokenizer | None, on_progress: Progress | None) -> None:
    """Tokenize the corpus into `partial`, and last its meta.json."""
    if settings.format == "records":
        tokenizer, dtype, splits, extra = _write_records(_emptied(partial), source, val_source, settings, tokenizer)
    else:
        tokenizer, dtype, splits, extra = write_text(partial, source, val_source, settings, tokenizer, fingerprint,
                                                     on_progress)
    meta = {
        "format": CACHE_FORMAT,
        "version": CACHE_VERSION,
        "fingerprint": fingerprint,
        "source": settings.source,
        **({"source_description": source.description} if source.description else {}),
        "val_source": settings.val_source,
        "val_fraction": settings.val_fraction,
        "max_documents": settings.max_documents,
        "max_bytes": settings.max_bytes,
        "dtype": np.dtype(dtype).name,
        "tokenizer": {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
                      "sha256": _sha256((partial / "tokenizer.json").read_bytes())},
        "splits": splits,
        **extra,
    }
    write_atomically(partial / "meta.json", json.dumps(meta, indent=1) + "\n")


def _stopped_by(error: OSError, partial: Path) -> Exception:
    """An error that stopped a build, in one line: a full disk names where, and that a rerun resumes."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return error
    free = shutil.disk_usage(partial).free if partial.is_dir() else 0
    return DataError(f"no space left on the device that holds {partial} ({error.strerror}; {free / 1e6:,.0f} MB "
                     "free): free some space and run the same command again, and the preparation resumes where it "
                     "stopped (or set data.cache_dir to another disk, to prepare it there from the start)")


def _waiting(partial: Path, holder: dict) -> None:
    """Tell the user why this process waits: another one holds the build directory's lock."""
    who = f" ({describe(holder)})" if holder else ""
    print(f"waiting for another process{who} that is preparing the same data in {partial}", file=sys.stderr)


def _emptied(partial: Path) -> Path:
    """The build directory with everything but its lock removed (what a stopped build left)."""
    for entry in partial.iterdir():
        if entry.name != LOCK_FILE:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    return partial


def _write_records(partial: Path, source: Source, val_source: Source | None, settings: DataConfig,
                   tokenizer: Tokenizer | None):
    """A records corpus: records → examples (jaxgpt.data.records) → tokens, masks and origins."""
    forms = records.templates(settings.records)
    train_files = record_files(settings.source, settings)
    val_files = record_files(settings.val_source, settings) if settings.val_source else []
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
        tokenizer = trained_tokenizer(settings, texts)
    tokenizer.save(partial / "tokenizer.json")
    return tokenizer, ids_dtype(tokenizer)


def _discard(directory: Path) -> None:
    """Delete a published cache: renamed out of the way first (atomically, so no reader sees
    half a cache), then removed. Readers that mapped its files keep reading them."""
    doomed = directory.parent / f".{directory.name}.{socket.gethostname()}.{os.getpid()}.discarded"
    shutil.rmtree(doomed, ignore_errors=True)
    try:
        directory.rename(doomed)
    except FileNotFoundError:
        return  # another process discarded it first
    shutil.rmtree(doomed, ignore_errors=True)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
