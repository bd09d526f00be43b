"""Rebuilding the damaged shards of a prepared text corpus, and only those.

Each shard's entry in meta.json records where it starts in the corpus's stream of documents
(`start`: the document's number and how many of its tokens, its leading <|eos|> included, the
shard before holds). A shard found damaged (missing, of the wrong size, holding an id outside
the vocabulary, or not matching its checksum) is made again from there: the documents before it
are read but not encoded, its tokens are encoded and written beside it, and the new file takes
its place once its checksum is the one recorded. A cache this cannot mend (records, another
version, a damaged meta.json or tokenizer, a shard whose tokens come out otherwise) is left to
the caller, which builds it anew.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt import tokenizers
from jaxgpt.data.encode import default_workers, encoded_stream
from jaxgpt.data.shards import CHECKSUM_BYTES, check_tokens
from jaxgpt.data.sources import DocumentReader, Source
from jaxgpt.data.split import SPLITS
from jaxgpt.data.stream import corpus_items
from jaxgpt.data_config import DataConfig
from jaxgpt.tokenizers import Tokenizer

TEXT_VERSION = 3  # the version whose text splits are shards


def damaged_shards(directory: Path, meta: dict[str, Any], vocab_size: int) -> list[tuple[str, int, str]]:
    """(split, shard number, what is wrong) of each damaged shard of a text cache."""
    dtype = np.dtype(meta["dtype"])
    found = []
    for split in SPLITS:
        for number, shard in enumerate(meta["splits"][split]["shards"]):
            path = directory / shard["file"]
            if not path.is_file() or path.stat().st_size != shard["tokens"] * dtype.itemsize:
                problem = f"is missing or has the wrong size for {shard['tokens']} tokens"
            else:
                problem = check_tokens(path, shard["tokens"], dtype, shard["blake2b"], vocab_size)
            if problem:
                found.append((split, number, problem))
    return found


def rebuild_damaged(directory: Path, settings: DataConfig, source: Source, val_source: Source | None) -> bool:
    """Rebuild the damaged shards of the text cache `directory`, with a warning that names them;
    False when it cannot be mended so (nothing is then changed but shards that came out right)."""
    meta, tokenizer = _readable(directory)
    if meta is None or tokenizer is None:
        return False
    damaged = damaged_shards(directory, meta, tokenizer.vocab_size)
    shards = {split: meta["splits"][split]["shards"] for split in SPLITS}
    if not damaged or any(number and not shards[split][number].get("start") for split, number, _ in damaged):
        return False
    names = ", ".join(f"{shards[split][number]['file']} {problem}" for split, number, problem in damaged)
    warnings.warn(f"the token cache {directory} is damaged ({names}): rebuilding only the damaged shard(s) "
                  f"({len(damaged)} of {sum(map(len, shards.values()))})", stacklevel=3)
    return all(_rewrite(directory, split, number, shards[split][number], np.dtype(meta["dtype"]), tokenizer,
                        settings, source, val_source) for split, number, _ in damaged)


def _readable(directory: Path) -> tuple[dict[str, Any] | None, Tokenizer | None]:
    """(meta, tokenizer) of a text cache of this version whose meta.json and tokenizer are
    intact; (None, None) otherwise."""
    try:
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
        raw = (directory / "tokenizer.json").read_bytes()
        if (meta.get("version") != TEXT_VERSION or "records" in meta
                or hashlib.sha256(raw).hexdigest() != meta["tokenizer"]["sha256"]
                or not all("shards" in meta["splits"][split] for split in SPLITS)):
            return None, None
        return meta, tokenizers.load(directory / "tokenizer.json")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, None


def _rewrite(directory: Path, split: str, number: int, shard: dict[str, Any], dtype: np.dtype, tokenizer: Tokenizer,
             settings: DataConfig, source: Source, val_source: Source | None) -> bool:
    """Encode shard `number` of `split` again from where it starts; put it in place when its
    tokens are the ones recorded (count and checksum)."""
    item, skip = shard["start"] if number else (0, 0)  # the first shard starts with its split
    items = islice(corpus_items(source, val_source, settings, DocumentReader(settings)), item, None)
    documents = ((split, document) for part, document in items if part == split)
    encoded = encoded_stream(documents, tokenizer, dtype, workers=settings.workers or default_workers(),
                             batch_chars=settings.encode_batch_bytes)
    eos = np.array([tokenizer.eos_id], dtype)
    digest, written, needed = hashlib.blake2b(digest_size=CHECKSUM_BYTES), 0, shard["tokens"]
    temporary = directory / f".{shard['file']}.rebuilt"
    try:
        with open(temporary, "wb") as file:
            for count, (_, ids, _, bad) in enumerate(encoded):
                if bad is not None:
                    break
                tokens = ids if not (number or count) else np.concatenate([eos, ids])  # its split's first: no <|eos|>
                tokens, skip = tokens[skip:needed - written + skip], 0
                file.write(tokens.tobytes())
                digest.update(tokens)
                written += len(tokens)
                if written == needed:
                    break
            file.flush()
            os.fsync(file.fileno())
    finally:
        encoded.close()
    if written != needed or digest.hexdigest() != shard["blake2b"]:
        temporary.unlink(missing_ok=True)
        return False
    os.replace(temporary, directory / shard["file"])
    return True
