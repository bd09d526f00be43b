"""A text corpus streamed into token shards, resumably.

The documents flow from the source through the split rule (jaxgpt.data.split) and the
encoding workers (jaxgpt.data.encode) into each split's shards (jaxgpt.data.shards), one
<|eos|> between consecutive documents of a split. Nothing holds the corpus: memory is the
batches in flight and, when a tokenizer is trained (in a first pass that reads only as far as
the sample needs), what it learns from. The same worker processes count the sample's pieces
as it is read (for a kind that learns from counts, which reads its sample once and holds its
counts, not its text) and then encode the corpus. What the first pass reads waits in a file of
the build directory (read.tmp), not in memory, in case it turns out to be the whole corpus,
which is then encoded from there rather than read from its source again.

Resuming: after each finished shard, `progress.json` in the build directory records a
checkpoint — the document the stream had reached and how many of its tokens were written,
each split's counts, finished shards (file, tokens, checksum) and the open shard's length
and checksum. A preparation that was stopped (Ctrl-C, kill -9, a power cut) starts again
from the newest checkpoint whose shards are intact: finished shards are checked and kept,
never written again; the open shard is cut back to its recorded length; a damaged or
truncated shard sends the build back to a checkpoint before it. The documents before the
checkpoint are read again (the split rule needs their order) but not encoded. A shard whose
writer gets no more tokens after a resume (the split's last) is finished from what it kept.
progress.json stays until the cache's meta.json is written (jaxgpt.data.cache), so a build
stopped at any moment resumes. Each shard's index entry records where it starts (document,
tokens of it before), so that a damaged shard can be made again alone (jaxgpt.data.repair).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from itertools import chain, islice
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt import tokenizers
from jaxgpt.data.encode import Workers, default_workers
from jaxgpt.data.shards import ShardWriter
from jaxgpt.data.sources import DocumentReader, Source
from jaxgpt.data.split import SAMPLE_RULE, SPLITS, TrainSample, assign_splits, capped
from jaxgpt.data_config import DataConfig
from jaxgpt.errors import DataError
from jaxgpt.tokenizers import Tokenizer

log = logging.getLogger(__name__)

PROGRESS_FILE = "progress.json"
READ_FILE = "read.tmp"  # what the tokenizer's sample read, on disk until it proves not to be the whole corpus
Progress = Callable[[int, int], None]  # (documents, UTF-8 bytes) written since the last call


def ids_dtype(tokenizer: Tokenizer) -> np.dtype:
    return np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)


def write_text(partial: Path, source: Source, val_source: Source | None, settings: DataConfig,
               tokenizer: Tokenizer | None, fingerprint: str, on_progress: Progress | None = None):
    """Write (or finish writing) a text corpus into `partial`: tokenizer.json and the shards.
    Returns (tokenizer, dtype, per-split counts and shard index, more meta)."""
    saved = _read_progress(partial, fingerprint)
    try:
        with Workers(settings.workers or default_workers()) as workers:  # one pool counts the sample, then encodes
            tokenizer, sample, first_pass = _tokenizer(partial, saved, source, val_source, settings, tokenizer,
                                                       workers)
            return _write_shards(partial, source, val_source, settings, tokenizer, fingerprint, on_progress, workers,
                                 saved, sample, first_pass)
    finally:
        (partial / READ_FILE).unlink(missing_ok=True)


def _write_shards(partial: Path, source: Source, val_source: Source | None, settings: DataConfig,
                  tokenizer: Tokenizer, fingerprint: str, on_progress: Progress | None, workers: Workers,
                  saved: dict | None, sample: dict | None, first_pass: tuple | None):
    """The corpus encoded by `workers` into shards (resumed from `saved`'s newest intact checkpoint)."""
    dtype = ids_dtype(tokenizer)
    header = {"fingerprint": fingerprint, "tokenizer_sha256": _file_sha256(partial / "tokenizer.json"),
              "dtype": dtype.name, "shard_tokens": settings.shard_tokens, "tokenizer_sample": sample}
    checkpoints = saved["checkpoints"] if saved and saved["header"] == header else []
    build = _Build(partial, header, dtype, settings.shard_tokens, checkpoints)
    if first_pass:  # the tokenizer's sample read the whole corpus: it is not read again
        reader, corpus = first_pass
    else:
        reader = DocumentReader(settings)
        corpus = corpus_items(source, val_source, settings, reader)
    items = islice(corpus, build.item, None)
    log.info("encoding %s from document %d with %d worker(s)", source.name, build.item, workers.count)
    encoded = workers.encoded(items, tokenizer, dtype, batch_chars=settings.encode_batch_bytes)
    try:
        for index, (split, ids, text_bytes, bad) in enumerate(encoded, start=build.item):
            if bad is not None:
                number = build.counts[split]["documents"] + 1
                raise DataError(f"the {tokenizer.kind} tokenizer gave id {bad}, outside its {tokenizer.vocab_size} "
                                f"ids, for document {number} of the {split} split; the tokenizer is inconsistent: "
                                "train it anew or use another")
            build.add(index, split, ids, text_bytes, tokenizer.eos_id)
            if on_progress:
                on_progress(1, text_bytes)
        splits = build.finish()
    finally:
        encoded.close()  # stops the workers now, also when this ends early
        build.close()
    if not any(counts["documents"] for counts in splits.values()):
        raise _empty(settings, reader, held_out=False)
    reader.warn()
    return tokenizer, dtype, splits, {"tokenizer_sample": sample}


def corpus_items(source: Source, val_source: Source | None, settings: DataConfig,
           reader: DocumentReader) -> Iterator[tuple[str, str]]:
    """(split, document) of the corpus, in order."""
    documents = capped(source.documents(reader), settings.max_documents, settings.max_bytes)
    if val_source is None:
        return assign_splits(documents, settings.val_fraction)
    held_out = capped(val_source.documents(reader), settings.max_documents, settings.max_bytes)
    return chain((("train", d) for d in documents), (("val", d) for d in held_out))


def _tokenizer(partial: Path, saved: dict | None, source: Source, val_source: Source | None,
               settings: DataConfig, tokenizer: Tokenizer | None, workers: Workers):
    """(tokenizer, its sample, first pass): the tokenizer (given; the one a stopped build
    saved; or trained on the sample), saved in `partial`; what its sample was (None for a
    given tokenizer); and (reader, every item) when reading the sample read the whole corpus."""
    path = partial / "tokenizer.json"
    if saved and path.is_file() and _file_sha256(path) == saved["header"]["tokenizer_sha256"]:
        previous = tokenizers.load(path)
        if tokenizer is None or tokenizer == previous:
            return previous, saved["header"]["tokenizer_sample"], None
    sample = first_pass = None
    if tokenizer is None:
        reader = DocumentReader(settings)
        once = tokenizers.KINDS[settings.tokenizer].learns_from_counts  # one pass: the sample is never held whole
        texts = TrainSample(corpus_items(source, val_source, settings, reader), settings.tokenizer_sample_bytes,
                            keep=not once, spill=partial / READ_FILE)
        try:
            if texts.empty():
                raise _empty(settings, reader, held_out=texts.read is None or bool(texts.read))
            tokenizer = trained_tokenizer(settings, texts, workers)  # its pieces counted as the sample is read
        except BaseException:
            texts.discard_read()  # its spill file closed and removed, whatever stopped the reading
            raise
        texts.finish()
        log.info("trained the %s tokenizer on %d documents (%d bytes)", settings.tokenizer, len(texts.documents),
                 texts.bytes)
        sample = {"rule": SAMPLE_RULE, "limit": settings.tokenizer_sample_bytes, "bytes": texts.bytes,
                  "documents": len(texts.documents)}
        first_pass = (reader, texts.read) if texts.read is not None else None
    tokenizer.save(path)
    return tokenizer, sample, first_pass


def trained_tokenizer(settings: DataConfig, texts: Iterable[str], workers: Workers | None = None) -> Tokenizer:
    """A tokenizer of the kind data.tokenizer names, trained on `texts` (its pieces counted, for a
    kind that learns from counts, by the encoding `workers`, which then prepare their encoder while
    this process learns; or by workers of its own); a warning says so when it learned fewer ids
    than data.vocab_size asks (all that the text holds)."""
    if workers is None:
        with Workers(settings.workers or default_workers()) as own:
            return _trained(settings, texts, functools.partial(own.counted, batch_chars=settings.encode_batch_bytes))
    return _trained(settings, texts, functools.partial(workers.counted, batch_chars=settings.encode_batch_bytes,
                                                       then=tokenizers.KINDS[settings.tokenizer].prepare_encoding))


def _trained(settings: DataConfig, texts: Iterable[str], count: Callable) -> Tokenizer:
    tokenizer = tokenizers.train_tokenizer(settings.tokenizer, texts, settings.vocab_size, count=count)
    if settings.vocab_size is not None and tokenizer.vocab_size < settings.vocab_size:
        text_bytes = texts.bytes if isinstance(texts, TrainSample) else sum(len(text.encode("utf-8")) for text in texts)
        warnings.warn(f"data.vocab_size={settings.vocab_size:,} is more than the {settings.tokenizer} tokenizer can "
                      f"learn from its {text_bytes:,} bytes of training text: it has {tokenizer.vocab_size:,} ids, "
                      "and the tokens, meta.json and the model use that size", stacklevel=4)
    return tokenizer


def _empty(settings: DataConfig, reader: DocumentReader, held_out: bool) -> DataError:
    """The error for a corpus without text to train on, saying why: the files it skipped, or a
    validation split that took every document."""
    if held_out and settings.val_source is None:
        return DataError(f"the corpus {settings.source!r} holds no text for the train split: every document was held "
                         f"out for validation (data.val_fraction={settings.val_fraction}); lower data.val_fraction")
    skipped = reader.skipped()
    why = f": every file was skipped ({skipped})" if skipped else ""
    return DataError(f"the corpus {settings.source!r} is empty: it holds no text{why}")


class _Build:
    """The writers and counts of both splits, where the stream is, and the checkpoints."""

    def __init__(self, partial: Path, header: dict, dtype: np.dtype, shard_tokens: int, checkpoints: list[dict]):
        self.partial, self.header, self.checkpoints = partial, header, list(checkpoints)
        intact: dict[str, bool] = {}
        for keep in range(len(self.checkpoints), 0, -1):
            checkpoint = self.checkpoints[keep - 1]
            writers = {split: ShardWriter.resume(partial, split, dtype, shard_tokens, checkpoint["writers"][split],
                                                 intact) for split in SPLITS}
            if all(writers.values()):
                self.checkpoints = self.checkpoints[:keep]
                self.writers = writers
                self.item, self.done = checkpoint["item"], checkpoint["done"]
                self.counts = copy.deepcopy(checkpoint["counts"])
                log.info("resuming the build in %s at document %d", partial, self.item)
                return
        for stale in partial.glob("*.bin*"):  # a build of other tokens (another tokenizer) left them
            stale.unlink()
        self.writers = {split: ShardWriter(partial, split, dtype, shard_tokens) for split in SPLITS}
        self.item, self.done, self.checkpoints = 0, 0, []
        self.counts = {split: {"documents": 0, "bytes": 0} for split in SPLITS}
        self._save(0, 0, self.counts)

    def add(self, index: int, split: str, ids: np.ndarray, text_bytes: int, eos_id: int) -> None:
        """Write document `index` (after <|eos|> unless it is its split's first), finishing
        full shards; the part a stopped build had written already (`self.done`) is skipped."""
        counts = self.counts[split]
        before = dict(counts)
        tokens = ids if not counts["documents"] else np.concatenate([np.array([eos_id], ids.dtype), ids])
        counts["documents"] += 1
        counts["bytes"] += text_bytes
        done, self.done = self.done, 0
        writer = self.writers[split]
        while done < len(tokens):
            if not writer.open_tokens:  # a new shard starts `done` tokens (<|eos|> first) into this document
                writer.start = [index, done]
            done += writer.write(tokens[done:])
            if writer.full:
                writer.finish()
                if done == len(tokens):
                    self._save(index + 1, 0, self.counts)
                else:
                    self._save(index, done, {**self.counts, split: before})

    def finish(self) -> dict[str, dict[str, Any]]:
        for writer in self.writers.values():
            writer.finish()
        return {split: {**self.counts[split], "tokens": writer.tokens, "shards": writer.finished}
                for split, writer in self.writers.items()}

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()

    def _save(self, item: int, done: int, counts: dict) -> None:
        """Add a checkpoint and write progress.json (atomically: a new file renamed over it)."""
        self.checkpoints.append({"item": item, "done": done, "counts": copy.deepcopy(counts),
                                 "writers": {split: writer.state() for split, writer in self.writers.items()}})
        path = self.partial / PROGRESS_FILE
        temporary = path.with_name(path.name + ".new")
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump({"header": self.header, "checkpoints": self.checkpoints}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)


def _read_progress(partial: Path, fingerprint: str) -> dict | None:
    try:
        saved = json.loads((partial / PROGRESS_FILE).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return saved if saved.get("header", {}).get("fingerprint") == fingerprint else None


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
