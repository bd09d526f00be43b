"""Token shards: a split written as `{split}-NNNNN.bin` files of at most `shard_tokens` ids
each, and read back as one array.

A shard is written as `{name}.partial` and renamed when full (or when the split ends), so a
file with the final name is complete; its token count, BLAKE2b-128 checksum and `start` (where
it starts in the stream of documents, as the caller says: jaxgpt.data.stream records the
document and how many of its tokens the shard before holds) go into the index. The split is
the shards concatenated: a document may begin in one shard and end in the next, and so may a
training window (`ShardedTokens` hides the seams).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

CHECKSUM_BYTES = 16  # BLAKE2b-128: accidental damage goes unnoticed with probability 2⁻¹²⁸
READ_CHUNK_BYTES = 1 << 22
CHECK_CHUNK_BYTES = 1 << 20  # a token file is checked 1 MiB at a time, which stays in cache


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def prefix_checksum(path: Path, size: int) -> str | None:
    """BLAKE2b-128 of the first `size` bytes of a file; None when it is shorter or missing."""
    digest = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    try:
        with open(path, "rb") as file:
            remaining = size
            while remaining:
                chunk = file.read(min(READ_CHUNK_BYTES, remaining))
                if not chunk:
                    return None
                digest.update(chunk)
                remaining -= len(chunk)
    except FileNotFoundError:
        return None
    return digest.hexdigest()


def check_tokens(path: Path, count: int, dtype: np.dtype, checksum: str | None, vocab_size: int) -> str | None:
    """What is wrong with a token file, or None: an id outside the vocabulary (the first one),
    or a checksum other than the one recorded. One pass, a chunk at a time, read rather than
    mapped (so the check leaves nothing of the file in this process's memory)."""
    digest = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    step = max(1, CHECK_CHUNK_BYTES // dtype.itemsize)
    with open(path, "rb") as file:
        for start in range(0, count, step):
            chunk = np.fromfile(file, dtype, count=min(step, count - start))
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


class ShardWriter:
    """Appends a split's tokens to its shards. `write` fills the open shard at most to its end;
    the caller then `finish`es a `full` one, so it knows where each shard ended. `start` is
    what the caller says of where the open shard starts, kept in its index entry."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int,
                 finished: list[dict[str, Any]] | None = None):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, np.dtype(dtype), shard_tokens
        self.finished: list[dict[str, Any]] = list(finished or [])
        self.open_tokens = 0
        self.start: Any = None
        self._digest = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
        self._file = None

    @property
    def path(self) -> Path:
        """The final path of the open shard."""
        return self.directory / shard_name(self.split, len(self.finished))

    @property
    def tokens(self) -> int:
        return sum(shard["tokens"] for shard in self.finished) + self.open_tokens

    @property
    def full(self) -> bool:
        return self.open_tokens == self.shard_tokens

    def write(self, tokens: np.ndarray) -> int:
        """Append the first of `tokens` that fit in the open shard; return how many."""
        head = np.ascontiguousarray(tokens[:self.shard_tokens - self.open_tokens], self.dtype)
        self._opened().write(head.tobytes())
        self._digest.update(head)
        self.open_tokens += len(head)
        return len(head)

    def finish(self) -> None:
        """Close the open shard (if it holds anything), publish it and add it to the index."""
        if not self.open_tokens:
            return
        file = self._opened()  # a resumed shard that got no tokens since holds its kept ones
        file.flush()
        os.fsync(file.fileno())
        file.close()
        self._file = None
        path = self.path
        os.replace(path.with_name(path.name + ".partial"), path)
        self.finished.append({"file": path.name, "tokens": self.open_tokens, "blake2b": self._digest.hexdigest(),
                              "start": self.start})
        self.open_tokens, self.start = 0, None
        self._digest = hashlib.blake2b(digest_size=CHECKSUM_BYTES)

    def _opened(self):
        """The open shard's file: a resumed shard goes on after its kept tokens; a new one replaces
        any stale file."""
        if self._file is None:
            self._file = open(self.path.with_name(self.path.name + ".partial"), "ab" if self.open_tokens else "wb")
        return self._file

    def state(self) -> dict[str, Any]:
        """What a resumed preparation needs: the finished shards and the open one's prefix."""
        if self._file is not None:
            self._file.flush()
        return {"finished": [dict(shard) for shard in self.finished], "open_tokens": self.open_tokens,
                "open_blake2b": self._digest.hexdigest(), "open_start": self.start}

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @classmethod
    def resume(cls, directory: Path, split: str, dtype: np.dtype, shard_tokens: int,
               state: dict[str, Any], intact: dict[str, bool]) -> ShardWriter | None:
        """A writer at `state` (from `state()`), or None when a shard it counts on is missing
        or damaged (`intact` remembers each finished shard's check, for older states). The
        open shard is cut back to the tokens `state` had written."""
        itemsize = np.dtype(dtype).itemsize
        for shard in state["finished"]:
            path, size = directory / shard["file"], shard["tokens"] * itemsize
            if shard["file"] not in intact:
                intact[shard["file"]] = path.is_file() and path.stat().st_size == size and \
                    prefix_checksum(path, size) == shard["blake2b"]
            if not intact[shard["file"]]:
                return None
        writer = cls(directory, split, dtype, shard_tokens, state["finished"])
        partial = writer.path.with_name(writer.path.name + ".partial")
        size = state["open_tokens"] * itemsize
        if size and prefix_checksum(partial, size) != state["open_blake2b"]:
            if prefix_checksum(writer.path, size) != state["open_blake2b"]:
                return None
            os.replace(writer.path, partial)  # finished after `state`: written again from there
        if not size:
            partial.unlink(missing_ok=True)  # written after `state`
            return writer
        with open(partial, "r+b") as file:
            file.truncate(size)
            writer._digest.update(file.read())
        writer.open_tokens, writer.start = state["open_tokens"], state.get("open_start")
        return writer


class ShardedTokens:
    """Several 1-D token arrays read as their concatenation: len, an index, a slice (step 1
    or not) and an integer array of any shape, each of which may cross from one part into
    the next, and np.asarray (which copies everything). Read-only."""

    ndim = 1

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.ends = np.cumsum([len(part) for part in parts])
        self.starts = self.ends - [len(part) for part in parts]
        self.dtype = parts[0].dtype

    def __len__(self) -> int:
        return int(self.ends[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            return self._range(start, max(start, stop))
        positions = np.asarray(index)
        if positions.dtype.kind not in "iu":
            raise TypeError(f"ShardedTokens indices must be integers or slices, not {positions.dtype}")
        positions = np.where(positions < 0, positions + len(self), positions)
        if np.any((positions < 0) | (positions >= len(self))):
            raise IndexError(f"index out of range for {len(self)} tokens")
        part = np.searchsorted(self.ends, positions, side="right")
        out = np.empty(positions.shape, self.dtype)
        for p in np.unique(part):
            chosen = part == p
            out[chosen] = self.parts[p][positions[chosen] - self.starts[p]]
        return out[()] if out.ndim == 0 else out

    def _range(self, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(self.ends, start, side="right"))
        pieces = []
        for p in range(first, len(self.parts)):
            if self.starts[p] >= stop:
                break
            pieces.append(self.parts[p][max(start - self.starts[p], 0):stop - self.starts[p]])
        return np.concatenate(pieces) if pieces else np.empty(0, self.dtype)

    def __array__(self, dtype=None, copy=None):
        array = np.concatenate(self.parts)
        return array if dtype is None else array.astype(dtype)


def concatenated(parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray | ShardedTokens:
    """One array for a split's parts: itself when there is one, an empty read-only array
    when there is none, else their `ShardedTokens`."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        empty = np.empty(0, dtype)
        empty.flags.writeable = False
        return empty
    return ShardedTokens(parts)
