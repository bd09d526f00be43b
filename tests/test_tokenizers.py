"""Tokenizers: exact round trips, BPE against naive references, files, and bad input."""

import functools
import json
from collections import Counter

import numpy as np
import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxgpt import tokenizers
from jaxgpt.tokenizers import (
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    WordTokenizer,
    load,
    train_tokenizer,
)

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox doesn't.\n",
    "Ünïcödé tëxt: naïve café, 東京タワー, Ελληνικά, emoji 🙂🙂 and 👩‍👩‍👧 too!\r\n",
    "Numbers 1234 and 3.14159, tabs\tand  double  spaces,\n\nnew paragraphs.\n",
]

KINDS = ["char", "word", "bpe"]

fast = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def bpe():
    return train_tokenizer("bpe", CORPUS, vocab_size=400)


@functools.cache
def trained(kind):
    """A tokenizer of `kind` trained on CORPUS (BPE with a few dozen merges)."""
    return train_tokenizer(kind, CORPUS, vocab_size=300 if kind == "bpe" else None)


# --- independent references ---------------------------------------------------------


def fuse(seq, pair, new):
    """Fuse each occurrence of `pair`, scanning left to right."""
    out, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            out.append(new)
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


def naive_bpe_training(texts, vocab_size, pattern=GPT2_PATTERN):
    """Textbook BPE: recount every pair of the whole corpus before each merge.

    Returns the merges as byte pairs. Tie-break: most frequent, then smallest id pair.
    """
    word_counts = Counter()
    for text in texts:
        word_counts.update(piece.encode() for piece in regex.findall(pattern, text))
    tokens = [bytes([b]) for b in range(256)]
    sequences = {word: list(word) for word in word_counts}
    merges = []
    while len(tokens) + 3 < vocab_size:
        pair_counts = Counter()
        for word, seq in sequences.items():
            for pair in zip(seq, seq[1:], strict=False):
                pair_counts[pair] += word_counts[word]
        if not pair_counts:
            break
        best = min(pair_counts, key=lambda pair: (-pair_counts[pair], pair))
        merged = tokens[best[0]] + tokens[best[1]]
        if merged in tokens:
            new = tokens.index(merged)
        else:
            new = len(tokens)
            tokens.append(merged)
        merges.append((tokens[best[0]], tokens[best[1]]))
        sequences = {word: fuse(seq, best, new) for word, seq in sequences.items()}
    return merges


def naive_bpe_encoding(text, merges, vocab, pattern=GPT2_PATTERN):
    """Apply the lowest-rank applicable merge (leftmost on ties) until none applies."""
    rank = {}
    for r, pair in enumerate(merges):
        rank.setdefault(pair, r)
    ids = []
    for piece in regex.findall(pattern, text):
        seq = [bytes([b]) for b in piece.encode()]
        while True:
            candidates = [
                (rank[(seq[i], seq[i + 1])], i)
                for i in range(len(seq) - 1)
                if (seq[i], seq[i + 1]) in rank
            ]
            if not candidates:
                break
            _, i = min(candidates)
            seq[i : i + 2] = [seq[i] + seq[i + 1]]
        ids += [vocab[token] for token in seq]
    return ids


def gpt2_char(byte):
    """GPT-2's printable stand-in of a byte, from its definition: printable Latin-1 bytes
    (33-126, 161-172, 174-255) stand for themselves, the other 68 for U+0100, U+0101, ...
    in byte order."""
    hidden = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b)]
    return chr(byte) if byte not in hidden else chr(0x100 + hidden.index(byte))


# --- byte-level BPE: exact round trips ----------------------------------------------

TRICKY = [
    "",
    "\x00",
    "a\x00b\x00\x00",
    "line one\r\nline two\r\n\r\n",
    "e\u0301 a\u0308\u0304 combining marks",
    "👩‍👩‍👧 family, 🇫🇷 flag, 👍🏽 skin tone",
    "   leading and trailing   ",
    "\t\v\f\u2028\u00a0 odd spaces",
    "mixed 東京 Ελληνικά עברית العربية",
    "\U0010ffff\ufeff\ufffd",
    "<|eos|> is ordinary text here",
]


@pytest.mark.parametrize("text", TRICKY)
def test_bpe_round_trips_tricky_text(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


@fast
@given(text=st.text())
def test_bpe_round_trips_any_unicode(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


@fast
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
def test_bpe_round_trips_with_a_pattern_that_skips_text(text):
    # The pattern matches letter runs only: the text between matches must survive too.
    tokenizer = BPETokenizer.train(["aa bb aab"], vocab_size=262, pattern=r"\p{L}+")
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_bpe_round_trips_after_the_encode_cache_starts_over(bpe, monkeypatch):
    monkeypatch.setattr(tokenizers.bpe, "_ENCODE_CACHE_LIMIT", 2)
    fresh = tokenizers.from_dict(bpe.to_dict())
    text = " ".join(CORPUS)
    assert fresh.encode(text) == bpe.encode(text)
    assert len(fresh._cache) <= 2


def test_bpe_never_needs_unk(bpe):
    assert bpe.unk_id is None
    assert bpe.count_unknown("never seen: ☃ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢") == 0


# --- byte-level BPE: merges and encoding against the naive references ---------------


def test_bpe_merges_worked_example():
    # "aaabdaaabac" is one piece. Counts: aa 4, ab 2 → merge (a, a). Then "aa a b d aa a b
    # a c": (aa, a) and (a, b) tie at 2, and (97, 98) < (256, 97) → (a, b). Then (aa, ab) 2.
    # Then "aaab d aaab a c": all pairs count 1, the smallest ids are (97, 99) → (a, c).
    tokenizer = train_tokenizer("bpe", "aaabdaaabac", vocab_size=256 + 4 + 3)
    assert tokenizer.merges == [(b"a", b"a"), (b"a", b"b"), (b"aa", b"ab"), (b"a", b"c")]
    assert tokenizer.vocab[b"aaab"] == 258
    assert tokenizer.encode("aaabdaaabac") == [258, ord("d"), 258, 259]
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (260, 261, 262)
    assert tokenizer.vocab_size == 263


def test_bpe_stops_when_no_pair_is_left():
    # Documents are separate: "ab" twice gives one pair, so one merge, not (ab, ab).
    tokenizer = train_tokenizer("bpe", ["ab", "ab"], vocab_size=1000)
    assert tokenizer.merges == [(b"a", b"b")]
    assert tokenizer.vocab_size == 256 + 1 + 3


@fast
@given(
    texts=st.lists(st.text(alphabet="aab c\n'é", max_size=30), min_size=1, max_size=4),
    extra=st.integers(1, 40),
)
def test_bpe_merges_equal_naive_training(texts, extra):
    if not "".join(texts):
        return
    tokenizer = BPETokenizer.train(texts, vocab_size=259 + extra)
    assert tokenizer.merges == naive_bpe_training(texts, 259 + extra)


def test_bpe_merges_equal_naive_training_on_prose():
    tokenizer = BPETokenizer.train(CORPUS, vocab_size=400)
    assert tokenizer.merges == naive_bpe_training(CORPUS, 400)


@fast
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=60))
def test_bpe_encoding_equals_naive_encoding(bpe, text):
    assert bpe.encode(text) == naive_bpe_encoding(text, bpe.merges, bpe.vocab)


@st.composite
def arbitrary_merge_lists(draw):
    """Merge lists whose priorities need not follow any training order: each merge fuses
    two tokens that exist already, so later merges may outrank pairs they create."""
    tokens = [bytes([b]) for b in range(256)]
    merges = []
    for _ in range(draw(st.integers(0, 12))):
        left = draw(st.sampled_from([t for t in tokens if t[:1] in b"ab" or len(t) > 1]))
        right = draw(st.sampled_from([t for t in tokens if t[:1] in b"ab" or len(t) > 1]))
        merges.append((left, right))
        if left + right not in tokens:
            tokens.append(left + right)
    draw(st.randoms()).shuffle(merges)
    return {token: i for i, token in enumerate(tokens)}, merges


@fast
@given(vocab_and_merges=arbitrary_merge_lists(), text=st.text(alphabet="ab ", max_size=30))
def test_bpe_encoding_equals_naive_encoding_for_any_merge_order(vocab_and_merges, text):
    vocab, merges = vocab_and_merges
    tokenizer = BPETokenizer(vocab, merges, {})
    assert tokenizer.encode(text) == naive_bpe_encoding(text, merges, vocab)


def test_bpe_fuses_the_leftmost_occurrence_first():
    vocab = {bytes([b]): b for b in range(256)} | {b"aa": 256}
    tokenizer = BPETokenizer(vocab, [(b"a", b"a")], {})
    assert tokenizer.encode("aaa") == [256, ord("a")]


def test_bpe_repeated_merge_keeps_its_first_priority():
    vocab = {bytes([b]): b for b in range(256)} | {b"ab": 256, b"bc": 257}
    tokenizer = BPETokenizer(vocab, [(b"a", b"b"), (b"b", b"c"), (b"a", b"b")], {})
    assert tokenizer.encode("abc") == [256, ord("c")]


def test_bpe_longest_special_token_wins():
    vocab = {bytes([b]): b for b in range(256)}
    tokenizer = BPETokenizer(vocab, [], {"<|x|>": 256, "<|x|>!": 257})
    assert tokenizer.encode("<|x|>!<|x|>", allow_special=True) == [257, 256]


def test_bpe_compresses_its_training_text(bpe):
    text = "".join(CORPUS)
    assert len(bpe.encode(text)) < len(text.encode()) / 2


# --- special tokens in user text ----------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_special_text_is_ordinary_unless_allowed(kind):
    tokenizer = trained(kind)
    text = "fox <|eos|> dog"
    plain = tokenizer.encode(text)
    assert tokenizer.eos_id not in plain
    allowed = tokenizer.encode(text, allow_special=True)
    assert allowed.count(tokenizer.eos_id) == 1
    assert tokenizer.decode(allowed, keep_special=True) == text
    assert "<|eos|>" not in tokenizer.decode(allowed)


def test_bpe_special_text_decodes_back_either_way(bpe):
    text = "a<|eos|>b<|pad|><|bos|>"
    assert bpe.decode(bpe.encode(text)) == text
    allowed = bpe.encode(text, allow_special=True)
    assert allowed[1:2] + allowed[-2:] == [bpe.eos_id, bpe.pad_id, bpe.bos_id]
    assert bpe.decode(allowed, keep_special=True) == text
    assert bpe.decode(allowed) == "ab"


@pytest.mark.parametrize("kind", KINDS)
def test_bos_eos_flags_and_batch(kind):
    tokenizer = trained(kind)
    plain = tokenizer.encode("the fox")
    assert tokenizer.encode("the fox", bos=True, eos=True) == [
        tokenizer.bos_id, *plain, tokenizer.eos_id
    ]
    assert tokenizer.encode_batch(["the fox", "dog"], eos=True) == [
        tokenizer.encode("the fox", eos=True), tokenizer.encode("dog", eos=True)
    ]
    assert len({tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id}) == 3
    assert isinstance(tokenizer, Tokenizer)


# --- char tokenizer -----------------------------------------------------------------


def test_char_worked_example():
    tokenizer = CharTokenizer.train("hello")
    # Specials 0..3, then the characters by code point: e 4, h 5, l 6, o 7.
    assert tokenizer.vocab_size == 8
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.unk_id) == (0, 1, 2, 3)
    assert tokenizer.encode("help!") == [5, 4, 6, 3, 3]
    assert tokenizer.count_unknown("help!") == 2
    assert tokenizer.count_unknown("hello") == 0
    assert tokenizer.encode("he", bos=True, eos=True) == [0, 5, 4, 1]
    assert tokenizer.decode([0, 5, 4, 1, 2, 2]) == "he"
    assert tokenizer.decode([0, 5, 4, 1], keep_special=True) == "<|bos|>he<|eos|>"
    assert tokenizer.decode(tokenizer.encode("help!"), keep_special=True) == "hel<|unk|><|unk|>"


def test_char_vocab_size_keeps_the_most_frequent_characters():
    tokenizer = CharTokenizer.train(["bbab", "aac", "d"], vocab_size=6)
    assert tokenizer.tokens == ("a", "b")
    assert tokenizer.count_unknown("abcd") == 2


def test_char_count_unknown_agrees_with_a_naive_count():
    tokenizer = CharTokenizer.train(CORPUS)
    text = "Zebra ☃ quick #42 ẞ"
    seen = set("".join(CORPUS))
    assert tokenizer.count_unknown(text) == sum(ch not in seen for ch in text)
    assert tokenizer.encode(text).count(tokenizer.unk_id) == tokenizer.count_unknown(text)


def test_char_round_trips_its_training_text():
    text = "".join(CORPUS)
    tokenizer = CharTokenizer.train(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.vocab_size == 4 + len(set(text))


def test_char_count_unknown_skips_allowed_specials():
    tokenizer = CharTokenizer.train("ab")
    assert tokenizer.count_unknown("a<|eos|>b") == len("<|eos|>")
    assert tokenizer.count_unknown("a<|eos|>b", allow_special=True) == 0


# --- word tokenizer -----------------------------------------------------------------

PROSE = [
    'He said, "Stop!" (Then he left.)',
    "It's 3.14 today; well-known facts: the end...",
    "First line.\nSecond line?\n\nNew paragraph!",
    "“Curly,” she said — ‘quietly’.",
]


@pytest.mark.parametrize("text", PROSE)
def test_word_decode_restores_prose_spacing(text):
    tokenizer = WordTokenizer.train(PROSE)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_word_tokens_are_words_and_marks():
    tokenizer = WordTokenizer.train("the cat, the dog. The END")
    # Specials 0..3, then in code-point order: "," 4, "." 5, END 6, The 7, cat 8, dog 9, the 10.
    assert tokenizer.tokens == (",", ".", "END", "The", "cat", "dog", "the")
    assert tokenizer.encode("the dog, the cow!") == [10, 9, 4, 10, 3, 3]
    assert tokenizer.count_unknown("the dog, the cow!") == 2
    assert tokenizer.decode(tokenizer.encode("the cow", bos=True), keep_special=True) == (
        "<|bos|> the <|unk|>"
    )


def test_word_vocab_size_keeps_the_most_frequent_words():
    tokenizer = WordTokenizer.train(["a a a b b c d"], vocab_size=6)
    assert tokenizer.tokens == ("a", "b")
    assert tokenizer.encode("c a") == [tokenizer.unk_id, 4]


# --- files --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_gives_an_identical_tokenizer(kind, tmp_path):
    tokenizer = trained(kind)
    tokenizer.save(tmp_path / "tokenizer.json")
    loaded = load(tmp_path / "tokenizer.json")
    assert type(loaded) is type(tokenizer)
    assert loaded == tokenizer
    text = "".join(CORPUS) + " unseen ☃ <|eos|>"
    for allow_special in (False, True):
        assert loaded.encode(text, allow_special=allow_special) == tokenizer.encode(
            text, allow_special=allow_special
        )
    ids = tokenizer.encode(text, allow_special=True)
    assert loaded.decode(ids, keep_special=True) == tokenizer.decode(ids, keep_special=True)
    data = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert (data["format"], data["version"], data["kind"]) == ("jaxgpt-tokenizer", 1, kind)


def test_bpe_with_a_custom_pattern_keeps_it_through_save(tmp_path):
    tokenizer = BPETokenizer.train(CORPUS, vocab_size=300, pattern=r"\S+|\s+")
    tokenizer.save(tmp_path / "t.json")
    assert load(tmp_path / "t.json").pattern == r"\S+|\s+"


@pytest.fixture
def gpt2_files(tmp_path):
    """A hand-made GPT-2-style vocab.json + merges.txt; byte ids are shuffled like GPT-2's."""
    order = list(range(256))
    np.random.default_rng(1).shuffle(order)
    vocab = {gpt2_char(b): i for i, b in enumerate(order)}
    vocab |= {"Ġt": 256, "he": 257, "Ġthe": 258, "<|endoftext|>": 259}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\nĠ t\nh e\nĠt he\n", encoding="utf-8")
    return tmp_path / "vocab.json", tmp_path / "merges.txt", vocab


def test_gpt2_files_load_and_encode_as_expected(gpt2_files):
    vocab_path, merges_path, vocab = gpt2_files
    tokenizer = BPETokenizer.from_gpt2(vocab_path, merges_path)
    assert tokenizer.vocab_size == 260
    assert tokenizer.encode(" the") == [258]
    assert tokenizer.encode("the") == [vocab["t"], 257]
    assert tokenizer.encode(" then\n") == [258, vocab["n"], vocab["Ċ"]]
    assert tokenizer.encode("<|endoftext|>", allow_special=True) == [259]
    assert len(tokenizer.encode("<|endoftext|>")) > 1
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.unk_id) == (
        259, 259, None, None
    )
    assert tokenizer.encode("the", eos=True)[-1] == 259
    assert tokenizer.decode([258, vocab["Ċ"], 259]) == " the\n"


def test_gpt2_byte_mapping_worked_facts(bpe, tmp_path):
    bpe.save_gpt2(tmp_path)
    vocab = json.loads((tmp_path / "vocab.json").read_text(encoding="utf-8"))
    # The trained vocabulary gives byte b the id b; GPT-2 writes space as Ġ, "\n" as Ċ.
    assert (vocab["Ġ"], vocab["Ċ"], vocab["ĉ"], vocab["Ā"], vocab["Ń"]) == (32, 10, 9, 0, 173)
    assert (vocab["!"], vocab["~"], vocab["ÿ"], vocab["<|eos|>"]) == (33, 126, 255, bpe.eos_id)
    lines = (tmp_path / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "#version: 0.2"
    assert len(lines) == 1 + len(bpe.merges)
    left, right = bpe.merges[0]
    assert lines[1] == "".join(map(gpt2_char, left)) + " " + "".join(map(gpt2_char, right))


def test_gpt2_save_then_load_gives_an_identical_tokenizer(bpe, gpt2_files, tmp_path):
    assert_gpt2_round_trip(bpe, tmp_path / "trained")
    assert_gpt2_round_trip(BPETokenizer.from_gpt2(*gpt2_files[:2]), tmp_path / "gpt2")


def assert_gpt2_round_trip(tokenizer, directory):
    tokenizer.save_gpt2(directory)
    again = BPETokenizer.from_gpt2(directory / "vocab.json", directory / "merges.txt")
    assert again == tokenizer
    assert (again.bos_id, again.eos_id, again.pad_id) == (
        tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
    )


def test_gpt2_tokenizer_round_trips_through_the_jaxgpt_file(gpt2_files, tmp_path):
    tokenizer = BPETokenizer.from_gpt2(*gpt2_files[:2])
    tokenizer.save(tmp_path / "t.json")
    assert load(tmp_path / "t.json") == tokenizer


# --- bad input ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("texts", ["", [], ["", ""]])
def test_training_on_empty_text_is_an_error(kind, texts):
    with pytest.raises(ValueError, match="empty text"):
        train_tokenizer(kind, texts, vocab_size=300)


def test_word_training_on_whitespace_is_an_error():
    with pytest.raises(ValueError, match="empty text"):
        train_tokenizer("word", ["  \t "])


@pytest.mark.parametrize(
    "kind, vocab_size",
    [("bpe", 258), ("bpe", 0), ("bpe", None), ("char", 4), ("word", 3), ("bpe", 300.0),
     ("char", True)],
)
def test_vocab_size_below_the_base_vocabulary_is_an_error(kind, vocab_size):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(kind, CORPUS, vocab_size=vocab_size)


def test_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="unknown tokenizer kind 'sentencepiece'"):
        train_tokenizer("sentencepiece", CORPUS)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_out_of_range_is_an_error(kind):
    tokenizer = trained(kind)
    for bad in (-1, tokenizer.vocab_size, 10**9):
        with pytest.raises(ValueError, match=f"token id {bad} is out of range"):
            tokenizer.decode([0, bad, 1])
    assert tokenizer.decode(np.array(tokenizer.encode("the dog"))) == tokenizer.decode(
        tokenizer.encode("the dog")
    )


def damage(data):
    """Ways a tokenizer file can be wrong, each with the words its error should use."""
    yield "{not json", "not valid JSON"
    yield json.dumps(data)[: len(json.dumps(data)) // 2], "not valid JSON"
    yield json.dumps([1, 2]), "not a jaxgpt tokenizer"
    yield json.dumps({**data, "format": "other"}), "not a jaxgpt tokenizer"
    yield json.dumps({**data, "version": 2}), "version 2"
    yield json.dumps({k: v for k, v in data.items() if k != "version"}), "version None"
    yield json.dumps({**data, "kind": "magic"}), "unknown tokenizer kind 'magic'"


@pytest.mark.parametrize("kind", KINDS)
def test_damaged_or_unknown_files_are_errors(kind, tmp_path):
    tokenizer = trained(kind)
    path = tmp_path / "tokenizer.json"
    for text, message in damage(tokenizer.to_dict()):
        path.write_text(text, encoding="utf-8")
        with pytest.raises(ValueError, match=message) as error:
            load(path)
        assert str(path) in str(error.value)


@pytest.mark.parametrize(
    "kind, field, value",
    [
        ("char", "tokens", "abc"),
        ("char", "tokens", ["a", "bc"]),
        ("char", "tokens", ["a", "a"]),
        ("word", "tokens", ["two words"]),
        ("word", "tokens", [7]),
        ("bpe", "vocab", {"a": 0}),
        ("bpe", "merges", ["Ġ"]),
        ("bpe", "merges", ["Ġ zzz"]),
        ("bpe", "special_tokens", {"<|bos|>": "x"}),
        ("bpe", "special_tokens", {"<|bos|>": 0}),
        ("bpe", "pattern", "(unclosed"),
        ("bpe", "pattern", r"(\w+)"),
    ],
)
def test_damaged_fields_are_errors(kind, field, value, tmp_path):
    tokenizer = trained(kind)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({**tokenizer.to_dict(), field: value}), encoding="utf-8")
    with pytest.raises(ValueError, match="damaged tokenizer file") as error:
        load(path)
    assert str(path) in str(error.value)


def test_damaged_gpt2_files_are_errors(gpt2_files):
    vocab_path, merges_path, vocab = gpt2_files
    merges_path.write_text("#version: 0.2\nĠ t\nhe\n", encoding="utf-8")
    with pytest.raises(ValueError, match="'he' is not two tokens"):
        BPETokenizer.from_gpt2(vocab_path, merges_path)
    merges_path.write_text("Ġ t\nh e\nĠt he\nx yz\n", encoding="utf-8")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        BPETokenizer.from_gpt2(vocab_path, merges_path)
    merges_path.write_text("Ġ t\nh e\n", encoding="utf-8")  # truncated: Ġthe is made by none
    with pytest.raises(ValueError, match="'Ġthe' is neither a byte.*merges.txt complete"):
        BPETokenizer.from_gpt2(vocab_path, merges_path)
    vocab_path.write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match="not a valid vocab.json"):
        BPETokenizer.from_gpt2(vocab_path, merges_path)


def test_bad_text_is_an_error(bpe):
    with pytest.raises(TypeError, match="expected text as str, got bytes"):
        bpe.encode(b"bytes")
    with pytest.raises(TypeError, match="use encode for one text"):
        bpe.encode_batch("one text")
    with pytest.raises(ValueError, match="lone surrogate"):
        bpe.encode("bad \ud800 text")


def test_bos_without_a_bos_token_is_an_error():
    tokenizer = BPETokenizer({bytes([b]): b for b in range(256)}, [], {})
    with pytest.raises(ValueError, match="no bos token"):
        tokenizer.encode("x", bos=True)


def test_bad_vocabularies_are_errors():
    byte_vocab = {bytes([b]): b for b in range(256)}
    with pytest.raises(ValueError, match="byte 255 is missing"):
        BPETokenizer({bytes([b]): b for b in range(255)}, [], {})
    with pytest.raises(ValueError, match="no merge produces it"):
        BPETokenizer(byte_vocab | {b"ab": 256}, [], {})
    with pytest.raises(ValueError, match="ids must be 0..257"):
        BPETokenizer(byte_vocab | {b"ab": 257}, [(b"a", b"b")], {"<|eos|>": 258})
    with pytest.raises(ValueError, match="capturing groups"):
        BPETokenizer(byte_vocab, [], {}, pattern=r"(\w)+")
