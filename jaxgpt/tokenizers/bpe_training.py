"""How the byte-level BPE learns its merges: the training text's pieces counted (by a PieceTally,
so that worker processes can count documents apart and each send back its distinct pieces
once), then merges learned from the counted pieces.

The merge loop lays every distinct piece's bytes side by side in flat arrays, as linked lists:
each position knows the next and the previous live position of its piece, and the count of its
piece. An index maps each adjacent pair to the positions where it may start (some of them stale,
checked when read). A merge visits only the positions of its pair and their neighbours, so it
costs the number of places where the pair occurs, not the length of the pieces that hold it: one
long piece with no spaces costs what the same letters cut by spaces cost.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from jaxgpt.tokenizers.base import _utf8
from jaxgpt.tokenizers.pretokenize import compile_split_pattern, split


class PieceTally:
    """How often each piece (cut by `pattern`) occurs in the documents added (a Tally)."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.counts: Counter[str] = Counter()

    def add(self, document: str) -> None:
        self.counts.update(split(compile_split_pattern(self.pattern), document))

    def result(self) -> Words:
        return Words.of(self.counts)


@dataclasses.dataclass(frozen=True)
class Words:
    """Words side by side: their bytes one after the other, and the length and count of each."""

    text: bytes
    lengths: np.ndarray
    counts: np.ndarray

    @classmethod
    def of(cls, counts: Mapping[str, int] | Mapping[bytes, int]) -> Words:
        """The words of `counts` (strings as UTF-8), the empty one left out."""
        words = list(counts)
        if words and isinstance(words[0], str):
            words = _utf8_all(words)
        lengths = np.fromiter(map(len, words), np.int64, len(words))
        kept = lengths > 0
        return cls(b"".join(words), lengths[kept], np.fromiter(counts.values(), np.int64, len(words))[kept])

    @classmethod
    def joined(cls, parts: Sequence[Words]) -> Words:
        """The words of `parts` (e.g. the tallies of several processes), each once: a word that
        several hold has the sum of their counts."""
        if len(parts) == 1:
            return parts[0]
        total = dict(zip(parts[0].words(), parts[0].counts.tolist(), strict=True))
        for part in parts[1:]:
            for word, count in zip(part.words(), part.counts.tolist(), strict=True):
                total[word] = total.get(word, 0) + count
        return cls.of(total)

    def words(self) -> list[bytes]:
        return [self.text[start:end] for start, end in itertools.pairwise([0, *np.cumsum(self.lengths).tolist()])]

    def __len__(self) -> int:
        return len(self.lengths)


def _utf8_all(texts: list[str]) -> list[bytes]:
    try:
        return [text.encode("utf-8") for text in texts]
    except UnicodeEncodeError:
        return [_utf8(text) for text in texts]  # says which character cannot be encoded


def learn_merges(words: Words, max_tokens: int) -> tuple[list[bytes], list[tuple[int, int]]]:
    """Byte-pair merges of the words, weighted by their counts, until `max_tokens` tokens.

    Returns the tokens (id → bytes; ids 0..255 are the bytes) and the merges as id pairs. Each
    step fuses the pair with the highest count, the smallest (left id, right id) on a tie; within
    a word, occurrences are fused left to right ("aaa" with (a, a) gives "aa a"). Pair counts are
    kept up to date around each merge, and the best pair comes from a lazy max-heap whose entries
    may overstate a count: an entry is trusted only if it matches the current count, and pushed
    again with the current count otherwise. A pair is a key, left · max_tokens + right, so that
    the order of keys is the order of pairs.
    """
    pieces = _Pieces(words, max_tokens)
    counts, where = pieces.pairs()
    heap = [(-count, key) for key, count in counts.items()]
    heapq.heapify(heap)
    tokens = [bytes([b]) for b in range(256)]
    token_id = {token: i for i, token in enumerate(tokens)}
    merges: list[tuple[int, int]] = []
    while len(tokens) < max_tokens and heap:
        negative_count, key = heapq.heappop(heap)
        count = counts.get(key, 0)
        if count != -negative_count:
            if count > 0:
                heapq.heappush(heap, (-count, key))
            continue
        left, right = divmod(key, max_tokens)
        merged_bytes = tokens[left] + tokens[right]
        # Another merge may already have produced these bytes; one id per byte string.
        new = token_id.get(merged_bytes)
        if new is None:
            new = token_id[merged_bytes] = len(tokens)
            tokens.append(merged_bytes)
        merges.append((left, right))
        # Only pairs with the new token can have grown; all others only shrank, so their heap
        # entries still overstate (never understate) their counts.
        for grown in pieces.fuse(key, new, counts, where):
            heapq.heappush(heap, (-counts[grown], grown))
    return tokens, merges


class _Pieces:
    """The words' symbols side by side: `symbol[i]` (-1 once fused into the one before it),
    `after[i]` and `before[i]` the next and previous live positions of the same word (-1: none),
    `weight[i]` the count of the word that holds position i."""

    def __init__(self, words: Words, max_tokens: int):
        paired = words.lengths > 1  # a word of one byte holds no pair
        self.symbol = np.frombuffer(words.text, np.uint8)[np.repeat(paired, words.lengths)].astype(np.int64)
        lengths = words.lengths[paired]
        ends = np.cumsum(lengths)
        size = len(self.symbol)
        index = np.int32 if size < 2**31 else np.int64
        self.max_tokens = max_tokens
        self.after = np.arange(1, size + 1, dtype=index)
        self.after[ends - 1] = -1
        self.before = np.arange(-1, size - 1, dtype=index)
        self.before[ends - lengths] = -1
        self.weight = np.repeat(words.counts[paired], lengths)

    def pairs(self) -> tuple[dict[int, int], dict[int, list[np.ndarray]]]:
        """Each pair's count, and the positions where it starts (in increasing order)."""
        starts = np.flatnonzero(self.after >= 0).astype(self.after.dtype)
        byte_pairs = (self.symbol[starts] << 8 | self.symbol[starts + 1]).astype(np.uint16)
        order = np.argsort(byte_pairs, kind="stable")  # a radix sort, and positions stay in order
        byte_pairs, starts = byte_pairs[order], starts[order]
        bounds = _bounds(byte_pairs)
        keys = ((byte_pairs[bounds] >> 8).astype(np.int64) * self.max_tokens + (byte_pairs[bounds] & 255)).tolist()
        sums = np.add.reduceat(self.weight[starts], bounds).tolist() if keys else []
        return (dict(zip(keys, sums, strict=True)),
                {key: [chunk] for key, chunk in zip(keys, _split(starts, bounds), strict=True)})

    def fuse(self, key: int, new: int, counts: dict[int, int], where: dict[int, list[np.ndarray]]) -> list[int]:
        """Fuse pair `key` into `new` wherever it occurs, updating `counts` and `where`; returns
        the pairs whose counts grew (the pairs with `new`; the pair `key` itself is left with none)."""
        size = self.max_tokens
        left, right = divmod(key, size)
        at, to = self._occurrences(where.pop(key), left, right)
        around, beyond = self.before[at], self.after[to]
        # Each occurrence changes the pair on its left (unless it is the right part of the occurrence
        # before, which that one changes) and the pair on its right.
        on_left, on_right = around >= 0, beyond >= 0
        on_left[1:] &= around[1:] != to[:-1]
        weight = self.weight[at]
        weights = np.concatenate([weight[on_left], weight[on_right]])
        around = around[on_left]
        left_symbol = self.symbol[around]
        old_right = self.symbol[beyond[on_right]]
        self.symbol[at], self.symbol[to] = new, -1
        self.after[at] = beyond
        beyond, ends = beyond[on_right], at[on_right]
        self.before[beyond] = ends
        for pair, lost in zip(*_sums(np.concatenate([left_symbol * size + left, right * size + old_right]), weights),
                              strict=True):
            count = counts[pair] - lost
            if count:
                counts[pair] = count
            else:
                del counts[pair]
        counts.pop(key, None)
        made, gained, chunks = _grouped(np.concatenate([left_symbol * size + new, new * size + self.symbol[beyond]]),
                                        weights, np.concatenate([around, ends]))
        for pair, count, chunk in zip(made, gained, chunks, strict=True):
            counts[pair] = counts.get(pair, 0) + count
            where.setdefault(pair, []).append(chunk)
        return made

    def _occurrences(self, chunks: list[np.ndarray], left: int, right: int) -> tuple[np.ndarray, np.ndarray]:
        """(at, to): the positions of the pair's live occurrences, left and right, the ones a
        left-to-right fusing takes (of a run "a a a" of the pair (a, a), the first and third)."""
        at = chunks[0]
        if len(chunks) > 1 or (len(at) > 1 and not (at[1:] > at[:-1]).all()):
            at = _distinct(np.concatenate(chunks))
        to = self.after[at]
        live = (self.symbol[at] == left) & (to >= 0) & (self.symbol[to] == right)
        at, to = at[live], to[live]
        if left == right and len(at) > 1:  # an occurrence that starts where the one before ends
            chained = np.concatenate([[False], at[1:] == to[:-1]])
            place = np.arange(len(at))
            run_start = np.maximum.accumulate(np.where(chained, 0, place))
            taken = (place - run_start) % 2 == 0
            at, to = at[taken], to[taken]
        return at, to


def _sums(keys: np.ndarray, weights: np.ndarray) -> tuple[list[int], list[int]]:
    """The distinct keys, and the sum of the weights of each."""
    order = np.argsort(keys)
    keys = keys[order]
    bounds = _bounds(keys)
    return keys[bounds].tolist(), np.add.reduceat(weights[order], bounds).tolist() if len(keys) else []


def _grouped(keys: np.ndarray, weights: np.ndarray, positions: np.ndarray
             ) -> tuple[list[int], list[int], list[np.ndarray]]:
    """The distinct keys, the sum of the weights of each, and the positions of each (in their order)."""
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    bounds = _bounds(keys)
    sums = np.add.reduceat(weights[order], bounds).tolist() if len(keys) else []
    return keys[bounds].tolist(), sums, _split(positions[order], bounds)


def _bounds(keys: np.ndarray) -> np.ndarray:
    """Where each run of equal `keys` (sorted) starts."""
    if not len(keys):
        return np.zeros(0, np.int64)
    starts = np.empty(len(keys), bool)
    starts[0] = True
    np.not_equal(keys[1:], keys[:-1], out=starts[1:])
    return np.flatnonzero(starts)


def _distinct(positions: np.ndarray) -> np.ndarray:
    """The distinct `positions`, in increasing order."""
    positions = np.sort(positions)
    return positions[_bounds(positions)]


def _split(positions: np.ndarray, bounds: np.ndarray) -> list[np.ndarray]:
    """`positions` cut where each run starts (`bounds`, the first 0): one piece per run."""
    return [positions[start:end] for start, end in itertools.pairwise([*bounds.tolist(), len(positions)])]


def merge_pair(word: list[int], left: int, right: int, new: int) -> list[int] | None:
    """`word` with each (left, right), scanned left to right, fused into `new`; None if absent."""
    out: list[int] = []
    i, n = 0, len(word)
    while i < n:
        if word[i] == left and i + 1 < n and word[i + 1] == right:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out if len(out) < n else None
