"""The one interface every tokenizer T: text → Seq(V) has, and the helpers the kinds share.

Special tokens are the strings <|bos|> <|eos|> <|pad|> <|unk|>. In user text they are
ordinary characters unless the caller passes `allow_special=True`, so a document that
happens to contain "<|eos|>" cannot end itself.
"""

from __future__ import annotations

import abc
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Protocol

from jaxgpt.files import write_atomically

BOS, EOS, PAD, UNK = "<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"
GPT2_END_OF_TEXT = "<|endoftext|>"

FILE_FORMAT = "jaxgpt-tokenizer"
FILE_VERSION = 1



class Tally(Protocol):
    """What a kind that learns from counted pieces counts: `add` counts a document's pieces;
    `result(parts)` gives what was counted cut into `parts` disjoint shares, a piece's share chosen
    by a rule of the piece alone (the same in every process), in a form that crosses to another
    process cheaply; `joined` adds up shares of the same part from several tallies."""

    def add(self, document: str) -> None: ...

    def result(self, parts: int = 1) -> list: ...

    def joined(self, shares: list) -> Any: ...


# count(tally, documents) → results that together hold the counts of every document's pieces, each
# piece in one of them only (from copies of the empty `tally`, one per process that counted, their
# shares joined): how a kind that learns from counted pieces has them counted (here by
# `count_here`, or spread over processes by the caller).
Counting = Callable[[Tally, Iterable[str]], list]


class Tokenizer(abc.ABC):
    """T: text → Seq(V). Subclasses provide the ordinary-text encoding and the decoding."""

    kind: ClassVar[str]
    learns_from_counts: ClassVar[bool] = False  # its train(…, count=) takes a Counting

    @classmethod
    def prepare_encoding(cls) -> None:
        """Work that this kind's encoder does once per process whatever the vocabulary, done ahead
        (by an encoding worker while its tokenizer is being learned); none by default."""
        return

    def __init__(self, special_tokens: Mapping[str, int]):
        if not all(isinstance(name, str) and name for name in special_tokens):
            raise ValueError("special token names must be non-empty strings")
        self._special_ids = dict(special_tokens)
        self._special_names = {i: name for name, i in self._special_ids.items()}
        # Longest first, so that a special token that contains another one wins.
        names = sorted(self._special_ids, key=len, reverse=True)
        self._special_split = (
            re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None
        )

    # --- the interface --------------------------------------------------------------

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, special ones included: the rows of an embedding table."""

    @property
    def special_tokens(self) -> dict[str, int]:
        """The special tokens, name → id."""
        return dict(self._special_ids)

    @property
    def bos_id(self) -> int | None:
        return self._special_ids.get(BOS, self._special_ids.get(GPT2_END_OF_TEXT))

    @property
    def eos_id(self) -> int | None:
        return self._special_ids.get(EOS, self._special_ids.get(GPT2_END_OF_TEXT))

    @property
    def pad_id(self) -> int | None:
        return self._special_ids.get(PAD)

    @property
    def unk_id(self) -> int | None:
        return self._special_ids.get(UNK)

    def encode(
        self, text: str, bos: bool = False, eos: bool = False, allow_special: bool = False
    ) -> list[int]:
        """Token ids of `text`, with <|bos|> first and <|eos|> last when asked.

        Special-token strings inside `text` are encoded as ordinary text unless
        `allow_special` is True.
        """
        ids = [self._required_id("bos", self.bos_id)] if bos else []
        for chunk, is_special in self._chunks(text, allow_special):
            if is_special:
                ids.append(self._special_ids[chunk])
            else:
                ids += self._encode_ordinary(chunk)
        if eos:
            ids.append(self._required_id("eos", self.eos_id))
        return ids

    def encode_batch(
        self,
        texts: Iterable[str],
        bos: bool = False,
        eos: bool = False,
        allow_special: bool = False,
    ) -> list[list[int]]:
        """`encode` of each text."""
        if isinstance(texts, str):
            raise TypeError("encode_batch takes an iterable of texts; use encode for one text")
        return [self.encode(t, bos=bos, eos=eos, allow_special=allow_special) for t in texts]

    def decode(self, ids: Iterable[int], keep_special: bool = False) -> str:
        """The text of `ids`; special tokens are dropped unless `keep_special` is True."""
        ids = self._checked_ids(ids)
        if not keep_special:
            specials = self._special_names
            ids = [i for i in ids if i not in specials]
        return self._decode(ids)

    def count_unknown(self, text: str, allow_special: bool = False) -> int:
        """How many pieces of `text` `encode` would replace by <|unk|>."""
        return sum(
            self._count_unknown_ordinary(chunk)
            for chunk, is_special in self._chunks(text, allow_special)
            if not is_special
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer as one JSON file (atomically: a crash leaves no half file)."""
        write_atomically(path, json.dumps(self.to_dict(), ensure_ascii=False) + "\n")

    def to_dict(self) -> dict[str, Any]:
        """The JSON object that `save` writes and `from_dict` reads."""
        return {"format": FILE_FORMAT, "version": FILE_VERSION, "kind": self.kind, **self._state()}

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"

    # --- what each kind provides ----------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def train(cls, texts: str | Iterable[str], vocab_size: int | None = None) -> Tokenizer:
        """Build the tokenizer from a string or an iterable of documents."""

    @abc.abstractmethod
    def _encode_ordinary(self, text: str) -> list[int]:
        """Ids of text that holds no special tokens."""

    @abc.abstractmethod
    def _count_unknown_ordinary(self, text: str) -> int:
        """How many pieces of `text` have no id of their own."""

    @abc.abstractmethod
    def _decode(self, ids: list[int]) -> str:
        """Text of valid ids, special ids included."""

    @abc.abstractmethod
    def _state(self) -> dict[str, Any]:
        """The JSON fields beyond format, version and kind."""

    @classmethod
    @abc.abstractmethod
    def _from_state(cls, state: Mapping[str, Any]) -> Tokenizer:
        """Inverse of `_state`; raises ValueError on a malformed state."""

    # --- shared helpers -------------------------------------------------------------

    def _chunks(self, text: str, allow_special: bool) -> list[tuple[str, bool]]:
        """`text` cut into (chunk, is_special) pieces; one ordinary chunk unless allowed."""
        if not isinstance(text, str):
            raise TypeError(f"expected text as str, got {type(text).__name__}")
        if not allow_special or self._special_split is None:
            return [(text, False)]
        parts = self._special_split.split(text)  # the captured specials sit at odd indices
        return [(part, i % 2 == 1) for i, part in enumerate(parts) if part]

    def _checked_ids(self, ids: Iterable[int]) -> list[int]:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # NumPy/JAX arrays too
        if ids:
            low, high = min(ids), max(ids)
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(
                    f"token id {bad} is out of range: this tokenizer's ids are "
                    f"0..{self.vocab_size - 1}"
                )
        return ids

    def _required_id(self, role: str, token_id: int | None) -> int:
        if token_id is None:
            raise ValueError(f"this {self.kind} tokenizer has no {role} token; call encode "
                             f"with {role}=False")
        return token_id


# --- small helpers shared by the kinds ----------------------------------------------


def _documents(texts: str | Iterable[str]) -> Iterable[str]:
    """The training documents: a lone string is one document."""
    if isinstance(texts, str):
        yield texts
        return
    for document in texts:
        if not isinstance(document, str):
            raise TypeError(f"training documents must be str, got {type(document).__name__}")
        yield document


def count_here(tally: Tally, documents: Iterable[str]) -> list:
    """`tally`'s result once it has added every document, in this process (a Counting)."""
    for document in documents:
        tally.add(document)
    return tally.result()


class TokenList(Tokenizer):
    """A tokenizer whose ordinary tokens are a list of distinct strings, in id order after the
    four specials; `_is_token` says which strings may be one, `token_rule` says so in words."""

    SPECIALS = (BOS, EOS, PAD, UNK)
    token_rule: str  # what a token is, for the message that refuses another

    def __init__(self, tokens: Iterable[str]):
        tokens = list(tokens)
        for token in tokens:
            if not (isinstance(token, str) and self._is_token(token)):
                raise ValueError(f"{token!r} is not {self.token_rule}")
        if len(set(tokens)) != len(tokens):
            raise ValueError(f"a {self.kind} tokenizer's tokens must be distinct")
        super().__init__({name: i for i, name in enumerate(self.SPECIALS)})
        self._tokens = [*self.SPECIALS, *tokens]

    @classmethod
    @abc.abstractmethod
    def _is_token(cls, token: str) -> bool:
        """Whether `token` may be one of this kind's ordinary tokens."""

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> tuple[str, ...]:
        """The ordinary tokens, in id order."""
        return tuple(self._tokens[len(self.SPECIALS):])


def _check_vocab_size(vocab_size: Any, minimum: int, base: str) -> None:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < minimum:
        raise ValueError(f"vocab_size must be an integer ≥ {minimum} ({base}), got {vocab_size!r}")


def _check_ids_dense(ids: list[Any]) -> None:
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("token ids must be integers")
    if sorted(ids) != list(range(len(ids))):
        raise ValueError(f"token ids must be 0..{len(ids) - 1}, each used once")


def _field(state: Mapping[str, Any], name: str, kind: type) -> Any:
    value = state.get(name)
    if not isinstance(value, kind):
        raise ValueError(f"field {name!r} is missing or not a {kind.__name__}")
    return value


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"text holds {text[err.start]!r}, a lone surrogate that has no UTF-8 "
                         "bytes; read the text with errors='replace' to clean it") from None
