"""Byte-level BPE: the 256 byte values as base tokens, learned merges on top.

Ids of a BPE tokenizer trained here: 0..255 are the byte values, 256.. the merged tokens in the
order they were learned, then <|bos|> <|eos|> <|pad|>. No <|unk|>: every string is a byte
string. Read from GPT-2's vocab.json + merges.txt: the ids of vocab.json; <|endoftext|> serves
as both bos and eos, and there is no pad.
"""

from __future__ import annotations

import heapq
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxgpt.files import write_atomically
from jaxgpt.tokenizers import tiktoken_engine
from jaxgpt.tokenizers.base import (
    BOS,
    EOS,
    PAD,
    Counting,
    Tokenizer,
    _check_ids_dense,
    _check_vocab_size,
    _documents,
    _field,
    _utf8,
    count_here,
)
from jaxgpt.tokenizers.bpe_training import PieceTally, Words, learn_merges
from jaxgpt.tokenizers.pretokenize import GPT2_SPLIT_PATTERN, compile_split_pattern, split

_ENCODE_CACHE_LIMIT = 1 << 18  # pieces; the cache starts over when full
_LOOKS_SPECIAL = re.compile(r"<[^<>]+>")  # <|endoftext|>, <pad>, </s>, ...


class BPETokenizer(Tokenizer):
    """Byte-level byte-pair encoding.

    The base vocabulary is the 256 byte values, so every string round-trips exactly. Text
    is cut into pieces by `pattern` (GPT-2's by default); each piece's UTF-8 bytes are
    then merged: repeatedly fuse the adjacent pair with the earliest-learned merge (the
    leftmost one if it occurs more than once) until no learned merge applies.

    Args:
      vocab: every ordinary token as bytes → id; must hold all 256 single bytes and the
        result of every merge.
      merges: (left, right) byte strings in priority order, earliest learned first.
      special_tokens: special token name → id; ids of vocab and specials together must
        be 0..n-1.
      pattern: the `regex` pattern that cuts text into pieces (no capturing groups).
      engine: what encodes ordinary text, with the same ids either way: 'jaxgpt' (the encoder
        below), 'tiktoken' (tiktoken's, from these merges; ValueError where it cannot give the
        same ids, see jaxgpt.tokenizers.tiktoken_engine) or 'auto' (tiktoken once this tokenizer
        has encoded 2²⁰ characters, when it is installed and can; else jaxgpt's).
    """

    kind = "bpe"
    learns_from_counts = True
    SPECIALS = (BOS, EOS, PAD)

    def __init__(
        self,
        vocab: Mapping[bytes, int],
        merges: Sequence[tuple[bytes, bytes]],
        special_tokens: Mapping[str, int],
        pattern: str = GPT2_SPLIT_PATTERN,
        engine: str = "auto",
    ):
        _check_ids_dense([*vocab.values(), *special_tokens.values()])
        missing = [b for b in range(256) if bytes([b]) not in vocab]
        if missing:
            raise ValueError(f"a byte-level vocabulary must hold all 256 bytes; byte {missing[0]} "
                             "is missing")
        merge_ids: dict[tuple[int, int], int] = {}
        merge_rank: dict[tuple[int, int], int] = {}
        for rank, (left, right) in enumerate(merges):
            for part in (left, right, left + right):
                if part not in vocab:
                    raise ValueError(f"merge {left!r} + {right!r} uses {part!r}, which is not "
                                     "in the vocabulary")
            pair = (vocab[left], vocab[right])
            if pair not in merge_rank:  # a repeated merge keeps its first (higher) priority
                merge_rank[pair] = rank
                merge_ids[pair] = vocab[left + right]
        produced = {left + right for left, right in merges}
        for token in vocab:
            if len(token) > 1 and token not in produced:
                raise ValueError(f"token {token!r} is in the vocabulary but no merge produces it")
        super().__init__(special_tokens)
        self._vocab = dict(vocab)
        self._merges = [(bytes(left), bytes(right)) for left, right in merges]
        self._merge_rank = merge_rank
        self._merge_ids = merge_ids
        self._byte_ids = [vocab[bytes([b])] for b in range(256)]
        self._token_bytes = [b""] * (len(vocab) + len(special_tokens))
        for token, i in vocab.items():
            self._token_bytes[i] = token
        for name, i in special_tokens.items():
            self._token_bytes[i] = name.encode("utf-8")
        self._pattern = pattern
        self._splitter = compile_split_pattern(pattern)
        self._cache: dict[str, tuple[int, ...]] = {}
        self._fast: tiktoken_engine.TiktokenEngine | bool | None = None  # False: cannot; None: not built
        self._chars_encoded = 0
        self.engine = engine

    @classmethod
    def train(
        cls,
        texts: str | Iterable[str],
        vocab_size: int | None = None,
        pattern: str = GPT2_SPLIT_PATTERN,
        count: Counting = count_here,
    ) -> BPETokenizer:
        """Learn merges until `vocab_size` ids (bytes + merges + 3 specials) are used.

        Each step fuses the adjacent pair with the highest count in the training text; a
        tie goes to the smallest pair of ids. Training stops early if no pair is left.
        `count` counts the pieces of the documents (a jaxgpt.tokenizers.base.Counting):
        here by default, or spread over processes by the caller; the merges are the same.
        """
        base = 256 + len(cls.SPECIALS)
        if vocab_size is None:
            raise ValueError(f"byte-level BPE needs a vocab_size (e.g. 4096; at least {base}: "
                             f"256 bytes + {len(cls.SPECIALS)} special tokens)")
        _check_vocab_size(vocab_size, base, f"256 bytes + {len(cls.SPECIALS)} special tokens")
        compile_split_pattern(pattern)  # a bad pattern is refused before any counting
        words = Words.concatenated(count(PieceTally(pattern), _documents(texts)))
        if not len(words):
            raise ValueError("cannot train a byte-level BPE tokenizer on empty text")
        tokens, merges = learn_merges(words, vocab_size - len(cls.SPECIALS))
        vocab = {token: i for i, token in enumerate(tokens)}
        specials = {name: len(tokens) + k for k, name in enumerate(cls.SPECIALS)}
        return cls(vocab, [(tokens[a], tokens[b]) for a, b in merges], specials, pattern)

    @classmethod
    def prepare_encoding(cls) -> None:
        """tiktoken's spelling of GPT-2's pattern (its character classes found once per process, ~0.2 s)."""
        tiktoken_engine.spelled_out(GPT2_SPLIT_PATTERN)

    @property
    def vocab_size(self) -> int:
        return len(self._token_bytes)

    @property
    def merges(self) -> list[tuple[bytes, bytes]]:
        """The merges as (left, right) byte strings, earliest learned first."""
        return list(self._merges)

    @property
    def vocab(self) -> dict[bytes, int]:
        """The ordinary tokens, bytes → id."""
        return dict(self._vocab)

    @property
    def pattern(self) -> str:
        return self._pattern

    @property
    def engine(self) -> str:
        """'auto', 'jaxgpt' or 'tiktoken' (see the class docstring); settable."""
        return self._engine

    @engine.setter
    def engine(self, engine: str) -> None:
        self._engine = tiktoken_engine.check_engine(engine)
        if engine == "tiktoken" and not self._fast:
            self._fast = self._build_fast()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fast": None if self._fast else self._fast}  # tiktoken's is not pickled

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.engine = self._engine  # 'tiktoken' builds its engine again

    def _build_fast(self) -> tiktoken_engine.TiktokenEngine:
        return tiktoken_engine.build(self._vocab, self._merges, self.special_tokens, self._pattern,
                                     self._encode_bytes)

    def _fast_engine(self, length: int) -> tiktoken_engine.TiktokenEngine | None:
        if self._engine == "jaxgpt" or self._fast is False:
            return None
        if self._fast is None:
            self._chars_encoded += length
            if self._chars_encoded < tiktoken_engine.AUTO_AFTER_CHARS:
                return None
            try:
                self._fast = self._build_fast()
            except ValueError:
                self._fast = False  # jaxgpt's encoder, from now on
                return None
        return self._fast

    def _encode_ordinary(self, text: str) -> list[int]:
        fast = self._fast_engine(len(text))
        ids = fast.encode_ordinary(text) if fast else None
        return ids if ids is not None else self._encode_pure(text)

    def _encode_pure(self, text: str) -> list[int]:
        cache = self._cache
        ids: list[int] = []
        for piece in split(self._splitter, text):
            piece_ids = cache.get(piece)
            if piece_ids is None:
                piece_ids = self._encode_bytes(_utf8(piece))
                if len(cache) >= _ENCODE_CACHE_LIMIT:
                    cache.clear()
                cache[piece] = piece_ids
            ids += piece_ids
        return ids

    def _encode_bytes(self, piece: bytes) -> tuple[int, ...]:
        """Apply the lowest-rank applicable merge (leftmost on ties) until none applies.

        The piece is a linked list of tokens and the candidate merges sit in a heap keyed
        by (rank, position), so a long piece costs O(n log n), not O(n²).
        """
        tokens: list[int | None] = [self._byte_ids[b] for b in piece]
        n = len(tokens)
        rank_of, merged_id = self._merge_rank, self._merge_ids
        next_pos = list(range(1, n + 1))  # n: no next token
        prev_pos = list(range(-1, n - 1))  # -1: no previous token
        heap = [
            (rank, i)
            for i in range(n - 1)
            if (rank := rank_of.get((tokens[i], tokens[i + 1]))) is not None
        ]
        heapq.heapify(heap)
        while heap:
            rank, i = heapq.heappop(heap)
            j = next_pos[i]
            # Skip entries made stale by earlier merges: a rank names exactly one pair.
            if tokens[i] is None or j == n or rank_of.get((tokens[i], tokens[j])) != rank:
                continue
            tokens[i] = merged = merged_id[(tokens[i], tokens[j])]
            tokens[j] = None
            k = next_pos[j]
            next_pos[i] = k
            if k < n:
                prev_pos[k] = i
                if (rank := rank_of.get((merged, tokens[k]))) is not None:
                    heapq.heappush(heap, (rank, i))
            h = prev_pos[i]
            if h >= 0 and (rank := rank_of.get((tokens[h], merged))) is not None:
                heapq.heappush(heap, (rank, h))
        return tuple(t for t in tokens if t is not None)

    def _count_unknown_ordinary(self, text: str) -> int:
        return 0  # every string is a byte string, so nothing is unknown

    def _decode(self, ids: list[int]) -> str:
        # A cut inside a multi-byte character (e.g. a partial sample) decodes to U+FFFD.
        return b"".join(map(self._token_bytes.__getitem__, ids)).decode("utf-8", "replace")

    # --- files ----------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {
            "pattern": self._pattern,
            "vocab": {_printable(token): i for token, i in sorted(self._vocab.items(),
                                                                  key=lambda item: item[1])},
            "merges": [f"{_printable(left)} {_printable(right)}" for left, right in self._merges],
            "special_tokens": self.special_tokens,
        }

    @classmethod
    def _from_state(cls, state: Mapping[str, Any]) -> BPETokenizer:
        vocab = _parse_printable_vocab(_field(state, "vocab", dict))
        merges = _parse_printable_merges(_field(state, "merges", list))
        specials = _field(state, "special_tokens", dict)
        return cls(vocab, merges, specials, _field(state, "pattern", str))

    @classmethod
    def from_gpt2(
        cls,
        vocab_path: str | os.PathLike,
        merges_path: str | os.PathLike,
        pattern: str = GPT2_SPLIT_PATTERN,
    ) -> BPETokenizer:
        """Read the vocab.json + merges.txt pair that Hugging Face GPT-2 checkpoints ship.

        Entries of vocab.json that are neither a single byte nor the result of a merge
        become special tokens if they look like one (<...>, as GPT-2's <|endoftext|>).
        """
        try:
            printable_vocab = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{vocab_path} is not a valid vocab.json: {err}") from err
        lines = Path(merges_path).read_text(encoding="utf-8").splitlines()
        if lines and lines[0].startswith("#version"):
            lines = lines[1:]
        merge_lines = [line for line in lines if line.strip()]
        try:
            if not isinstance(printable_vocab, dict):
                raise ValueError("vocab.json must hold one object, token → id")
            merges = _parse_printable_merges(merge_lines)
            ordinary = {_printable(bytes([b])) for b in range(256)}
            ordinary |= {_printable(left + right) for left, right in merges}
            specials = {t: i for t, i in printable_vocab.items() if t not in ordinary}
            for name in specials:
                if not _LOOKS_SPECIAL.fullmatch(name):
                    raise ValueError(f"token {name!r} is neither a byte, nor made by a merge, nor "
                                     "a special token like <|endoftext|>; is merges.txt complete?")
            vocab = _parse_printable_vocab(
                {t: i for t, i in printable_vocab.items() if t in ordinary}
            )
            return cls(vocab, merges, specials, pattern)
        except ValueError as err:
            raise ValueError(f"{vocab_path} + {merges_path}: {err}") from err

    def save_gpt2(self, directory: str | os.PathLike) -> None:
        """Write vocab.json and merges.txt (GPT-2's format) into `directory`.

        The format has no place for the split pattern: `from_gpt2` assumes GPT-2's.
        """
        printable_vocab = {_printable(token): i for token, i in self._vocab.items()}
        for name, i in self._special_ids.items():
            if name in printable_vocab:
                raise ValueError(f"special token {name!r} has the same text as an ordinary "
                                 "token, so vocab.json cannot hold both")
            printable_vocab[name] = i
        printable_vocab = dict(sorted(printable_vocab.items(), key=lambda item: item[1]))
        merges = [f"{_printable(left)} {_printable(right)}" for left, right in self._merges]
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_atomically(directory / "vocab.json", json.dumps(printable_vocab, ensure_ascii=False) + "\n")
        write_atomically(directory / "merges.txt", "\n".join(["#version: 0.2", *merges]) + "\n")


# --- GPT-2's printable form of bytes --------------------------------------------------


def _bytes_to_printable() -> list[str]:
    """GPT-2's byte → character table: printable bytes stand for themselves, the others
    (control characters, space, a few Latin-1 ones) for characters 256, 257, ... in order.
    It makes every byte string a visible, whitespace-free string for vocab.json/merges.txt.
    """
    visible = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)}
    table, shifted = [], 256
    for b in range(256):
        if b in visible:
            table.append(chr(b))
        else:
            table.append(chr(shifted))
            shifted += 1
    return table


_PRINTABLE = _bytes_to_printable()
_FROM_PRINTABLE = {ch: b for b, ch in enumerate(_PRINTABLE)}


def _printable(token: bytes) -> str:
    return "".join(_PRINTABLE[b] for b in token)


def _from_printable(text: str) -> bytes:
    try:
        return bytes(_FROM_PRINTABLE[ch] for ch in text)
    except KeyError as err:
        raise ValueError(f"token {text!r} holds {err.args[0]!r}, which is not a character of "
                         "GPT-2's byte encoding") from None


def _parse_printable_vocab(printable_vocab: Mapping[str, Any]) -> dict[bytes, int]:
    vocab = {}
    for text, i in printable_vocab.items():
        if not isinstance(i, int) or isinstance(i, bool):
            raise ValueError(f"the id of token {text!r} is {i!r}, not an integer")
        vocab[_from_printable(text)] = i
    if len(vocab) != len(printable_vocab):
        raise ValueError("the vocabulary names one byte string twice")
    return vocab


def _parse_printable_merges(lines: Sequence[Any]) -> list[tuple[bytes, bytes]]:
    merges = []
    for line in lines:
        parts = line.split(" ") if isinstance(line, str) else []
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"merge {line!r} is not two tokens separated by one space")
        merges.append((_from_printable(parts[0]), _from_printable(parts[1])))
    return merges
