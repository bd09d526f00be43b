"""How the byte-level BPE learns its merges: the training text's pieces counted (by a PieceTally,
so that worker processes can count documents apart, then cut their distinct pieces into shares
and join each share in one process), then merges learned from the counted pieces.

The merge loop lays every distinct piece's bytes side by side in flat arrays, as linked lists:
each position knows the next and the previous live position of its piece, the count of its
piece, and the id of the pair that starts there. Each pair keeps the positions where it was made
(in one log; a position that no longer holds it says so by its pair id). A merge visits only the
positions of its pair and their neighbours, so it costs the number of places where the pair
occurs, not the length of the pieces that hold it: one long piece with no spaces costs what the
same letters cut by spaces cost. Its work is whole-array operations, not a Python step per pair:
the counts of the pairs it ends fall by their ids at once, and the pairs it makes are grouped by
radix sorts and enter the heap as one record.
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

    def result(self, parts: int = 1) -> list[Words]:
        """The pieces counted, cut into `parts` shares (`Words.shares`). The tally gives its result
        once: it lets its counts go as they become words, so that they are never held twice."""
        counts, self.counts = self.counts, Counter()
        words = Words.of(counts)
        del counts
        return words.shares(parts)

    def joined(self, shares: Sequence[Words]) -> Words:
        """Shares of the same part from several tallies, added up."""
        return Words.joined(shares)


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
            text, lengths = _utf8_joined(words)
        else:
            text, lengths = b"".join(words), np.fromiter(map(len, words), np.int64, len(words))
        kept = lengths > 0
        return cls(text, lengths[kept], np.fromiter(counts.values(), np.int64, len(words))[kept])

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

    @classmethod
    def concatenated(cls, parts: Sequence[Words]) -> Words:
        """The words of `parts` that hold no word in common (e.g. shares joined apart), side by side."""
        if len(parts) == 1:
            return parts[0]
        return cls(b"".join(part.text for part in parts), np.concatenate([part.lengths for part in parts]),
                   np.concatenate([part.counts for part in parts]))

    def shares(self, parts: int) -> list[Words]:
        """The words cut into `parts`: a word's share is the sum of its bytes mod `parts`, so that
        the same word falls in the same share in every process."""
        if parts == 1:
            return [self]
        text = np.frombuffer(self.text, np.uint8)
        starts = np.cumsum(self.lengths) - self.lengths
        share = np.add.reduceat(text, starts, dtype=np.int64) % parts if len(self) else np.zeros(0, np.int64)
        in_share = np.repeat(share.astype(np.uint16 if parts <= 1 << 16 else np.int64), self.lengths)  # one per byte
        return [Words(text[in_share == k].tobytes(), self.lengths[share == k], self.counts[share == k])
                for k in range(parts)]

    def words(self) -> list[bytes]:
        return [self.text[start:end] for start, end in itertools.pairwise([0, *np.cumsum(self.lengths).tolist()])]

    def __len__(self) -> int:
        return len(self.lengths)


def _utf8_joined(texts: list[str]) -> tuple[bytes, np.ndarray]:
    """The UTF-8 of the texts one after the other, and the bytes of each (no bytes object per text)."""
    joined = "".join(texts)
    try:
        text = joined.encode("utf-8")
    except UnicodeEncodeError:
        for piece in texts:
            _utf8(piece)  # says which character cannot be encoded
        raise
    if len(text) == len(joined):  # ASCII: a byte per character
        return text, np.fromiter(map(len, texts), np.int64, len(texts))
    return text, np.fromiter((len(piece) if piece.isascii() else len(piece.encode("utf-8")) for piece in texts),
                             np.int64, len(texts))


def learn_merges(words: Words, max_tokens: int) -> tuple[list[bytes], list[tuple[int, int]]]:
    """Byte-pair merges of the words, weighted by their counts, until `max_tokens` tokens.

    Returns the tokens (id → bytes; ids 0..255 are the bytes) and the merges as id pairs. Each
    step fuses the pair with the highest count, the smallest (left id, right id) on a tie; within
    a word, occurrences are fused left to right ("aaa" with (a, a) gives "aa a").
    Pair counts are kept up to date around each merge, and the best pair comes from a lazy
    max-heap whose entries may overstate a count: an entry is trusted only if it matches the
    current count, and pushed again with the current count otherwise. The pairs that one merge
    makes enter the heap one at a time, in the order of their counts, so that most of them (made
    with counts too low ever to be chosen) are never pushed. A pair is a key,
    left · max_tokens + right, so that the order of keys is the order of pairs.
    """
    pieces = _Pieces(words, max_tokens)
    tokens = [bytes([b]) for b in range(256)]
    token_id = {token: i for i, token in enumerate(tokens)}
    merges: list[tuple[int, int]] = []
    heap = pieces.heap
    while len(tokens) < max_tokens and heap:
        negative_count, key, record, place = heapq.heappop(heap)
        pair = pieces.popped(record, place)
        count = int(pieces.count[pair])
        if count != -negative_count:
            if count > 0:
                heapq.heappush(heap, (-count, key, _SINGLE, pair))
            continue
        left, right = divmod(key, max_tokens)
        merged_bytes = tokens[left] + tokens[right]
        # Another merge may already have produced these bytes; one id per byte string.
        new = token_id.get(merged_bytes)
        fresh = new is None
        if fresh:
            new = token_id[merged_bytes] = len(tokens)
            tokens.append(merged_bytes)
        merges.append((left, right))
        pieces.fuse(pair, left, right, new, fresh)
    return tokens, merges


_SINGLE = -1  # a heap entry that stands for one pair: (-count, key, _SINGLE, the pair's id)


class _Pieces:
    """The words' symbols side by side, and their pairs.

    Positions: `symbol[i]` (-1 once fused into the one before it), `after[i]` and `before[i]` the
    next and previous live positions of the same word (-1: none), `weight[i]` the count of the word
    that holds position i, `pair_of[i]` the id of the pair that starts at i (-1: none).

    Pairs, by id (in the order they were first made): `key`, `count` (now), and where the positions
    where it was made lie in `log` (`start`..`end`, and `extra` spans for a pair made again by a
    token that two merges produced); a position still holds the pair when `pair_of` says so.

    The heap: the pairs made by one merge form a record, sorted by (-count, key) when they were
    made; the heap holds the first entry of a record not yet reached (the others cannot come
    before it: a pair's count only falls after it is made), and single pairs pushed again."""

    def __init__(self, words: Words, max_tokens: int):
        paired = words.lengths > 1  # a word of one byte holds no pair
        lengths = words.lengths[paired]
        ends = np.cumsum(lengths)
        size = int(ends[-1]) if len(ends) else 0
        self.index = np.int32 if size < 2**31 else np.int64
        # 32-bit symbols and weights where they fit: a merge's work is mostly reading these at scattered places
        self.symbol = np.frombuffer(words.text, np.uint8)[np.repeat(paired, words.lengths)].astype(np.int32)
        self.max_tokens = max_tokens
        self.after = np.arange(1, size + 1, dtype=self.index)
        self.after[ends - 1] = -1
        self.before = np.arange(-1, size - 1, dtype=self.index)
        self.before[ends - lengths] = -1
        counts = words.counts[paired]
        self.weight = np.repeat(counts.astype(np.int32) if counts.max(initial=0) < 2**31 else counts, lengths)
        self.pair_of = np.full(size, -1, self.index)
        self.pairs, self.logged = 0, 0
        self.key, self.count = np.zeros(0, np.int64), np.zeros(0, np.int64)
        self.start, self.end, self.log = np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, self.index)
        self.extra: dict[int, list[tuple[int, int]]] = {}
        self.id_of: dict[int, int] | None = None  # key → id, made when a token is made by a second merge
        self.records: list[tuple[list[int], list[int], list[int]]] = []
        self.heap: list[tuple[int, int, int, int]] = []
        self._first_pairs()

    def _first_pairs(self) -> None:
        """The pairs of two bytes: counted by their 16-bit codes, their positions put in order by a
        radix sort, so that nothing of the size of the text is sorted by comparison or scattered."""
        starts = np.flatnonzero(self.after >= 0).astype(self.index)
        codes = (self.symbol[starts] << 8 | self.symbol[starts + 1]).astype(np.uint16)
        occurrences = np.bincount(codes, minlength=1 << 16)
        present = np.flatnonzero(occurrences)
        weights = np.bincount(codes, weights=self.weight[starts], minlength=1 << 16)  # exact below 2⁵³
        rank = np.zeros(1 << 16, self.index)
        rank[present] = np.arange(len(present))
        bounds = np.cumsum(occurrences[present]) - occurrences[present]
        ids = self._record((present >> 8) * self.max_tokens + (present & 255), weights[present].astype(np.int64),
                           bounds, starts[np.argsort(codes, kind="stable")])
        if len(ids):
            self.pair_of[starts] = rank[codes] + ids[0]

    def popped(self, record: int, place: int) -> int:
        """The pair of a heap entry just popped; the record's next entry goes on the heap."""
        if record == _SINGLE:
            return place
        ids, counts, keys = self.records[record]
        if place + 1 < len(ids):
            heapq.heappush(self.heap, (-counts[place + 1], keys[place + 1], record, place + 1))
        return ids[place]

    def fuse(self, pair: int, left: int, right: int, new: int, fresh: bool) -> None:
        """Fuse `pair` (left, right) into `new` wherever it occurs, its neighbours' pairs lost and
        the pairs with `new` made (`fresh`: no merge produced `new` before, so none of them exists)."""
        at, to = self._occurrences(pair, left, right)
        around, beyond = self.before.take(at), self.after.take(to)
        # Each occurrence changes the pair on its left (unless it is the right part of the occurrence
        # before, which that one changes) and the pair on its right.
        on_left, on_right = around >= 0, beyond >= 0
        on_left[1:] &= around[1:] != to[:-1]
        weight = self.weight.take(at)
        weights = np.concatenate([weight[on_left], weight[on_right]], dtype=np.int64)  # ufunc.at's fast path
        around = around[on_left]
        np.subtract.at(self.count, np.concatenate([self.pair_of.take(around), self.pair_of.take(to[on_right])]),
                       weights)
        self.count[pair] = 0
        self.symbol.put(at, new)
        self.symbol.put(to, -1)
        self.pair_of.put(to, -1)
        self.pair_of.put(at, -1)  # until the pair on its right is made
        self.after.put(at, beyond)
        beyond, ends = beyond[on_right], at[on_right]
        self.before.put(beyond, ends)
        # The pairs made: (X, new) on the left of each occurrence, (new, Y) on its right.
        other = np.concatenate([self.symbol.take(around), self.symbol.take(beyond)]).astype(np.int64)
        on_its_right = np.arange(len(other)) >= len(around)
        on_its_right |= other == new  # (new, new) made on either side: one pair
        keys = np.where(on_its_right, new * self.max_tokens + other, other * self.max_tokens + new)
        if self.max_tokens <= 1 << 16:  # grouped by two radix sorts, not one comparison sort
            order = np.argsort(other.astype(np.uint16), kind="stable")
            order = order[np.argsort(on_its_right[order], kind="stable")]
        else:
            order = np.argsort(keys, kind="stable")
        (self._made if fresh else self._made_again)(keys, np.concatenate([around, ends]), weights, order)

    def _occurrences(self, pair: int, left: int, right: int) -> tuple[np.ndarray, np.ndarray]:
        """(at, to): the positions of the pair's live occurrences, left and right, the ones a
        left-to-right fusing takes (of a run "a a a" of the pair (a, a), the first and third)."""
        at = self.log[self.start[pair]:self.end[pair]]
        spans = self.extra.pop(pair, None)
        if spans:  # made by two merges: a position may be logged twice
            at = np.unique(np.concatenate([at, *(self.log[a:b] for a, b in spans)]))
        elif left == right and len(at) > 1 and not (at[1:] > at[:-1]).all():  # made on both sides of `new`
            at = np.sort(at)
        at = at[self.pair_of.take(at) == pair]
        to = self.after.take(at)
        if left == right and len(at) > 1:  # an occurrence that starts where the one before ends
            chained = np.concatenate([[False], at[1:] == to[:-1]])
            place = np.arange(len(at))
            run_start = np.maximum.accumulate(np.where(chained, 0, place))
            taken = (place - run_start) % 2 == 0
            at, to = at[taken], to[taken]
        return at, to

    def _made(self, keys: np.ndarray, positions: np.ndarray, weights: np.ndarray, order: np.ndarray) -> None:
        """Pairs made for the first time: `keys[i]` at `positions[i]`, weighing `weights[i]`, `order`
        putting equal keys side by side; one record of them goes on the heap."""
        if not len(keys):
            return
        keys, positions = keys.take(order), positions.take(order)
        starts = np.empty(len(keys), bool)
        starts[0] = True
        np.not_equal(keys[1:], keys[:-1], out=starts[1:])
        bounds = np.flatnonzero(starts)
        counts, keys = np.add.reduceat(weights.take(order), bounds, dtype=np.int64), keys.take(bounds)
        first = self._record(keys, counts, bounds, positions)[0]
        self.pair_of.put(positions, np.cumsum(starts, dtype=self.index) + (first - 1))  # each position's pair

    def _record(self, keys: np.ndarray, counts: np.ndarray, bounds: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """New pairs `keys` with `counts`, made at `positions` (each pair's from its bound on): their
        ids, and their record on the heap."""
        ids = self._new_pairs(keys, counts, bounds, positions)
        if len(ids):
            rank = np.lexsort((keys, -counts))
            record = ids.take(rank).tolist(), counts.take(rank).tolist(), keys.take(rank).tolist()
            self.records.append(record)
            heapq.heappush(self.heap, (-record[1][0], record[2][0], len(self.records) - 1, 0))
        return ids

    def _made_again(self, keys: np.ndarray, positions: np.ndarray, weights: np.ndarray, order: np.ndarray) -> None:
        """Pairs made by a token that an earlier merge produced too: some of them exist already."""
        keys, positions, weights = keys[order], positions[order], weights[order]
        bounds = _bounds(keys)
        first = self._logged(positions)
        if self.id_of is None:  # the first time: built here, then kept
            self.id_of = dict(zip(self.key[:self.pairs].tolist(), range(self.pairs), strict=True))
        for key, (a, b) in zip(keys[bounds].tolist(), itertools.pairwise([*bounds.tolist(), len(keys)]), strict=True):
            pair = self.id_of.get(key)
            if pair is None:
                pair = int(self._new_pairs(keys[a:a + 1], np.zeros(1, np.int64), np.zeros(1, np.int64),
                                           positions[a:b], log=False)[0])
                self.start[pair], self.end[pair] = first + a, first + b
            else:
                self.extra.setdefault(pair, []).append((first + a, first + b))
            self.count[pair] += int(weights[a:b].sum(dtype=np.int64))
            self.pair_of[positions[a:b]] = pair
            heapq.heappush(self.heap, (-int(self.count[pair]), key, _SINGLE, pair))

    def _new_pairs(self, keys: np.ndarray, counts: np.ndarray, bounds: np.ndarray, positions: np.ndarray,
                   log: bool = True) -> np.ndarray:
        """Ids for new pairs `keys` with `counts`, made at `positions` (each pair's from its bound on)."""
        first, n = self.pairs, len(keys)
        if first + n > len(self.key):
            grown = max(2 * len(self.key), first + n, 1024)
            self.key, self.count, self.start, self.end = (_grown(column, first, grown) for column in
                                                          (self.key, self.count, self.start, self.end))
        self.pairs += n
        ids = np.arange(first, first + n)
        self.key[first:first + n], self.count[first:first + n] = keys, counts
        if self.id_of is not None:
            self.id_of.update(zip(keys.tolist(), ids.tolist(), strict=True))
        if log:
            logged = self._logged(positions)
            self.start[first:first + n] = logged + bounds
            self.end[first:first + n] = logged + np.append(bounds[1:], len(positions))
        return ids

    def _logged(self, positions: np.ndarray) -> int:
        """Append `positions` to the log; where they start in it."""
        first = self.logged
        if first + len(positions) > len(self.log):
            self.log = _grown(self.log, first, max(2 * len(self.log), first + len(positions)))
        self.log[first:first + len(positions)] = positions
        self.logged += len(positions)
        return first


def _grown(column: np.ndarray, used: int, size: int) -> np.ndarray:
    """`column` in an array of `size` elements, its first `used` kept."""
    grown = np.empty(size, column.dtype)
    grown[:used] = column[:used]
    return grown


def _bounds(keys: np.ndarray) -> np.ndarray:
    """Where each run of equal `keys` (sorted) starts."""
    if not len(keys):
        return np.zeros(0, np.int64)
    starts = np.empty(len(keys), bool)
    starts[0] = True
    np.not_equal(keys[1:], keys[:-1], out=starts[1:])
    return np.flatnonzero(starts)


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
