"""Tokenizers T: text → Seq(V): character, word, byte-level BPE, WordPiece and unigram behind one
interface.

A tokenizer is a map T: text → Seq(V) into sequences over the vocabulary
V = {0, ..., vocab_size - 1}, with a decoder D: Seq(V) → text. Byte-level BPE is lossless,
D(T(t)) = t for every string t; char is lossless on text whose characters were all seen in
training (the others become <|unk|>); word keeps words, numbers, punctuation and line breaks,
and D puts back the spacing of ordinary prose. WordPiece and unigram are lossless on text whose
characters were all seen in training (an unseen character makes its word, for WordPiece, or
itself, for unigram, one <|unk|>).

Every tokenizer has `encode(text, bos=False, eos=False, allow_special=False) -> list[int]`,
`decode(ids, keep_special=False) -> str`, `encode_batch(texts, ...)`, `count_unknown(text)`,
`vocab_size`, the special ids `bos_id eos_id pad_id unk_id` (None where a kind has none),
`save(path)`; `load(path)` reads any of them back and `train_tokenizer(kind, texts,
vocab_size)` builds any of them, so data, training and sampling never care which is in use.

Special tokens are the strings <|bos|> <|eos|> <|pad|> <|unk|>. In user text they are
ordinary characters unless the caller passes `allow_special=True`, so a document that
happens to contain "<|eos|>" cannot end itself.

Where ids sit (`vocab_size` counts every id, i.e. the rows an embedding table needs):

- char, word: 0 <|bos|>, 1 <|eos|>, 2 <|pad|>, 3 <|unk|>, then the characters or words
  in code-point order.
- bpe trained here: 0..255 are the byte values, 256.. the merged tokens in the order they
  were learned, then <|bos|> <|eos|> <|pad|>. No <|unk|>: every string is a byte string.
- bpe read from GPT-2 files: the ids of vocab.json; <|endoftext|> serves as both bos and
  eos, and there is no pad.
- wordpiece: 0 <|bos|>, 1 <|eos|>, 2 <|pad|>, 3 <|unk|>, then the single characters (as
  first pieces and as "##" continuations), then the merged pieces in the order they were
  learned.
- unigram: 0 <|bos|>, 1 <|eos|>, 2 <|pad|>, 3 <|unk|>, then the pieces ("▁" for a space that
  starts a word) from the most probable down.

A tokenizer file is one JSON object {"format": "jaxgpt-tokenizer", "version": 1, "kind":
"char" | "word" | "bpe" | "wordpiece" | "unigram", ...}; loading it only parses JSON and never
executes code.

Modules: `base` (the interface, shared helpers), `char_word` (char and word), `bpe`
(byte-level BPE, GPT-2's files), `bpe_training` (its merges learned from counted pieces),
`pretokenize` (its split pattern), `tiktoken_engine` (the
byte-level BPE encoded by tiktoken, the same ids), `wordpiece` (WordPiece, "##"
continuations), `unigram` (SentencePiece-style unigram language model); this one holds the
registry of kinds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from jaxgpt.tokenizers.base import (
    BOS,
    EOS,
    FILE_FORMAT,
    FILE_VERSION,
    GPT2_END_OF_TEXT,
    PAD,
    UNK,
    Counting,
    Tokenizer,
)
from jaxgpt.tokenizers.bpe import GPT2_SPLIT_PATTERN, BPETokenizer
from jaxgpt.tokenizers.char_word import CharTokenizer, WordTokenizer
from jaxgpt.tokenizers.unigram import UnigramTokenizer
from jaxgpt.tokenizers.wordpiece import WordPieceTokenizer

__all__ = [
    "BOS",
    "EOS",
    "FILE_FORMAT",
    "FILE_VERSION",
    "GPT2_END_OF_TEXT",
    "GPT2_SPLIT_PATTERN",
    "KINDS",
    "PAD",
    "UNK",
    "BPETokenizer",
    "CharTokenizer",
    "Counting",
    "Tokenizer",
    "UnigramTokenizer",
    "WordPieceTokenizer",
    "WordTokenizer",
    "from_dict",
    "load",
    "train_gpt2_bpe",
    "train_tokenizer",
]

KINDS: dict[str, type[Tokenizer]] = {
    "char": CharTokenizer,
    "word": WordTokenizer,
    "bpe": BPETokenizer,
    "wordpiece": WordPieceTokenizer,
    "unigram": UnigramTokenizer,
}


def train_tokenizer(
    kind: str, texts: str | Iterable[str], vocab_size: int | None = None, count: Counting | None = None,
    **options: Any
) -> Tokenizer:
    """Train a tokenizer of `kind` ("char", "word", "bpe", "wordpiece" or "unigram") on a
    string or documents.

    `vocab_size` counts every id, specials included; None means every character or word
    seen (char, word); bpe, wordpiece and unigram need one. `count` counts the pieces of the
    documents elsewhere, e.g. in worker processes (see `Counting`): the kinds that learn from
    counted pieces (bpe) use it, the others count here. `options` go to the kind's `train`
    (bpe: `pattern`; unigram: `max_piece_length`).
    """
    cls = _kind_class(kind)
    if count is not None and cls.learns_from_counts:
        options["count"] = count
    return cls.train(texts, vocab_size=vocab_size, **options)


def train_gpt2_bpe(texts: str | Iterable[str], vocab_size: int, directory: str | os.PathLike) -> BPETokenizer:
    """A byte-level BPE of `vocab_size` ids trained on `texts` whose one special token is GPT-2's
    <|endoftext|> (its bos and eos), written to `directory` as GPT-2's vocab.json and merges.txt:
    a run with it exports as a GPT-2 that Hugging Face's tools read with their own tokenizer."""
    directory = Path(directory)
    train_tokenizer("bpe", texts, vocab_size=vocab_size + 2).save_gpt2(directory)  # 4 specials out, 1 in
    vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
    vocab = {token: i for token, i in vocab.items() if not token.startswith("<|")}
    vocab[GPT2_END_OF_TEXT] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    return BPETokenizer.from_gpt2(directory / "vocab.json", directory / "merges.txt")


def from_dict(data: Any, source: str = "tokenizer data") -> Tokenizer:
    """The tokenizer described by a `to_dict` object; errors name `source`."""
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
        raise ValueError(f'{source} is not a jaxgpt tokenizer (no "format": "{FILE_FORMAT}")')
    if data.get("version") != FILE_VERSION:
        raise ValueError(f"{source} has tokenizer format version {data.get('version')!r}; "
                         f"this jaxgpt reads version {FILE_VERSION} (upgrade jaxgpt or retrain)")
    try:
        return _kind_class(data.get("kind"))._from_state(data)
    except ValueError as err:
        raise ValueError(f"{source} is a damaged tokenizer file: {err}") from err


def load(path: str | os.PathLike) -> Tokenizer:
    """Read a tokenizer written by `save`. Parses JSON only; never executes code."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is a damaged tokenizer file (not valid JSON: {err})") from err
    return from_dict(data, source=str(path))


def _kind_class(kind: Any) -> type[Tokenizer]:
    if kind not in KINDS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of {', '.join(KINDS)}")
    return KINDS[kind]
