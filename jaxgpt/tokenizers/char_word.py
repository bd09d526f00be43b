"""Character and word tokenizers: a list of string tokens after the four specials.

Ids: 0 <|bos|>, 1 <|eos|>, 2 <|pad|>, 3 <|unk|>, then the characters or words in code-point
order. A piece of text without a token of its own becomes <|unk|>.
"""

from __future__ import annotations

import abc
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from itertools import repeat
from typing import Any, ClassVar

from jaxgpt.tokenizers.base import Tokenizer, TokenList, _check_vocab_size, _documents, _field


class _TokenListTokenizer(TokenList):
    """Ordinary tokens are a list of strings, in code-point order after the four specials;
    text is cut into pieces and a piece without a token of its own becomes <|unk|>."""

    piece_name: ClassVar[str]  # what one token is, for messages

    def __init__(self, tokens: Iterable[str]):
        super().__init__(tokens)
        self._ids = {token: i for i, token in enumerate(self._tokens) if i >= len(self.SPECIALS)}

    @property
    def token_rule(self) -> str:
        return f"one {self.piece_name}, so it cannot be a {self.kind} token"

    @classmethod
    def _is_token(cls, token: str) -> bool:
        return cls._is_piece(token)

    @classmethod
    def train(cls, texts: str | Iterable[str], vocab_size: int | None = None) -> Tokenizer:
        """Every piece of `texts`; with `vocab_size`, only the most frequent ones that fit
        (ties go to the smaller string)."""
        counts: Counter[str] = Counter()
        for document in _documents(texts):
            counts.update(cls._pieces(document))
        if not counts:
            raise ValueError(f"cannot train a {cls.kind} tokenizer on empty text (it holds no "
                             f"{cls.piece_name})")
        kept = list(counts)
        if vocab_size is not None:
            _check_vocab_size(vocab_size, len(cls.SPECIALS) + 1,
                              f"{len(cls.SPECIALS)} special tokens + 1 {cls.piece_name}")
            kept = sorted(kept, key=lambda piece: (-counts[piece], piece))
            kept = kept[: vocab_size - len(cls.SPECIALS)]
        return cls(sorted(kept))

    @staticmethod
    @abc.abstractmethod
    def _pieces(text: str) -> Sequence[str]:
        """`text` cut into the pieces that become tokens."""

    @staticmethod
    @abc.abstractmethod
    def _is_piece(token: str) -> bool:
        """Whether `_pieces` can produce `token`."""

    def _encode_ordinary(self, text: str) -> list[int]:
        return list(map(self._ids.get, self._pieces(text), repeat(self.unk_id)))

    def _count_unknown_ordinary(self, text: str) -> int:
        pieces = self._pieces(text)
        return len(pieces) - sum(map(self._ids.__contains__, pieces))

    def _state(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens)}

    @classmethod
    def _from_state(cls, state: Mapping[str, Any]) -> Tokenizer:
        return cls(_field(state, "tokens", list))


class CharTokenizer(_TokenListTokenizer):
    """One token per character of the training text; unseen characters become <|unk|>."""

    kind = "char"
    piece_name = "character"

    @staticmethod
    def _pieces(text: str) -> str:
        return text  # a string is already the sequence of its characters

    @staticmethod
    def _is_piece(token: str) -> bool:
        return len(token) == 1

    def _decode(self, ids: list[int]) -> str:
        return "".join(map(self._tokens.__getitem__, ids))


# A piece is a number with separators (3.14, 1,000), a word with inner hyphens or
# apostrophes (don't, o'er, well-known), a line break, or one punctuation mark.
_WORD_PIECE = re.compile(r"\d+(?:[.,:]\d+)+|\w+(?:[-'’]\w+)*|\n|[^\w\s]")
# Prose spacing: no space before closing marks, none after opening ones, none around "\n".
_ATTACHES_LEFT = frozenset([*".,;:!?)]}%…”’", "\n"])
_ATTACHES_RIGHT = frozenset([*"([{¿¡“‘", "\n"])
_STRAIGHT_QUOTES = frozenset("\"'")  # open and close in turn


class WordTokenizer(_TokenListTokenizer):
    """Words, numbers, punctuation marks and line breaks as tokens; unseen words become
    <|unk|>. Decoding restores the spacing of ordinary prose; other whitespace (runs of
    spaces, tabs, indentation) is not kept.
    """

    kind = "word"
    piece_name = "word, number, line break or punctuation mark"

    @staticmethod
    def _pieces(text: str) -> list[str]:
        return _WORD_PIECE.findall(text)

    @staticmethod
    def _is_piece(token: str) -> bool:
        return _WORD_PIECE.fullmatch(token) is not None

    def _decode(self, ids: list[int]) -> str:
        parts: list[str] = []
        glue_next = True  # nothing before the first token
        open_quotes: set[str] = set()
        for token in map(self._tokens.__getitem__, ids):
            if token in _STRAIGHT_QUOTES:
                opening = token not in open_quotes
                open_quotes ^= {token}
                attaches_left, attaches_right = not opening, opening
            else:
                attaches_left = token in _ATTACHES_LEFT
                attaches_right = token in _ATTACHES_RIGHT
            if not (glue_next or attaches_left):
                parts.append(" ")
            parts.append(token)
            glue_next = attaches_right
        return "".join(parts)
