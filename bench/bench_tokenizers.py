"""Tokenizer speed and compression, side by side with the `tokenizers` library.

    python bench/bench_tokenizers.py [CORPUS] [--vocab-size 4096] [--repeat 3]

Trains each tokenizer on the whole corpus (default: tinyshakespeare in the shared/ folder
beside the repo), encodes the whole corpus, and prints a table: training time, encoding
speed with a cold and a warm per-word cache, bytes per token, and whether
decode(encode(text)) == text. Times are the best of --repeat runs. The byte-level BPE
targets are checked against the `tokenizers` library's byte-level BPE measured in the same
run, trained on the same text with the same vocabulary size and special tokens
(pip install -e .[bench]). WordPiece and unigram use the same vocabulary size as BPE. The word
tokenizer keeps no whitespace runs, so it is not exact.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import table  # noqa: E402  (bench/table.py: this script's folder is on sys.path)

from jaxgpt import tokenizers  # noqa: E402

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / ".." / "shared/data/tinyshakespeare.txt"
TRAIN_SECONDS_TARGET = 5.0
ENCODE_MB_PER_S_TARGET = 1.0
COMPRESSION_SLACK = 0.01  # bytes/token may be at most 1% below the library's


def measure(name, train, encode, decode, vocab_size, text, repeat):
    """Train `repeat` times, then time encoding: the first call on each freshly trained
    tokenizer is cold (empty cache), the later calls on the last one are warm."""
    train_s, cold_s = float("inf"), float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        tokenizer = train()
        train_s = min(train_s, time.perf_counter() - start)
        start = time.perf_counter()
        encode(tokenizer, text)
        cold_s = min(cold_s, time.perf_counter() - start)
    warm_s, ids = table.best_time(lambda: encode(tokenizer, text), repeat)
    return {
        "tokenizer": tokenizer,
        "name": name,
        "vocab": vocab_size(tokenizer),
        "train_s": train_s,
        "cold_s": cold_s,
        "warm_s": warm_s,
        "tokens": len(ids),
        "exact": decode(tokenizer, ids) == text,
    }


def jaxgpt_row(kind, text, vocab_size, repeat):
    return measure(
        f"jaxgpt {kind}",
        lambda: tokenizers.train_tokenizer(kind, [text], vocab_size=vocab_size),
        lambda tokenizer, text: tokenizer.encode(text),
        lambda tokenizer, ids: tokenizer.decode(ids),
        lambda tokenizer: tokenizer.vocab_size,
        text,
        repeat,
    )


def library_row(text, vocab_size, repeat):
    """The `tokenizers` library's byte-level BPE (GPT-2's pre-tokenizer), or None."""
    try:
        from tokenizers import ByteLevelBPETokenizer
    except ImportError:
        return None

    def train():
        tokenizer = ByteLevelBPETokenizer()
        tokenizer.train_from_iterator(
            [text],
            vocab_size=vocab_size,
            special_tokens=list(tokenizers.BPETokenizer.SPECIALS),
            show_progress=False,
        )
        return tokenizer

    return measure(
        "tokenizers bpe",
        train,
        lambda tokenizer, text: tokenizer.encode(text).ids,
        lambda tokenizer, ids: tokenizer.decode(ids),
        lambda tokenizer: tokenizer.get_vocab_size(),
        text,
        repeat,
    )


def print_rows(rows, n_bytes):
    header = ("tokenizer", "vocab", "train s", "enc MB/s cold", "enc MB/s warm",
              "bytes/token", "exact")
    lines = []
    for row in rows:
        lines.append((
            row["name"],
            str(row["vocab"]),
            f"{row['train_s']:.2f}",
            f"{n_bytes / row['cold_s'] / 1e6:.2f}",
            f"{n_bytes / row['warm_s'] / 1e6:.2f}",
            f"{n_bytes / row['tokens']:.4f}",
            "yes" if row["exact"] else "no",
        ))
    table.print_table(header, lines)


def reads_library_files(library, text):
    """Whether BPETokenizer.from_gpt2 reads the vocab.json + merges.txt that the library
    writes (GPT-2's format) into a tokenizer that encodes `text` exactly as the library."""
    with tempfile.TemporaryDirectory() as directory:
        library["tokenizer"].save_model(directory)
        ours = tokenizers.BPETokenizer.from_gpt2(f"{directory}/vocab.json",
                                                 f"{directory}/merges.txt")
    return ours.encode(text) == library["tokenizer"].encode(text).ids


def print_targets(ours, library, n_bytes, text):
    encode_speed = n_bytes / ours["cold_s"] / 1e6
    checks = [
        (f"BPE training ≤ {TRAIN_SECONDS_TARGET:g} s", ours["train_s"] <= TRAIN_SECONDS_TARGET,
         f"{ours['train_s']:.2f} s"),
        (f"BPE encoding ≥ {ENCODE_MB_PER_S_TARGET:g} MB/s (cold cache)",
         encode_speed >= ENCODE_MB_PER_S_TARGET, f"{encode_speed:.2f} MB/s"),
    ]
    if library is not None:
        # Bytes per token is tokens⁻¹ × bytes: more tokens for the same text = worse.
        ratio = library["tokens"] / ours["tokens"]
        checks.append((
            f"BPE bytes/token ≥ {1 - COMPRESSION_SLACK:.2f} × tokenizers'",
            ratio >= 1 - COMPRESSION_SLACK,
            f"{ratio:.4f} ×",
        ))
        same = reads_library_files(library, text)
        checks.append(("from_gpt2 on tokenizers' vocab.json + merges.txt encodes as tokenizers",
                       same, "identical ids" if same else "different ids"))
    print()
    for name, ok, value in checks:
        print(f"{'ok  ' if ok else 'MISS'}  {name}: {value}")
    if library is not None:
        print(f"      BPE training time / tokenizers': {ours['train_s'] / library['train_s']:.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", nargs="?", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if not args.corpus.is_file():
        parser.error(f"no corpus at {args.corpus}; pass the path of a text file")
    text = args.corpus.read_text(encoding="utf-8")
    n_bytes = len(text.encode("utf-8"))
    print(f"corpus {args.corpus.resolve()}: {n_bytes / 1e6:.2f} MB; "
          f"BPE, wordpiece and unigram vocab_size {args.vocab_size}; best of {args.repeat}\n")

    ours = jaxgpt_row("bpe", text, args.vocab_size, args.repeat)
    library = library_row(text, args.vocab_size, args.repeat)
    rows = [ours, *([library] if library else []),
            jaxgpt_row("wordpiece", text, args.vocab_size, args.repeat),
            jaxgpt_row("unigram", text, args.vocab_size, args.repeat),
            jaxgpt_row("char", text, None, args.repeat),
            jaxgpt_row("word", text, None, args.repeat)]
    print_rows(rows, n_bytes)
    if library is None:
        print("\n(the `tokenizers` library is not installed: pip install -e .[bench])")
    print_targets(ours, library, n_bytes, text)


if __name__ == "__main__":
    main()
