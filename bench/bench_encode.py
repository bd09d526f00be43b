"""Byte-level BPE encoding speed in one process: jaxgpt's encoder beside the tiktoken engine.

    python bench/bench_encode.py [CORPUS] [--vocab-size 4096] [--mb 2] [--repeat 3] [--tiktoken-gpt2]

Trains a BPE tokenizer on the corpus's first MB (default: tinyshakespeare in the shared/ folder
beside the repo), then encodes its first --mb MB with jaxgpt's encoder (cold: a fresh per-piece
cache; warm: a second pass) and with the tiktoken engine (pip install -e .[tiktoken]), and prints
MB/s (best of --repeat), whether the ids are the same, and the engine's one-off build time. With
--tiktoken-gpt2, tiktoken's own GPT-2 encoding is timed too, as a reference for tiktoken's speed
on another vocabulary: it downloads its files the first time, so it needs the network once.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import table  # noqa: E402  (bench/table.py: this script's folder is on sys.path)

from jaxgpt.tokenizers import BPETokenizer  # noqa: E402

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / ".." / "shared/data/tinyshakespeare.txt"
TRAIN_BYTES = 1 << 20


def fresh(tokenizer, engine):
    return BPETokenizer(tokenizer.vocab, tokenizer.merges, tokenizer.special_tokens, tokenizer.pattern,
                        engine=engine)


def cold_seconds(tokenizer, text):
    start = time.perf_counter()
    tokenizer.encode(text)
    return time.perf_counter() - start


def rows(tokenizer, text, repeat, with_gpt2):
    """(name, seconds, ids) of each way of encoding `text`, and jaxgpt's ids."""
    cold = min(cold_seconds(fresh(tokenizer, "jaxgpt"), text) for _ in range(repeat))
    pure = fresh(tokenizer, "jaxgpt")
    warm, reference = table.best_time(lambda: pure.encode(text), repeat)
    found = [("jaxgpt encoder, cold", cold, reference), ("jaxgpt encoder, warm", warm, reference)]
    try:
        start = time.perf_counter()
        engine = fresh(tokenizer, "tiktoken")
        built = time.perf_counter() - start
    except ValueError as err:
        print(f"the tiktoken engine cannot run: {err}")
        return found, reference
    seconds, ids = table.best_time(lambda: engine.encode(text), repeat)
    found.append(("tiktoken engine", seconds, ids))
    print(f"the tiktoken engine was built in {built:.2f} s (once per process and tokenizer)")
    if with_gpt2:
        import tiktoken

        try:
            gpt2 = tiktoken.get_encoding("gpt2")
        except OSError as err:  # requests' errors are OSErrors: no network and no cached files
            print(f"tiktoken's gpt2 encoding is not available: {type(err).__name__}")
            return found, reference
        seconds, _ = table.best_time(lambda: gpt2.encode_ordinary(text), repeat)
        found.append(("tiktoken's gpt2 (another vocabulary)", seconds, None))
    return found, reference


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", nargs="?", default=str(DEFAULT_CORPUS))
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--mb", type=float, default=2.0, help="MB of the corpus to encode")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiktoken-gpt2", action="store_true", help="also time tiktoken's GPT-2 encoding")
    args = parser.parse_args()
    corpus = Path(args.corpus).read_text(encoding="utf-8")
    text = corpus.encode("utf-8")[: int(args.mb * 1e6)].decode("utf-8", "ignore")
    n_bytes = len(text.encode("utf-8"))
    tokenizer = BPETokenizer.train([corpus[:TRAIN_BYTES]], vocab_size=args.vocab_size)
    print(f"{Path(args.corpus).name}: {n_bytes / 1e6:.2f} MB encoded, vocabulary {tokenizer.vocab_size}")
    found, reference = rows(tokenizer, text, args.repeat, args.tiktoken_gpt2)
    warm = found[1][1]
    table.print_table(
        ("encoder", "MB/s", "× jaxgpt warm", "same ids"),
        [(name, f"{n_bytes / seconds / 1e6:.2f}", f"{warm / seconds:.2f}",
          "-" if ids is None else "yes" if ids == reference else "NO")
         for name, seconds, ids in found])


if __name__ == "__main__":
    main()
