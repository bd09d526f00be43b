r"""tiktoken as the encoding engine of the byte-level BPE: jaxgpt's merges and split pattern run by
tiktoken's Rust encoder give exactly the ids of jaxgpt's own encoder, faster (bench/bench_encode.py).
Training stays jaxgpt's. Needs the tiktoken extra: pip install 'jaxgpt[tiktoken]'.

tiktoken encodes with mergeable ranks, token bytes → rank, the rank being the id too: it cuts
text with the pattern, returns a piece that is a whole token as that token, and otherwise
repeatedly fuses the adjacent pair whose concatenation has the lowest rank (the leftmost on a
tie). jaxgpt's encoder fuses the adjacent pair that is the earliest *listed* merge. With each
token's id as its rank, the two give the same ids on every text when

1. the split pattern is GPT-2's: tiktoken drops text that a pattern does not match (jaxgpt
   keeps it), and GPT-2's pattern is the one known to match everything;
2. the merged tokens' ids rise with the merge order, so no two merges make the same token and
   the lowest rank is the earliest merge;
3. every multi-byte token encodes to itself under jaxgpt's encoder.

(3) covers tiktoken's whole-token shortcut, and it rules out the other difference too: were two
adjacent tokens x, y of a state of jaxgpt's encoder to make a token t = x + y that is not the
merge (x, y), then jaxgpt's encoder on t's bytes alone would make the same merges inside t's span
and stop at [x, y], so t would not encode to itself. So at every step both encoders see the same
candidate pairs, in the same order. A tokenizer that fails one of these is not run by tiktoken
(`unusable_reason` says which condition failed).

tiktoken's regex engine has its own Unicode tables, of another Unicode version than the `regex`
module's (they class some 17,000 code points differently): the pattern tiktoken is given spells
\p{L}, \p{N} and \s out as the code points that the `regex` module puts in them, found once per
process (~0.3 s), so that both cut every text alike. A text with a lone surrogate goes to
jaxgpt's encoder, which refuses it (tiktoken would replace it silently).
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Mapping, Sequence

import regex

from jaxgpt.tokenizers.pretokenize import GPT2_SPLIT_PATTERN

ENGINES = ("auto", "jaxgpt", "tiktoken")
AUTO_AFTER_CHARS = 1 << 20  # 'auto' builds the engine (≲1 s) once a tokenizer has encoded this much text
_WHITESPACE = r"\s"
_PATTERN_TOKEN = re.compile(r"\\p\{[LN]\}|\\.|[][]|[^][\\]+")  # a class escape, an escape, a bracket, the rest


class TiktokenEngine:
    """A tiktoken.Encoding with the ids of one byte-level BPE tokenizer (see the module docstring)."""

    def __init__(self, encoding):
        self.encoding = encoding

    def encode_ordinary(self, text: str) -> list[int] | None:
        """The ids of `text` (no special tokens), or None where jaxgpt's encoder must encode it."""
        if not text.isascii():
            try:
                text.encode("utf-8")  # ~1 GB/s; fails on a lone surrogate only
            except UnicodeEncodeError:
                return None
        return self.encoding.encode_ordinary(text)


def check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise ValueError(f"unknown BPE engine {engine!r}; choose one of {', '.join(ENGINES)}")
    return engine


def unusable_reason(vocab: Mapping[bytes, int], merges: Sequence[tuple[bytes, bytes]], pattern: str,
                    encode_bytes: Callable[[bytes], tuple[int, ...]]) -> str | None:
    """Why tiktoken cannot give this tokenizer's ids, or None when it can."""
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        return "tiktoken is not installed (pip install 'jaxgpt[tiktoken]')"
    if pattern != GPT2_SPLIT_PATTERN:
        return "its split pattern is not GPT-2's (tiktoken drops the text a pattern does not match)"
    made = [vocab[left + right] for left, right in merges]
    if any(earlier >= later for earlier, later in itertools.pairwise(made)):
        return "the ids of its merged tokens do not rise with the merge order (e.g. two merges make one token)"
    for token, token_id in vocab.items():
        if len(token) > 1 and encode_bytes(token) != (token_id,):
            return f"its token {token!r} does not encode to itself"
    return None


def build(vocab: Mapping[bytes, int], merges: Sequence[tuple[bytes, bytes]], special_tokens: Mapping[str, int],
          pattern: str, encode_bytes: Callable[[bytes], tuple[int, ...]]) -> TiktokenEngine:
    """The engine of a tokenizer; ValueError (naming the reason) where tiktoken cannot run it."""
    reason = unusable_reason(vocab, merges, pattern, encode_bytes)
    if reason is not None:
        raise ValueError(f"tiktoken cannot encode with this tokenizer: {reason}")
    import tiktoken

    encoding = tiktoken.Encoding(f"jaxgpt-bpe-{len(vocab)}", pat_str=spelled_out(pattern),
                                 mergeable_ranks=dict(vocab), special_tokens=dict(special_tokens))
    return TiktokenEngine(encoding)


def spelled_out(pattern: str) -> str:
    """`pattern` with \\p{L}, \\p{N} and \\s spelled out as the code points the `regex` module puts
    in them (\\S as the complement of \\s's), in the syntax of tiktoken's regex engine."""
    code_points = _code_points()
    pieces, in_brackets = [], False
    for token in _PATTERN_TOKEN.findall(pattern):
        if token in ("[", "]"):
            in_brackets = token == "["  # GPT-2's pattern nests no brackets
        elif token == r"\S" and not in_brackets:
            token = f"[^{code_points[_WHITESPACE]}]"
        elif token in code_points:
            token = code_points[token] if in_brackets else f"[{code_points[token]}]"
        pieces.append(token)
    return "".join(pieces)


@functools.cache
def _code_points() -> dict[str, str]:
    """Class → the code points the `regex` module puts in it, as ranges in tiktoken's syntax."""
    every = "".join(map(chr, itertools.chain(range(0xD800), range(0xE000, 0x110000))))
    return {cls: "".join(rf"\x{{{first:X}}}-\x{{{last:X}}}" for first, last in _runs(regex.findall(cls, every)))
            for cls in (r"\p{L}", r"\p{N}", _WHITESPACE)}


def _runs(characters: list[str]) -> list[tuple[int, int]]:
    """The code points of `characters` (in increasing order) as (first, last) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for point in map(ord, characters):
        if runs and runs[-1][1] == point - 1:
            runs[-1] = (runs[-1][0], point)
        else:
            runs.append((point, point))
    return runs
