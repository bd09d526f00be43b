"""Examples in the token cache: the tokens of each example, which of them the loss falls on,
and where each example came from.

For a split of a records corpus the cache holds, beside `{split}.bin` (every example's
tokens, one after another, each ending with <|eos|>):

    {split}.mask.bin      uint8, one per token: 1 on completion tokens and the <|eos|> after
                          them (the targets the loss counts), 0 on prompt tokens
    {split}.examples.bin  int64 (N, 3): each example's first token, and its record's file
                          index and line (or record) number

each with its BLAKE2b-128 checksum in meta.json, checked when the cache is opened.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.data.records import Record, Turn
from jaxgpt.errors import DataError
from jaxgpt.tokenizers import Tokenizer

CHECKSUM_BYTES = 16
EXAMPLE_COLUMNS = 3  # start, file, number


def encode_turns(turns: Sequence[Turn], tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of an example: prompt, completion and <|eos|> of each turn; the mask is 1 on
    the completion and its <|eos|>. A turn with an empty completion (a prompt to answer) adds
    its prompt only."""
    ids: list[int] = []
    mask: list[int] = []
    for prompt, completion in turns:
        prompt_ids = tokenizer.encode(prompt)
        ids += prompt_ids
        mask += [0] * len(prompt_ids)
        if completion:
            completion_ids = tokenizer.encode(completion) + [tokenizer.eos_id]
            ids += completion_ids
            mask += [1] * len(completion_ids)
    return np.asarray(ids, np.int64), np.asarray(mask, np.uint8)


def write_examples(directory: Path, split: str, examples: Sequence[tuple[Record, list[Turn]]],
                   tokenizer: Tokenizer, dtype: type) -> dict[str, Any]:
    """Write a split's token, mask and example files; return its counts and checksums."""
    tokens, masks, rows = [], [], []
    start = completion_bytes = text_bytes = 0
    for record, turns in examples:
        ids, mask = encode_turns(turns, tokenizer)
        if len(ids) and not 0 <= ids.min() <= ids.max() < tokenizer.vocab_size:
            raise DataError(f"the {tokenizer.kind} tokenizer gave an id outside its {tokenizer.vocab_size} ids for "
                            f"{record.where}; the tokenizer is inconsistent: train it anew or use another")
        tokens.append(ids.astype(dtype))
        masks.append(mask)
        rows.append((start, record.file, record.number))
        start += len(ids)
        completion_bytes += sum(len(completion.encode("utf-8")) for _, completion in turns)
        text_bytes += sum(len((prompt + completion).encode("utf-8")) for prompt, completion in turns)
    arrays = {
        "": np.concatenate(tokens) if tokens else np.empty(0, dtype),
        ".mask": np.concatenate(masks) if masks else np.empty(0, np.uint8),
        ".examples": np.asarray(rows, np.int64).reshape(-1, EXAMPLE_COLUMNS),
    }
    checksums = {}
    for suffix, array in arrays.items():
        (directory / f"{split}{suffix}.bin").write_bytes(array.tobytes())
        checksums[f"blake2b{suffix.replace('.', '_')}"] = _checksum(array)
    mask = arrays[".mask"]
    return {"tokens": start, "bytes": text_bytes, "documents": len(rows), "completion_tokens": int(mask.sum()),
            "completion_bytes": completion_bytes, **checksums}


@dataclasses.dataclass(frozen=True)
class Examples:
    """A split's examples (read-only memory maps): example i is tokens[starts[i]:starts[i+1]],
    its loss mask mask[starts[i]:starts[i+1]]; origins[i] = (file index, number)."""

    tokens: np.ndarray
    mask: np.ndarray
    starts: np.ndarray  # (N + 1,)
    origins: np.ndarray  # (N, 2)
    files: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        span = slice(int(self.starts[i]), int(self.starts[i + 1]))
        return np.asarray(self.tokens[span]), np.asarray(self.mask[span])

    def where(self, i: int) -> str:
        file, number = (int(v) for v in self.origins[i])
        path = self.files[file]
        return f"{path} record {number}" if path.lower().endswith(".json") else f"{path}:{number}"


def open_examples(directory: Path, split: str, tokens: np.ndarray, meta: dict[str, Any]) -> Examples | str:
    """A split's Examples, or what is wrong with its files (a missing file, a wrong size or
    checksum, starts that do not fit the tokens)."""
    counts = meta["splits"][split]
    arrays = {}
    for suffix, dtype, width in ((".mask", np.uint8, 1), (".examples", np.int64, EXAMPLE_COLUMNS)):
        path = directory / f"{split}{suffix}.bin"
        size = (counts["tokens"] if suffix == ".mask" else counts["documents"]) * width
        if not path.is_file() or path.stat().st_size != size * np.dtype(dtype).itemsize:
            return f"{path.name} is missing or has the wrong size"
        array = np.fromfile(path, dtype) if size else np.empty(0, dtype)
        if _checksum(array) != counts.get(f"blake2b{suffix.replace('.', '_')}"):
            return f"{path.name} does not match its checksum"
        arrays[suffix] = array
    rows = arrays[".examples"].reshape(-1, EXAMPLE_COLUMNS)
    starts = np.append(rows[:, 0], counts["tokens"])
    if len(rows) and (starts[0] != 0 or np.any(np.diff(starts) < 2)):
        return f"{split}.examples.bin holds example starts that do not fit {split}.bin"
    return Examples(tokens, arrays[".mask"], starts, rows[:, 1:], tuple(meta["records"]["files"]))


def _checksum(array: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=CHECKSUM_BYTES).hexdigest()
