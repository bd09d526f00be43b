"""WordPiece: words cut into the longest pieces of a vocabulary learned by likelihood merges.

Pre-tokens. Text is cut as BERT's basic tokenizer cuts it, into words and punctuation, but
whitespace is kept: a pre-token is a run of word characters (`\\w+`: letters, digits, "_"),
one other non-space character (punctuation, a symbol), or a run of whitespace. A single space
between two words is implied rather than stored: the encoder drops it, and the decoder puts one
space between two adjacent words (two `\\w+` runs are never adjacent in text, so nothing else
can make them adjacent). Every other whitespace run (the space after a comma, line breaks,
indentation, a double space) is a pre-token of its own.

Round trip: decode(encode(t)) == t for every text t whose characters all have pieces, i.e.
were seen in training (unless vocab_size was too small to hold every character; the rarest
ones are then left out). A pre-token that cannot be pieced becomes one <|unk|>, which the
decoder spaces like a word.

Pieces. A pre-token is a first piece and then continuation pieces written with "##":
"playing" → "play", "##ing". Encoding is greedy longest-match-first: the longest vocabulary
piece that starts the pre-token, then the longest "##" piece that continues it, and so on; if
nothing matches at some point, the whole pre-token becomes <|unk|> (as BERT does).

Training starts from the characters of the pre-tokens, a word or whitespace character in both
forms ("a" and "##a"), and repeatedly merges the adjacent pair (a, b) with the highest

    score(a, b) = count(ab) / (count(a) · count(b))

over the pre-tokens of the training text (ties: the larger count(ab), then the smaller (a, b)
as strings), adding the piece a + b without b's "##", until vocab_size ids are used or no pair
is left. Counts are kept per unique pre-token, weighted by its frequency. The score favours
pieces that occur mostly together, however rare (two that only ever occur together, n times,
score 1/n): on 1.1 MB of Shakespeare at 4096 ids it learns names and rare words first
("NORFOLK", "##LLOUGHBY") and gives 1.54 bytes per token, where unigram gives 4.1 and
byte-level BPE 3.2; counting only the tokens of words and punctuation, 1.66. The `tokenizers`
library's WordPieceTrainer gives 3.69 there (bench/bench_tokenizers.py), because it does not
use this score: it is its BPE trainer (merge the most frequent pair, count(ab)) with "##"
continuations. Merging by count(ab) with everything else here unchanged also gives 3.69, so the
difference is the score's alone; no choice the score leaves open (ties, pre-tokens, the 4
alphabet forms that Shakespeare never uses) comes near it.

Ids: 0 <|bos|>, 1 <|eos|>, 2 <|pad|>, 3 <|unk|>, then the single characters (sorted as strings),
then the merged pieces in the order they were learned.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from jaxgpt.tokenizers.base import UNK, TokenList, _check_vocab_size, _documents, _field
from jaxgpt.tokenizers.bpe_training import merge_pair

_PRE_TOKEN = re.compile(r"\w+|\s+|[^\w\s]")
_WORD_START = re.compile(r"\w")
_SPACED_START = re.compile(r"[\w\s]")  # pre-tokens of these characters can be longer than one
_TOKEN = re.compile(r"(?:##)?(?:\w+|\s+)|[^\w\s]")  # what a vocabulary entry may be
_ENCODE_CACHE_LIMIT = 1 << 18  # pre-tokens; the cache starts over when full
_CONTINUATION, _WORD, _OTHER, _SPECIAL = range(4)  # how a token is spaced when decoding


def pre_tokens(text: str) -> list[str]:
    """`text` cut into words, single punctuation marks and whitespace runs, without the single
    spaces between two words (the decoder puts them back)."""
    tokens = _PRE_TOKEN.findall(text)
    return [
        token for i, token in enumerate(tokens)
        if not (token == " " and 0 < i < len(tokens) - 1 and _is_word(tokens[i - 1]) and _is_word(tokens[i + 1]))
    ]


def _is_word(token: str) -> bool:
    return _WORD_START.match(token) is not None


class WordPieceTokenizer(TokenList):
    """WordPiece with "##" continuation pieces and greedy longest-match-first encoding.

    Args:
      tokens: the ordinary tokens in id order (ids 4.. after the four specials); a first piece
        is a word, one punctuation mark or a whitespace run, a continuation is "##" + a word or
        whitespace run.
    """

    kind = "wordpiece"
    token_rule = "a wordpiece token (a word, one punctuation mark or a whitespace run; '##' + a word or whitespace run)"

    def __init__(self, tokens: Iterable[str]):
        super().__init__(tokens)
        tokens = self.tokens
        self._ids = {token: i for i, token in enumerate(self._tokens) if i >= len(self.SPECIALS)}
        self._max_len = max((len(t) - 2 * t.startswith("##") for t in tokens), default=1)
        self._text = [t[2:] if _is_continuation(t) else t for t in self._tokens]
        self._spacing = [_spacing(t) for t in tokens]
        self._spacing[:0] = [_WORD if name == UNK else _SPECIAL for name in self.SPECIALS]
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def train(cls, texts: str | Iterable[str], vocab_size: int | None = None) -> WordPieceTokenizer:
        """Learn pieces by likelihood merges until `vocab_size` ids (4 specials + pieces)."""
        base = len(cls.SPECIALS) + 1
        if vocab_size is None:
            raise ValueError(f"wordpiece needs a vocab_size (e.g. 4096; at least {base}: 4 special tokens + 1 "
                             "piece)")
        _check_vocab_size(vocab_size, base, "4 special tokens + 1 piece")
        counts: Counter[str] = Counter()
        for document in _documents(texts):
            counts.update(pre_tokens(document))
        if not counts:
            raise ValueError("cannot train a wordpiece tokenizer on empty text")
        room = vocab_size - len(cls.SPECIALS)
        merger = _Merger(counts, _alphabet(counts, room), room)
        while len(merger.tokens) < room and (pair := merger.best_pair()) is not None:
            merger.merge(pair)
        return cls(merger.tokens)

    @classmethod
    def _is_token(cls, token: str) -> bool:
        return _TOKEN.fullmatch(token) is not None

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        cache = self._cache
        for token in pre_tokens(text):
            pieces = cache.get(token)
            if pieces is None:
                if len(cache) >= _ENCODE_CACHE_LIMIT:
                    cache.clear()
                pieces = cache[token] = self._pieces(token)
            ids += pieces
        return ids

    def _pieces(self, word: str) -> tuple[int, ...]:
        """Greedy longest-match-first pieces of one pre-token; (<|unk|>,) if it has none."""
        pieces, start, n = [], 0, len(word)
        while start < n:
            prefix = "##" if start else ""
            for end in range(min(n, start + self._max_len), start, -1):
                piece = self._ids.get(prefix + word[start:end])
                if piece is not None:
                    break
            else:
                return (self.unk_id,)
            pieces.append(piece)
            start = end
        return tuple(pieces)

    def _count_unknown_ordinary(self, text: str) -> int:
        return sum(self._pieces(token) == (self.unk_id,) for token in pre_tokens(text))

    def _decode(self, ids: list[int]) -> str:
        parts: list[str] = []
        after_word = False
        for i in ids:
            spacing = self._spacing[i]
            if spacing == _WORD and after_word:
                parts.append(" ")
            parts.append(self._text[i])
            if spacing != _CONTINUATION:
                after_word = spacing == _WORD
        return "".join(parts)

    def _state(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens)}

    @classmethod
    def _from_state(cls, state: Mapping[str, Any]) -> WordPieceTokenizer:
        return cls(_field(state, "tokens", list))


def _is_continuation(token: str) -> bool:
    return token.startswith("##") and len(token) > 2


def _spacing(token: str) -> int:
    if _is_continuation(token):
        return _CONTINUATION
    return _WORD if _is_word(token) else _OTHER


def _alphabet(counts: Mapping[str, int], room: int) -> list[str]:
    """The single-character pieces: each character as a first piece and, for a word or
    whitespace character, as a continuation too ("##a"), seen there or not, so that any
    pre-token of seen characters can be pieced. If they do not all fit in `room`, characters
    from the most frequent down (ties: the smaller), each with all its forms, while they fit."""
    frequency: Counter[str] = Counter()
    for word, count in counts.items():
        for ch in word:
            frequency[ch] += count
    units: list[str] = []
    for ch in sorted(frequency, key=lambda ch: (-frequency[ch], ch)):
        forms = [ch, "##" + ch] if _SPACED_START.match(ch) else [ch]
        if len(units) + len(forms) <= room:
            units += forms
    return sorted(units)


class _Merger:
    """The state of WordPiece training: every unique pre-token as a list of token ids, the
    count of each token and of each adjacent pair, and which words hold each pair.

    Scores are recomputed for all pairs at each step (a merge changes count(a) and count(b),
    which moves the score of every pair that holds a or b, up as well as down).
    """

    def __init__(self, counts: Mapping[str, int], alphabet: list[str], room: int):
        self.tokens = list(alphabet)
        self.token_id = {token: i for i, token in enumerate(self.tokens)}
        self.words: list[list[int]] = []
        self.counts: list[int] = []
        self.unit_count = np.zeros(room)
        for word, count in counts.items():
            units = [self.token_id.get(u) for u in (word[0], *("##" + ch for ch in word[1:]))]
            if None in units:
                continue  # holds a character left out of a too small vocabulary
            for u in units:
                self.unit_count[u] += count
            self.words.append(units)
            self.counts.append(count)
        self.pair_index: dict[tuple[int, int], int] = {}
        self.left, self.right, self.pair_count = (np.zeros(1024, np.int64) for _ in range(3))
        self.words_with: defaultdict[int, set[int]] = defaultdict(set)
        changes: list[tuple[int, int]] = []
        for w, units in enumerate(self.words):
            changes += [(self._pair(pair, w), self.counts[w]) for pair in zip(units, units[1:], strict=False)]
        self._apply(changes)

    def best_pair(self) -> int | None:
        """Index of the pair with the highest count(ab) / (count(a) count(b)); None if none is left."""
        n = len(self.pair_index)
        if not n:
            return None
        count = self.pair_count[:n].astype(float)
        with np.errstate(divide="ignore", invalid="ignore"):
            score = np.where(count > 0, count / (self.unit_count[self.left[:n]] * self.unit_count[self.right[:n]]),
                             -1.0)
        if score.max() <= 0:
            return None
        tied = np.flatnonzero(score == score.max())
        tied = tied[count[tied] == count[tied].max()]
        return min(tied, key=lambda p: (self.tokens[self.left[p]], self.tokens[self.right[p]]))

    def merge(self, p: int) -> None:
        """Fuse pair `p` everywhere, adding its piece (or reusing the id of an equal one)."""
        a, b = int(self.left[p]), int(self.right[p])
        piece = self.tokens[a] + self.tokens[b][2:]
        new = self.token_id.get(piece)
        if new is None:
            new = self.token_id[piece] = len(self.tokens)
            self.tokens.append(piece)
        changes: list[tuple[int, int]] = []
        for w in self.words_with.pop(p):
            old, count = self.words[w], self.counts[w]
            fused = merge_pair(old, a, b, new)
            if fused is None:
                continue
            for u in old:
                self.unit_count[u] -= count
            for u in fused:
                self.unit_count[u] += count
            changes += [(self.pair_index[pair], -count) for pair in zip(old, old[1:], strict=False)]
            changes += [(self._pair(pair, w), count) for pair in zip(fused, fused[1:], strict=False)]
            self.words[w] = fused
        self._apply(changes)

    def _pair(self, pair: tuple[int, int], word: int) -> int:
        """The index of `pair`, registered if new, noting that `word` holds it."""
        p = self.pair_index.get(pair)
        if p is None:
            p = self.pair_index[pair] = len(self.pair_index)
            if p == len(self.left):
                self.left, self.right, self.pair_count = (
                    np.concatenate([a, np.zeros_like(a)]) for a in (self.left, self.right, self.pair_count))
            self.left[p], self.right[p] = pair
        self.words_with[p].add(word)
        return p

    def _apply(self, changes: list[tuple[int, int]]) -> None:
        if changes:
            index, delta = np.array(changes, np.int64).T
            np.add.at(self.pair_count, index, delta)

