"""Tokenizer speed and compression, side by side with the `tokenizers` library.

    python bench/bench_tokenizers.py [CORPUS] [--vocab-size 4096] [--repeat 3]

Trains each tokenizer on the whole corpus (default: tinyshakespeare in the shared/ folder
beside the repo), encodes the whole corpus, and prints a table: training time, encoding
speed with a cold and a warm per-word cache, bytes per token, and whether
decode(encode(text)) == text. Times are the best of --repeat runs. Bytes per token is always
the bytes of the whole corpus over a token count, so a higher figure is better compression.

Peers, measured in the same run with the same vocabulary size and the four special tokens
(pip install -e .[bench]); each jaxgpt kind has a target: bytes/token at least 0.99 (BPE) or
0.98 (WordPiece, unigram) × the peer's, on the footing named here.

- byte-level BPE: the library's ByteLevelBPETokenizer (GPT-2's pre-tokenizer). Both exact.
- unigram: models.Unigram with pre_tokenizers.Metaspace() (a space becomes "▁" and starts a
  word; line breaks are ordinary characters) and UnigramTrainer (seed of frequent substrings
  from a suffix array, EM with a digamma M-step, pruning to 0.75 a round). jaxgpt's unigram
  cuts text the same way, both are exact: the same footing, every token counted.
- WordPiece: models.WordPiece with BertPreTokenizer and WordPieceTrainer. BertPreTokenizer
  drops all whitespace, so the library's tokens cover only words and punctuation, while
  jaxgpt's keep every whitespace run except the single space between two words (lossless).
  The "no-space" column puts them on the same footing: tokens of whitespace pre-tokens ("\\n",
  " ", "##\\n"…) left out of the count. The library is also run with jaxgpt's pre-tokens
  (pre_tokenizers.Split with jaxgpt's pattern, whitespace runs kept); its "all" count then
  holds the single spaces that jaxgpt leaves implied, its "no-space" count does not.
  WordPieceTrainer is not WordPiece's likelihood rule: it is the BPE trainer (merge the most
  frequent pair, count(ab)) with a "##" prefix on continuations, whose vocabulary then feeds
  greedy longest-match-first encoding (tokenizers/src/models/wordpiece/trainer.rs; the Hugging
  Face course says the library "does not implement WordPiece for the training ... but uses
  BPE instead"). jaxgpt merges by count(ab) / (count(a) count(b)), as the issue asks, so the
  WordPiece target measures the rule, not the code.

The char and word tokenizers have no peer; the word tokenizer keeps no whitespace runs, so it
is not exact.
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
from jaxgpt.tokenizers import wordpiece  # noqa: E402

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / ".." / "shared/data/tinyshakespeare.txt"
TRAIN_SECONDS_TARGET = 5.0
ENCODE_MB_PER_S_TARGET = 1.0
COMPRESSION_SLACK = {"bpe": 0.01, "wordpiece": 0.02, "unigram": 0.02}  # bytes/token below the peer's
SPECIALS = list(tokenizers.BPETokenizer.SPECIALS)


def measure(name, train, encode, decode, vocab_size, text, repeat, token_strings=None):
    """Train `repeat` times, then time encoding: the first call on each freshly trained
    tokenizer is cold (empty cache), the later calls on the last one are warm. With
    `token_strings` (tokenizer, ids → strings), also count the tokens that are not whitespace."""
    train_s, cold_s = float("inf"), float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        tokenizer = train()
        train_s = min(train_s, time.perf_counter() - start)
        start = time.perf_counter()
        encode(tokenizer, text)
        cold_s = min(cold_s, time.perf_counter() - start)
    warm_s, ids = table.best_time(lambda: encode(tokenizer, text), repeat)
    words = None
    if token_strings is not None:
        words = sum(not token.removeprefix("##").isspace() for token in token_strings(tokenizer, ids))
    return {
        "tokenizer": tokenizer,
        "name": name,
        "vocab": vocab_size(tokenizer),
        "train_s": train_s,
        "cold_s": cold_s,
        "warm_s": warm_s,
        "tokens": len(ids),
        "no_space_tokens": words,
        "exact": decode(tokenizer, ids) == text,
    }


def jaxgpt_row(kind, text, vocab_size, repeat):
    strings = None
    if kind == "wordpiece":
        def strings(tokenizer, ids):
            names = [*tokenizer.special_tokens, *tokenizer.tokens]  # specials are ids 0..3
            return [names[i] for i in ids]
    return measure(
        f"jaxgpt {kind}",
        lambda: tokenizers.train_tokenizer(kind, [text], vocab_size=vocab_size),
        lambda tokenizer, text: tokenizer.encode(text),
        lambda tokenizer, ids: tokenizer.decode(ids),
        lambda tokenizer: tokenizer.vocab_size,
        text,
        repeat,
        strings,
    )


def library_bpe_row(text, vocab_size, repeat):
    """The `tokenizers` library's byte-level BPE (GPT-2's pre-tokenizer)."""
    from tokenizers import ByteLevelBPETokenizer

    def train():
        tokenizer = ByteLevelBPETokenizer()
        tokenizer.train_from_iterator([text], vocab_size=vocab_size, special_tokens=SPECIALS,
                                      show_progress=False)
        return tokenizer

    return measure("tokenizers bpe", train, lambda tokenizer, text: tokenizer.encode(text).ids,
                   lambda tokenizer, ids: tokenizer.decode(ids), lambda tokenizer: tokenizer.get_vocab_size(),
                   text, repeat)


def library_row(name, model, pre_tokenizer, decoder, trainer, text, repeat, count_no_space=False):
    """A `tokenizers.Tokenizer` of `model` trained on `text` by `trainer`."""
    from tokenizers import Tokenizer

    def train():
        tokenizer = Tokenizer(model())
        tokenizer.pre_tokenizer = pre_tokenizer
        tokenizer.decoder = decoder
        tokenizer.train_from_iterator([text], trainer())
        return tokenizer

    return measure(name, train, lambda tokenizer, text: tokenizer.encode(text).ids,
                   lambda tokenizer, ids: tokenizer.decode(ids), lambda tokenizer: tokenizer.get_vocab_size(),
                   text, repeat,
                   (lambda tokenizer, ids: [tokenizer.id_to_token(i) for i in ids]) if count_no_space else None)


def library_rows(text, vocab_size, repeat):
    """{kind: [rows]} of the `tokenizers` library: bpe, unigram and wordpiece (the first row of
    each kind is the peer of its target); {} if the library is not installed."""
    try:
        from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    except ImportError:
        return {}
    unk = tokenizers.UNK

    def wordpiece_trainer():
        return trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)

    def unigram_trainer():
        return trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, unk_token=unk,
                                       show_progress=False)

    def wordpiece_model():
        return models.WordPiece(unk_token=unk)

    jaxgpt_split = pre_tokenizers.Split(Regex(wordpiece._PRE_TOKEN.pattern), "isolated")
    return {
        "bpe": [library_bpe_row(text, vocab_size, repeat)],
        "wordpiece": [
            library_row("tokenizers wordpiece", wordpiece_model, pre_tokenizers.BertPreTokenizer(),
                        decoders.WordPiece(), wordpiece_trainer, text, repeat, count_no_space=True),
            library_row("tokenizers wordpiece, jaxgpt pre-tokens", wordpiece_model, jaxgpt_split,
                        decoders.WordPiece(), wordpiece_trainer, text, repeat, count_no_space=True),
        ],
        "unigram": [library_row("tokenizers unigram", models.Unigram, pre_tokenizers.Metaspace(),
                                decoders.Metaspace(), unigram_trainer, text, repeat)],
    }


def print_rows(rows, n_bytes):
    header = ("tokenizer", "vocab", "train s", "enc MB/s cold", "enc MB/s warm",
              "bytes/token all", "bytes/token no-space", "exact")
    lines = []
    for row in rows:
        no_space = row["no_space_tokens"]
        lines.append((
            row["name"],
            str(row["vocab"]),
            f"{row['train_s']:.2f}",
            f"{n_bytes / row['cold_s'] / 1e6:.2f}",
            f"{n_bytes / row['warm_s'] / 1e6:.2f}",
            f"{n_bytes / row['tokens']:.4f}",
            f"{n_bytes / no_space:.4f}" if no_space else "",
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


def compression_check(kind, ours, peer):
    """(name, ok, value) of `ours` bytes/token against `peer`'s: the ratio of their token
    counts (bytes/token is bytes × tokens⁻¹: more tokens for the same text = worse)."""
    count = "no_space_tokens" if kind == "wordpiece" else "tokens"
    ratio = peer[count] / ours[count]
    slack = COMPRESSION_SLACK[kind]
    footing = " (no-space tokens)" if kind == "wordpiece" else ""
    return (f"{kind} bytes/token{footing} ≥ {1 - slack:.2f} × {peer['name']}", ratio >= 1 - slack,
            f"{ratio:.4f} ×")


def print_targets(ours, library, n_bytes, text):
    """`ours` and `library`: {kind: row} and {kind: [rows]}."""
    bpe = ours["bpe"]
    encode_speed = n_bytes / bpe["cold_s"] / 1e6
    checks = [
        (f"BPE training ≤ {TRAIN_SECONDS_TARGET:g} s", bpe["train_s"] <= TRAIN_SECONDS_TARGET,
         f"{bpe['train_s']:.2f} s"),
        (f"BPE encoding ≥ {ENCODE_MB_PER_S_TARGET:g} MB/s (cold cache)",
         encode_speed >= ENCODE_MB_PER_S_TARGET, f"{encode_speed:.2f} MB/s"),
    ]
    checks += [compression_check(kind, ours[kind], library[kind][0]) for kind in COMPRESSION_SLACK
               if kind in library]
    if library:
        same = reads_library_files(library["bpe"][0], text)
        checks.append(("from_gpt2 on tokenizers' vocab.json + merges.txt encodes as tokenizers",
                       same, "identical ids" if same else "different ids"))
    print()
    for name, ok, value in checks:
        print(f"{'ok  ' if ok else 'MISS'}  {name}: {value}")
    if "wordpiece" in library:
        print("      (tokenizers' WordPieceTrainer merges the most frequent pair, count(ab), as BPE does;"
              "\n       jaxgpt's wordpiece merges by count(ab) / (count(a) count(b)): see this script's docstring)")
    for kind in COMPRESSION_SLACK:
        if kind in library:
            print(f"      {kind} training time / tokenizers': "
                  f"{ours[kind]['train_s'] / library[kind][0]['train_s']:.2f}")


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

    ours = {kind: jaxgpt_row(kind, text, args.vocab_size, args.repeat) for kind in COMPRESSION_SLACK}
    library = library_rows(text, args.vocab_size, args.repeat)
    rows = [row for kind in COMPRESSION_SLACK for row in [ours[kind], *library.get(kind, [])]]
    rows += [jaxgpt_row("char", text, None, args.repeat), jaxgpt_row("word", text, None, args.repeat)]
    print_rows(rows, n_bytes)
    if not library:
        print("\n(the `tokenizers` library is not installed: pip install -e .[bench])")
    print_targets(ours, library, n_bytes, text)


if __name__ == "__main__":
    main()
