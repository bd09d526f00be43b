"""Unigram language-model tokenizer (SentencePiece's unigram): Viterbi pieces of a pruned vocabulary.

Whitespace, as in SentencePiece: a space becomes "▁" (U+2581), which marks a word start, and
pieces never cross a word start. Text is cut into segments, each a run of spaces (maybe none)
and the characters up to the next space (" world" → "▁world", "  x" → "▁▁x"), or a run of
spaces with nothing after it; a piece is a substring of one segment, so "▁" only ever starts
a piece. Line breaks and tabs are ordinary characters, as in SentencePiece's Metaspace: a piece
may hold one (",\nAnd", ".\n\n"). No space is added in front of the text, so decoding is just
the pieces joined with "▁" turned back into spaces.

Round trip: decode(encode(t)) == t for every text t whose characters were seen in training
(unless vocab_size was too small to hold every character; the rarest ones are then left out).
Every other character becomes one <|unk|>; so does a literal "▁" in the text, which the
tokenizer reserves for spaces.

Model: a piece x has probability p(x); a segmentation x_1 … x_m of a segment has probability
∏ p(x_i), and encoding picks the most probable one (Viterbi). Training:

1. Seed: every single character, and the SEED_FACTOR × (pieces to keep) substrings of
   2..max_piece_length characters of the segments with the highest count × length. Substrings
   are counted for all lengths at once with sorts (each substring of L characters is one of
   L − 1 characters and a character), like SentencePiece's suffix array.
2. EM: the E-step sums over every segmentation of each unique segment (forward-backward over
   its lattice of pieces) for the expected count of each piece; the M-step sets
   log p(x) = log(expected count of x) − log(Σ expected counts). Each step cannot lower the
   likelihood of the training text.
3. Prune: a piece's loss is how much the likelihood would fall if its Viterbi uses were
   re-segmented without it (into its own best segmentation by the other pieces); the pieces
   with the smallest loss go, a quarter at a time, never a single character (so every
   seen character stays encodable). Then EM again, until vocab_size ids are used.

On 1.1 MB of Shakespeare at 4096 ids this gives 4.1 bytes per token, about 2% more than the
`tokenizers` library's UnigramTrainer (bench/bench_tokenizers.py). Two of SentencePiece's
choices are left out because they compressed less here: the Bayesian M-step (digamma of the
counts, dropping pieces expected less than half a time) and pruning to 1.1 × vocab_size before
keeping the most probable; and a seed larger than 8× the vocabulary also compressed less.

Ids: 0 <|bos|>, 1 <|eos|>, 2 <|pad|>, 3 <|unk|>, then the pieces from the most probable down.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxgpt.tokenizers.base import BOS, EOS, PAD, UNK, Tokenizer, _check_vocab_size, _documents, _field

SPACE = "▁"  # U+2581: a space, where it starts a word
_SEGMENT = re.compile(r" *[^ ]+| +")  # covers every character of a text
_PIECE = re.compile(r"▁*[^▁ ]+|▁+")  # a substring of a segment, spaces written as ▁
_ENCODE_CACHE_LIMIT = 1 << 18  # segments; the cache starts over when full
SEED_FACTOR = 8  # seed pieces per piece to keep
EM_ITERATIONS = 2  # per pruning round
SHRINK = 0.75  # a pruning round keeps at least this fraction of the multi-character pieces
_MIN_COUNT = 1e-12  # floor of an expected count, so that log-probabilities stay finite
_Group = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # see _group


class UnigramTokenizer(Tokenizer):
    """Unigram language model over pieces; encoding is the most probable segmentation.

    Args:
      pieces: (piece, log-probability) in id order (ids 4.. after the four specials); spaces
        written as "▁", which may only start a piece.
    """

    kind = "unigram"
    SPECIALS = (BOS, EOS, PAD, UNK)

    def __init__(self, pieces: Iterable[Sequence[Any]]):
        pieces = [tuple(p) if isinstance(p, (list, tuple)) else p for p in pieces]
        for entry in pieces:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
                    and _PIECE.fullmatch(entry[0])):
                raise ValueError(f"{entry!r} is not a (piece, log-probability) pair of a unigram tokenizer (a "
                                 "piece is a run of non-spaces after optional '▁', or a run of '▁' or of line breaks)")
            logp = entry[1]
            if isinstance(logp, bool) or not isinstance(logp, (int, float)) or not math.isfinite(logp):
                raise ValueError(f"the log-probability of piece {entry[0]!r} is {logp!r}, not a finite number")
        names = [piece for piece, _ in pieces]
        if len(set(names)) != len(names):
            raise ValueError("a unigram tokenizer's pieces must be distinct")
        super().__init__({name: i for i, name in enumerate(self.SPECIALS)})
        first = len(self.SPECIALS)
        self._pieces = [(piece, float(logp)) for piece, logp in pieces]
        self._ids = {piece: i for i, piece in enumerate(names, start=first)}
        self._logp = [0.0] * first + [logp for _, logp in self._pieces]
        self._prefixes = {piece[:k] for piece in names for k in range(1, len(piece) + 1)}
        self._text = [*self.SPECIALS, *(piece.replace(SPACE, " ") for piece in names)]
        self._known = {piece.replace(SPACE, " ") for piece in names if len(piece) == 1}
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def train(cls, texts: str | Iterable[str], vocab_size: int | None = None,
              max_piece_length: int = 16) -> UnigramTokenizer:
        """Seed, EM and prune until `vocab_size` ids (4 specials + pieces) are used, or fewer
        if the text has fewer distinct substrings."""
        base = len(cls.SPECIALS) + 1
        if vocab_size is None:
            raise ValueError(f"unigram needs a vocab_size (e.g. 4096; at least {base}: 4 special tokens + 1 piece)")
        _check_vocab_size(vocab_size, base, "4 special tokens + 1 piece")
        if not isinstance(max_piece_length, int) or isinstance(max_piece_length, bool) or max_piece_length < 1:
            raise ValueError(f"max_piece_length must be a positive integer, got {max_piece_length!r}")
        segments: Counter[str] = Counter()
        for document in _documents(texts):
            segments.update(_SEGMENT.findall(document))
        runs: Counter[str] = Counter()
        for segment, count in segments.items():
            for run in _runs(segment, lambda ch: ch != SPACE):
                runs[run] += count
        if not runs:
            raise ValueError("cannot train a unigram tokenizer on empty text")
        pieces, logp = _learn_vocabulary(runs, vocab_size - len(cls.SPECIALS), max_piece_length)
        order = sorted(range(len(pieces)), key=lambda i: (-logp[i], pieces[i]))
        return cls([(pieces[i], float(logp[i])) for i in order])

    @property
    def vocab_size(self) -> int:
        return len(self._text)

    @property
    def pieces(self) -> list[tuple[str, float]]:
        """(piece, log-probability) of the ordinary ids, in id order."""
        return list(self._pieces)

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        cache = self._cache
        for segment in _SEGMENT.findall(text):
            segment_ids = cache.get(segment)
            if segment_ids is None:
                if len(cache) >= _ENCODE_CACHE_LIMIT:
                    cache.clear()
                segment_ids = cache[segment] = self._encode_segment(segment)
            ids += segment_ids
        return ids

    def _encode_segment(self, segment: str) -> tuple[int, ...]:
        """Viterbi pieces of each run of known characters; <|unk|> for each other character."""
        ids: list[int] = []
        start = 0
        for i, ch in enumerate(segment):
            if ch not in self._known:
                if start < i:
                    ids += self._viterbi(segment[start:i].replace(" ", SPACE))
                ids.append(self.unk_id)
                start = i + 1
        if start < len(segment):
            ids += self._viterbi(segment[start:].replace(" ", SPACE))
        return tuple(ids)

    def _viterbi(self, run: str) -> list[int]:
        """The most probable segmentation of `run` (each of whose characters is a piece)."""
        n, ids, logp, prefixes = len(run), self._ids, self._logp, self._prefixes
        best = [0.0] + [-math.inf] * n
        back = [(0, 0)] * (n + 1)  # (start, piece) of the best last piece ending here
        for start in range(n):  # ties: the earliest start, i.e. the longest last piece
            for end in range(start + 1, n + 1):
                candidate = run[start:end]
                if candidate not in prefixes:
                    break  # no longer piece starts this way
                piece = ids.get(candidate)
                if piece is not None and best[start] + logp[piece] > best[end]:
                    best[end] = best[start] + logp[piece]
                    back[end] = (start, piece)
        out = []
        while n > 0:
            n, piece = back[n]
            out.append(piece)
        return out[::-1]

    def _count_unknown_ordinary(self, text: str) -> int:
        return sum(ch not in self._known for ch in text)

    def _decode(self, ids: list[int]) -> str:
        return "".join(map(self._text.__getitem__, ids))

    def _state(self) -> dict[str, Any]:
        return {"pieces": [[piece, logp] for piece, logp in self._pieces]}

    @classmethod
    def _from_state(cls, state: Mapping[str, Any]) -> UnigramTokenizer:
        return cls(_field(state, "pieces", list))


def _runs(segment: str, known: Any) -> list[str]:
    """The runs of `known` characters of a segment, spaces written as ▁."""
    runs, start = [], 0
    for i, ch in enumerate(segment):
        if not known(ch):
            runs.append(segment[start:i])
            start = i + 1
    runs.append(segment[start:])
    return [run.replace(" ", SPACE) for run in runs if run]


# --- training -----------------------------------------------------------------------


def _learn_vocabulary(runs: Mapping[str, int], room: int, max_len: int,
                      trace: list | None = None) -> tuple[list[str], np.ndarray]:
    """`room` pieces (or fewer) for the runs and their counts, with their log-probabilities.

    Every character is kept unless there are more than `room` (then the most frequent);
    `trace`, if given, gets (round, pieces alive, log-likelihood) before each M-step.
    """
    char_count: Counter[str] = Counter()
    for run, count in runs.items():
        for ch in run:
            char_count[ch] += count
    chars = sorted(char_count, key=lambda ch: (-char_count[ch], ch))[:room]
    if len(chars) < len(char_count):
        kept = set(chars)
        resplit: Counter[str] = Counter()
        for run, count in runs.items():
            for part in _runs(run, kept.__contains__):
                resplit[part] += count
        runs = resplit
    seed = _seed(runs, SEED_FACTOR * (room - len(chars)), max_len)
    pieces = chars + list(seed)
    counts = np.array([char_count[ch] for ch in chars] + list(seed.values()), float)
    logp = np.log(counts) - np.log(counts.sum())
    if not seed:
        return pieces, logp
    piece_id = {piece: i for i, piece in enumerate(pieces)}
    corpus = _lattice(list(runs), np.array(list(runs.values()), float), piece_id, max_len)
    alternatives = _lattice(list(seed), np.ones(len(seed)), piece_id, max_len)
    logp, alive = _em_and_prune(corpus, alternatives, logp, len(chars), room - len(chars), trace)
    return [p for p, keep in zip(pieces, alive, strict=True) if keep], logp[alive]


def _seed(runs: Mapping[str, int], n: int, max_len: int) -> dict[str, int]:
    """The `n` substrings of 2..max_len characters with the highest count × length (ties: the
    smaller string), with their counts: occurrences in the runs, overlapping ones included,
    weighted by the runs' counts."""
    strings = list(runs)
    weight = np.repeat(np.array(list(runs.values()), float), [len(s) + 1 for s in strings])
    scored = []  # per length: (length, count of each class, a position of each class)
    for length, window, first in _substring_classes(strings, max_len):
        if length > 1:
            inside = window >= 0
            scored.append((length, np.bincount(window[inside], weights=weight[: len(window)][inside]), first))
    if n <= 0 or not scored:
        return {}
    # The n-th best score overall is the n-th best of the n best of each length.
    best = np.concatenate([np.sort(count)[::-1][:n] * length for length, count, _ in scored])
    cut = np.sort(best)[::-1][min(n, len(best)) - 1]
    text = "\0".join(strings)
    ranked = sorted((-count[c] * length, text[first[c]:first[c] + length], count[c])
                    for length, count, first in scored for c in np.flatnonzero(count * length >= cut))
    return {piece: int(count) for _, piece, count in ranked[:n]}


def _em_and_prune(corpus: _Lattice, alternatives: _Lattice, logp: np.ndarray, n_chars: int, target: int,
                  trace: list | None) -> tuple[np.ndarray, np.ndarray]:
    """EM then pruning, in rounds, until at most `target` multi-character pieces are alive;
    the pieces 0..n_chars-1 are the characters. Returns the log-probabilities and the alive mask."""
    alive = np.ones(len(logp), bool)
    for round_ in itertools.count():
        lattice = corpus.subset(alive[corpus.piece])
        for _ in range(EM_ITERATIONS):
            expected, likelihood = _e_step(lattice, logp)
            if trace is not None:
                trace.append((round_, int(alive.sum()), likelihood))
            logp = _m_step(expected, alive)
        n_multi = int(alive.sum()) - n_chars
        if n_multi <= target:
            break
        loss = _pruning_loss(lattice, alternatives, logp, alive, n_chars)
        multi = np.flatnonzero(alive[n_chars:]) + n_chars
        order = np.lexsort((logp[multi], loss[multi]))  # smallest loss first, then least probable
        alive[multi[order[: n_multi - max(target, int(n_multi * SHRINK))]]] = False
        logp = np.where(alive, logp, -np.inf)
        logp -= np.logaddexp.reduce(logp[alive])
    return logp, alive


def _m_step(expected: np.ndarray, alive: np.ndarray) -> np.ndarray:
    """log p(x) = log(expected count of x) − log(Σ expected counts) over the alive pieces."""
    counts = np.where(alive, np.maximum(expected, _MIN_COUNT), 0.0)
    with np.errstate(divide="ignore"):
        return np.log(counts) - np.log(counts.sum())


def _pruning_loss(corpus: _Lattice, alternatives: _Lattice, logp: np.ndarray, alive: np.ndarray,
                  n_chars: int) -> np.ndarray:
    """For each piece x used F times in the Viterbi segmentations of the corpus (frequencies
    f, total N): F·(log p(x) − Σ_{a ∈ alt(x)} log p'(a)), where alt(x) is the best segmentation
    of x by the other pieces and p'(a) = (f(a) + F) / (N + F·(|alt(x)| − 1)) its probability
    once x's uses are handed to it. −∞ for the pieces that no Viterbi segmentation uses."""
    strings, used = _viterbi_paths(corpus, logp, np.arange(len(corpus.start)))
    freq = np.bincount(used, weights=corpus.weight[strings], minlength=len(logp))
    total = freq.sum()
    owner_of_edge = alternatives.string + n_chars  # string j of `alternatives` is piece n_chars + j
    keep = alive[alternatives.piece] & alive[owner_of_edge] & (alternatives.piece != owner_of_edge)
    multi = np.flatnonzero(alive[n_chars:])
    strings, used = _viterbi_paths(alternatives.subset(keep), logp, multi)
    owner = strings + n_chars
    n_alt = np.bincount(owner, minlength=len(logp))
    with np.errstate(divide="ignore", invalid="ignore"):
        alt_logp = (np.bincount(owner, weights=np.log(freq[used] + freq[owner]), minlength=len(logp))
                    - n_alt * np.log(total + freq * (n_alt - 1)))
        loss = freq * (np.log(freq) - np.log(total) - alt_logp)
    return np.where(freq > 0, loss, -np.inf)


# --- lattices: every piece of every string, swept with NumPy ------------------------


@dataclass
class _Lattice:
    """The pieces found in a set of strings: string s has nodes start[s]..end[s] (one per
    position, end[s] − start[s] = its length) and an edge frm → to for each vocabulary piece
    it holds there. depth: a node's position in its string; weight: each string's count."""

    start: np.ndarray
    end: np.ndarray
    weight: np.ndarray
    depth: np.ndarray
    frm: np.ndarray
    to: np.ndarray
    piece: np.ndarray
    string: np.ndarray

    parent: _Lattice | None = None  # a subset's lattice, whose sorted edges it reuses
    kept: np.ndarray | None = None  # which of the parent's edges the subset keeps

    def subset(self, keep: np.ndarray) -> _Lattice:
        """The same strings with only the edges where `keep` is True."""
        return _Lattice(self.start, self.end, self.weight, self.depth, self.frm[keep], self.to[keep],
                        self.piece[keep], self.string[keep], self, keep)

    @functools.cached_property
    def forward_groups(self) -> list[_Group]:
        if self.parent is not None:
            return self._kept_groups(self.parent.forward_groups, self.to)
        return _sweep_groups(self.to, self.depth)

    @functools.cached_property
    def backward_groups(self) -> list[_Group]:
        if self.parent is not None:
            return self._kept_groups(self.parent.backward_groups, self.frm)
        return _sweep_groups(self.frm, self.depth)[::-1]

    def _kept_groups(self, groups: list[_Group], node: np.ndarray) -> list[_Group]:
        """The parent's groups without the left-out edges (sorted edges stay sorted: no new sort)."""
        renumber = np.cumsum(self.kept) - 1
        kept = (_group(renumber[edges[self.kept[edges]]], node) for edges, *_ in groups)
        return [group for group in kept if len(group[0])]


def _lattice(strings: Sequence[str], weight: np.ndarray, piece_id: Mapping[str, int], max_len: int) -> _Lattice:
    """Every occurrence in `strings` of a piece of `piece_id` of at most max_len characters."""
    names = [piece for piece in piece_id if len(piece) <= max_len]
    lengths = np.array([len(s) for s in strings], np.int64)
    start = np.cumsum(lengths + 1) - (lengths + 1)
    n_nodes = int(lengths.sum()) + len(strings)
    # The pieces are laid out after the strings, so that a piece and its occurrences share a class.
    piece_at = n_nodes + np.concatenate([[0], np.cumsum([len(p) + 1 for p in names])[:-1]]).astype(np.int64)
    piece_len = np.array([len(p) for p in names], np.int64)
    piece_index = np.array([piece_id[p] for p in names], np.int64)
    frm, to, piece = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for length, window, _ in _substring_classes([*strings, *names], max_len):
        mine = piece_len == length
        if not mine.any():
            continue
        table = np.full(int(window.max()) + 1, -1, np.int64)
        table[window[piece_at[mine]]] = piece_index[mine]
        found = np.where(window[:n_nodes] >= 0, table[window[:n_nodes]], -1)
        hits = np.flatnonzero(found >= 0)
        frm.append(hits)
        to.append(hits + length)
        piece.append(found[hits])
    frm_ = np.concatenate(frm)
    depth = np.arange(n_nodes) - np.repeat(start, lengths + 1)
    string = np.repeat(np.arange(len(strings)), lengths + 1)[frm_]
    return _Lattice(start, start + lengths, weight, depth, frm_, np.concatenate(to), np.concatenate(piece), string)


def _substring_classes(strings: Sequence[str], max_len: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """For L = 1..max_len: (L, window, first), where window[i] is the class of the L characters
    from position i of the strings laid end to end, each followed by a separator (equal
    substrings share a class; −1 where they would run past the string's end), and first[c] a
    position of class c. A substring of L characters is one of L − 1 and a character, so each
    length costs one sort."""
    codes = np.frombuffer("\0".join([*strings, ""]).encode("utf-32-le", "surrogatepass"), np.uint32)
    codes = codes.astype(np.int64)
    codes[np.cumsum([len(s) + 1 for s in strings], dtype=np.int64) - 1] = -1  # whatever the text holds
    _, char = np.unique(codes, return_inverse=True)  # char 0 is the separator
    n_chars = int(char.max(initial=0)) + 1
    window = np.where(codes >= 0, char - 1, -1)
    first = np.unique(window, return_index=True)[1][1:]  # [0] is a separator's −1
    for length in range(1, min(max_len, len(codes)) + 1):
        if length > 1:
            inside = (window[:-1] >= 0) & (codes[length - 1:] >= 0)
            keys = window[:-1][inside] * n_chars + char[length - 1:][inside]
            window = np.full(len(inside), -1, np.int64)
            _, first, window[inside] = np.unique(keys, return_index=True, return_inverse=True)
            first = np.flatnonzero(inside)[first]
        yield length, window, first


def _sweep_groups(node: np.ndarray, depth: np.ndarray) -> list[_Group]:
    """The edges grouped by the depth of `node` (their end, or their start), shallowest first."""
    if not len(node):
        return []
    order = np.lexsort((node, depth[node]))
    bounds = np.flatnonzero(np.diff(depth[node[order]])) + 1
    return [_group(edges, node) for edges in np.split(order, bounds)]


def _group(edges: np.ndarray, node: np.ndarray) -> _Group:
    """(edges sorted by node, where each node's edges begin, those nodes, each edge's node as
    an index into them)."""
    nodes = node[edges]
    starts = np.r_[True, nodes[1:] != nodes[:-1]] if len(edges) else np.zeros(0, bool)
    return edges, np.flatnonzero(starts), nodes[starts], np.cumsum(starts) - 1


def _log_sum(scores: np.ndarray, cuts: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """log Σ exp(scores) over each run scores[cuts[k]:cuts[k+1]] (the largest factored out)."""
    top = np.maximum.reduceat(scores, cuts)
    shift = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return shift + np.log(np.add.reduceat(np.exp(scores - shift[owner]), cuts))


def _forward(lattice: _Lattice, logp: np.ndarray, viterbi: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """α(node) = log Σ (or max, for Viterbi) over the paths from its string's start of the sum
    of their pieces' log-probabilities; with Viterbi, also the best edge into each node."""
    alpha = np.full(len(lattice.depth), -np.inf)
    alpha[lattice.start] = 0.0
    back = np.full(len(lattice.depth), -1)
    for edges, cuts, nodes, owner in lattice.forward_groups:
        scores = alpha[lattice.frm[edges]] + logp[lattice.piece[edges]]
        if viterbi:
            best = np.maximum.reduceat(scores, cuts)
            winners = np.flatnonzero(scores == best[owner])
            first = np.r_[True, owner[winners][1:] != owner[winners][:-1]]
            back[nodes] = edges[winners[first]]
            alpha[nodes] = best
        else:
            alpha[nodes] = _log_sum(scores, cuts, owner)
    return alpha, back


def _backward(lattice: _Lattice, logp: np.ndarray) -> np.ndarray:
    """β(node) = log Σ over the paths from the node to its string's end."""
    beta = np.full(len(lattice.depth), -np.inf)
    beta[lattice.end] = 0.0
    for edges, cuts, nodes, owner in lattice.backward_groups:
        beta[nodes] = _log_sum(logp[lattice.piece[edges]] + beta[lattice.to[edges]], cuts, owner)
    return beta


def _e_step(lattice: _Lattice, logp: np.ndarray) -> tuple[np.ndarray, float]:
    """Expected count of each piece over all segmentations (forward-backward), and the
    log-likelihood Σ_s weight_s · log p(string s) of the strings."""
    alpha, _ = _forward(lattice, logp)
    beta = _backward(lattice, logp)
    z = alpha[lattice.end]
    s = lattice.string
    posterior = np.exp(alpha[lattice.frm] + logp[lattice.piece] + beta[lattice.to] - z[s]) * lattice.weight[s]
    return np.bincount(lattice.piece, posterior, minlength=len(logp)), float(lattice.weight @ z)


def _viterbi_paths(lattice: _Lattice, logp: np.ndarray, strings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pieces of the best segmentation of each of `strings`, as (string, piece) arrays."""
    _, back = _forward(lattice, logp, viterbi=True)
    node, owner = lattice.end[strings], np.asarray(strings)
    found_strings, found_pieces = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    while len(node):
        edge = back[node]
        found_strings.append(owner)
        found_pieces.append(lattice.piece[edge])
        node = lattice.frm[edge]
        more = node != lattice.start[owner]
        node, owner = node[more], owner[more]
    return np.concatenate(found_strings), np.concatenate(found_pieces)
