"""Which documents a corpus reads (`capped`), the train and validation splits of a text
corpus decided as its documents stream past, and the sample a tokenizer learns from; the
splits of a records corpus, held in memory (`split_documents`).

Document i (counted from 0, after data.max_documents / max_bytes and with empty documents
dropped) is held out when blake2b-64(i) / 2⁶⁴ < val_fraction (the 8-byte digest of i as 8
little-endian bytes, read as a little-endian integer): a rule of the index alone, so no list
of the corpus is needed and every pass over the source (the tokenizer's sample, the encoding,
a resumed preparation) splits it the same way. Two cases
need a look one document ahead: a corpus of a single document holds out its tail (the last
val_fraction of its characters), and when no document was held out by the last one, the last
one is, so that a small corpus still has a validation split.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

SPLITS = ("train", "val")
SAMPLE_RULE = "the first train documents up to data.tokenizer_sample_bytes UTF-8 bytes, the last one cut"


def held_out(index: int, val_fraction: float) -> bool:
    """Whether document `index` belongs to the validation split (before the last-document rule)."""
    digest = hashlib.blake2b(index.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


def assign_splits(documents: Iterable[str], val_fraction: float) -> Iterator[tuple[str, str]]:
    """(split, document) for each document, in order (see the module docstring)."""
    stream = iter(documents)
    first = next(stream, None)
    if first is None:
        return
    pending, index, any_val = first, 0, False
    for document in stream:
        split = "val" if held_out(index, val_fraction) else "train"
        any_val |= split == "val"
        yield split, pending
        pending, index = document, index + 1
    if index == 0:  # a single document: its tail is the validation split
        cut = len(pending) - round(len(pending) * val_fraction)
        yield "train", pending[:cut]
        if cut < len(pending):
            yield "val", pending[cut:]
        return
    last_is_val = val_fraction > 0 and (not any_val or held_out(index, val_fraction))
    yield ("val" if last_is_val else "train"), pending


class TrainSample:
    """The tokenizer's sample: the first train documents of `items` up to `max_bytes` UTF-8 bytes,
    the one that crosses the limit cut on a character, read as it is iterated (so that its
    documents can be counted while the rest is read), and again from memory on a second pass;
    with `keep=False`, read once: each document is let go once it has been given (its place in
    `documents` holds None), for a tokenizer that learns in one pass, so that the sample is not
    held as a whole.

    Once read to its end: `documents`, their `bytes`, and `read`: every item read when the stream
    ended before the sample was full, having read at most 2 · max_bytes characters (a corpus that
    need not be read again), else None. Reading stops once the sample is full. With `spill` (a
    file's path), the items are kept in that file rather than in memory, and `read` reads them
    back from it (`discard_read` removes it)."""

    def __init__(self, items: Iterable[tuple[str, str]], max_bytes: int, keep: bool = True,
                 spill: Path | None = None):
        self._items, self.max_bytes, self.keep = iter(items), max_bytes, keep
        self.documents: list[str | None] = []
        self.bytes, self._read_chars, self._ended, self._let_go = 0, 0, False, False
        self.read: list[tuple[str, str]] | SpilledItems | None = [] if spill is None else SpilledItems(spill)

    def __iter__(self) -> Iterator[str]:
        if self._let_go:
            raise RuntimeError("a tokenizer sample read with keep=False is read once: its documents are gone")
        index = 0
        while index < len(self.documents) or self._read_one():
            document = self.documents[index]
            if not self.keep:
                self.documents[index], self._let_go = None, True
            yield document
            index += 1

    def empty(self) -> bool:
        """Whether the sample has no document (reading its first one, which is not given yet)."""
        return not (self.documents or self._read_one())

    def finish(self) -> TrainSample:
        """Read to the sample's end (what the iterations have not read yet)."""
        while self._read_one():
            pass
        return self

    def discard_read(self) -> None:
        """Let the items read go (their file removed, with `spill`)."""
        if isinstance(self.read, SpilledItems):
            self.read.discard()
        self.read = None

    def _read_one(self) -> bool:
        """Read items until the sample has one more document; False once it is complete."""
        for split, document in [] if self._ended else self._items:
            if self.read is not None:
                self.read.append((split, document))
                self._read_chars += len(document)
                if self._read_chars > 2 * self.max_bytes:
                    self.discard_read()
            if split != "train":
                continue
            size = utf8_size(document)
            if self.bytes + size >= self.max_bytes:
                self._ended = True
                self.discard_read()
                last = document.encode("utf-8")[:self.max_bytes - self.bytes].decode("utf-8", "ignore")
                self.bytes += utf8_size(last)
                if last:
                    self.documents.append(last)
                return bool(last)
            self.documents.append(document)
            self.bytes += size
            return True
        self._ended = True
        if isinstance(self.read, SpilledItems):
            self.read.close()
        return False


class SpilledItems:
    """(split, document) items written to a file as they come and read back in order: each is the
    split's index (1 byte), the document's UTF-8 length (8 bytes, little-endian) and its UTF-8."""

    def __init__(self, path: Path):
        self.path, self.count = path, 0
        self._file: BinaryIO | None = open(path, "wb")  # closed by close() or discard()

    def append(self, item: tuple[str, str]) -> None:
        split, document = item
        data = document.encode("utf-8", "surrogatepass")
        self._file.write(SPLITS.index(split).to_bytes(1, "little") + len(data).to_bytes(8, "little"))
        self._file.write(data)
        self.count += 1

    def close(self) -> None:
        """The writing done: what was appended can be read."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def discard(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[tuple[str, str]]:
        self.close()
        with open(self.path, "rb") as file:
            for _ in range(self.count):
                head = file.read(9)
                yield SPLITS[head[0]], file.read(int.from_bytes(head[1:], "little")).decode("utf-8", "surrogatepass")


def utf8_size(text: str) -> int:
    """The UTF-8 bytes of `text` (its length when it is ASCII, which a str knows without a look)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


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
