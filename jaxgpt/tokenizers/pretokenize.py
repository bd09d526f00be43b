"""The byte-level BPE's pre-tokenizer: a `regex` pattern cuts text into pieces, and merges never
cross a piece. Shared by jaxgpt's own encoder (bpe) and the tiktoken engine (tiktoken_engine).
"""

from __future__ import annotations

import regex

# GPT-2's pre-tokenizer: contractions, letter runs, digit runs and other-symbol runs, each
# with at most one leading space, then whitespace. Merges never cross these pieces.
GPT2_SPLIT_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def compile_split_pattern(pattern: str) -> regex.Pattern:
    try:
        compiled = regex.compile(pattern)
    except (regex.error, TypeError) as err:
        raise ValueError(f"split pattern {pattern!r} is not a valid regular expression: {err}") \
            from None
    if compiled.groups:
        raise ValueError(f"split pattern {pattern!r} has capturing groups; write (?:...) instead")
    return compiled


def split(splitter: regex.Pattern, text: str) -> list[str]:
    """Pieces of `text` by `splitter`; text it does not match becomes pieces too, so that no
    character is ever dropped."""
    pieces = splitter.findall(text)
    if sum(map(len, pieces)) == len(text):  # matches never overlap: equal lengths = covered
        return pieces
    pieces, end = [], 0
    for match in splitter.finditer(text):
        pieces += [text[end:match.start()], match.group()]
        end = match.end()
    pieces.append(text[end:])
    return [piece for piece in pieces if piece]
