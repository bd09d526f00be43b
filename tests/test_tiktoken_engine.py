"""The tiktoken engine of the byte-level BPE (jaxgpt.tokenizers.tiktoken_engine) gives exactly the
ids of jaxgpt's own encoder, which is what it is checked against, on awkward text, a trained
tokenizer, GPT-2-style files and random text; where it cannot, it is not used."""

import functools
import json
import pickle

import numpy as np
import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

tiktoken = pytest.importorskip("tiktoken")

from jaxgpt.tokenizers import BPETokenizer, tiktoken_engine  # noqa: E402
from jaxgpt.tokenizers.pretokenize import GPT2_SPLIT_PATTERN  # noqa: E402

AWKWARD = [
    "Hello, world! It's 2024; we'll see.\n",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "combining e\u0301 a\u0308\u0304 ñ vs n\u0303",
    "crlf line\r\nnext\r\n\r\n",
    "nul\x00byte\x00\x00 and bell\x07",
    "scripts: Ελληνικά русский עברית العربية हिन्दी 東京 한국어 ไทย",
    "numbers ١٢٣ ٤ ½ Ⅻ 10,000.5",
    "runs of whitespace:" + " " * 40 + "\t\t\n\n\n   \u3000\u00a0x" + "\n" * 9,
    "trailing spaces   ",
    "   leading spaces",
    "'s 've 're ll'd' '' \"quoted\"",
    "<|eos|> is text here",
]
EVERY_CHARACTER = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
BYTE_RANKS = {bytes([b]): b for b in range(256)}


def matched_by_tiktoken(pat_str, text):
    """The characters of `text` that tiktoken's regex engine matches with `pat_str`, in order."""
    probe = tiktoken.Encoding("probe", pat_str=pat_str, mergeable_ranks=BYTE_RANKS, special_tokens={})
    return bytes(probe.encode_ordinary(text)).decode("utf-8")


@functools.cache
def disagreeing():
    """Letters and numbers that tiktoken's own Unicode tables and the `regex` module's class
    differently (newer Unicode, with these versions), a few of each run; the engine must cut them
    as the `regex` module does."""
    found = set()
    for cls in [r"\p{L}", r"\p{N}"]:
        found |= set(matched_by_tiktoken(cls, EVERY_CHARACTER)) ^ set(regex.findall(cls, EVERY_CHARACTER))
    return "".join(sorted(found)[::97])


def corpus():
    """The awkward texts, and the disagreeing characters inside words and numbers, where cutting
    them off would keep the merges across them from applying."""
    inside = " ".join(f"x{c}x 1{c}1" for c in disagreeing())
    return AWKWARD * 3 + [inside, inside, disagreeing() + " " + disagreeing()[::-1]]


@pytest.fixture(scope="module")
def trained():
    return BPETokenizer.train(corpus(), vocab_size=420)


def pure_ids(tokenizer, text, **options):
    pure = BPETokenizer(tokenizer.vocab, tokenizer.merges, tokenizer.special_tokens, tokenizer.pattern,
                        engine="jaxgpt")
    return pure.encode(text, **options)


def tiktoken_only(tokenizer, monkeypatch):
    """`tokenizer` on the tiktoken engine, with jaxgpt's encoder made to fail if it is called."""
    tokenizer.engine = "tiktoken"

    def refuse(self, text):
        raise AssertionError(f"jaxgpt's encoder was used for {text!r}")

    monkeypatch.setattr(BPETokenizer, "_encode_pure", refuse)
    return tokenizer


def test_trained_tokenizer_gives_jaxgpt_ids_on_awkward_text(trained, monkeypatch):
    expected = {text: pure_ids(trained, text) for text in corpus() + ["".join(corpus())]}
    engine = tiktoken_only(trained, monkeypatch)
    for text, ids in expected.items():
        assert engine.encode(text) == ids, text


def test_special_tokens_and_bos_eos_go_through_unchanged(trained):
    text = "a<|eos|>b <|bos|>\n<|pad|>"
    expected = pure_ids(trained, text, allow_special=True, bos=True, eos=True)
    trained.engine = "tiktoken"
    assert trained.encode(text, allow_special=True, bos=True, eos=True) == expected
    assert trained.encode(text) == pure_ids(trained, text)


def test_spelled_out_classes_match_the_regex_module_on_every_code_point():
    for cls in [r"\p{L}", r"\p{N}", r"\s", r"\S", r"[^\s\p{L}\p{N}]"]:
        assert matched_by_tiktoken(tiktoken_engine.spelled_out(cls), EVERY_CHARACTER) == "".join(
            regex.findall(cls, EVERY_CHARACTER)), cls


def test_gpt2_style_files_give_jaxgpt_ids(tmp_path, monkeypatch):
    """vocab.json + merges.txt with GPT-2's layout: byte ids shuffled, merged ids after them."""
    printable = gpt2_printable()
    order = np.random.default_rng(0).permutation(256).tolist()
    trained = BPETokenizer.train(corpus(), vocab_size=400)
    vocab = {"".join(printable[b] for b in token): i for token, i in
             [(bytes([b]), k) for k, b in enumerate(order)]}
    merges = trained.merges
    for k, (left, right) in enumerate(merges):
        vocab["".join(printable[b] for b in left + right)] = 256 + k
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    lines = [" ".join("".join(printable[b] for b in part) for part in merge) for merge in merges]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(lines) + "\n", encoding="utf-8")
    gpt2 = BPETokenizer.from_gpt2(tmp_path / "vocab.json", tmp_path / "merges.txt")
    expected = {text: pure_ids(gpt2, text) for text in corpus()}
    engine = tiktoken_only(gpt2, monkeypatch)
    for text, ids in expected.items():
        assert engine.encode(text) == ids, text


def gpt2_printable():
    """GPT-2's byte → character table, from its definition (printable Latin-1 bytes stand for
    themselves, the other 68 for U+0100, U+0101, ... in byte order)."""
    hidden = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b)]
    return [chr(b) if b not in hidden else chr(0x100 + hidden.index(b)) for b in range(256)]


def tokenizer_of(merges, pattern=GPT2_SPLIT_PATTERN):
    """A BPE tokenizer with these merges, each new token taking the next id."""
    vocab = {bytes([b]): b for b in range(256)}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    return BPETokenizer(vocab, merges, {"<|eos|>": len(vocab)}, pattern)


def test_a_token_that_does_not_encode_to_itself_keeps_jaxgpt_encoder(monkeypatch):
    # b+c comes first, so jaxgpt's encoder never makes ab + cd out of "abcd": it stops at a, bc, d.
    # tiktoken would return the piece "abcd" whole, as it is a token.
    tokenizer = tokenizer_of([(b"b", b"c"), (b"c", b"d"), (b"a", b"b"), (b"ab", b"cd")])
    a, bc, d = tokenizer.vocab[b"a"], tokenizer.vocab[b"bc"], tokenizer.vocab[b"d"]
    assert tokenizer.encode("abcd") == [a, bc, d]
    raw = tiktoken.Encoding("raw", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=tokenizer.vocab, special_tokens={})
    assert raw.encode_ordinary("abcd") == [tokenizer.vocab[b"abcd"]]
    with pytest.raises(ValueError, match=r"token b'abcd' does not encode to itself"):
        tokenizer.engine = "tiktoken"
    monkeypatch.setattr(tiktoken_engine, "AUTO_AFTER_CHARS", 10)
    tokenizer.engine = "auto"  # tries tiktoken after 10 characters, finds it cannot, keeps jaxgpt's
    assert tokenizer.encode("abcd " * 5 + "abcd") == [a, bc, d] + [tokenizer.vocab[b" "], a, bc, d] * 5


def test_two_merges_making_one_token_or_another_pattern_keep_jaxgpt_encoder():
    twice = tokenizer_of([(b"a", b"b"), (b"ab", b"c"), (b"b", b"c"), (b"a", b"bc")])
    with pytest.raises(ValueError, match="do not rise with the merge order"):
        twice.engine = "tiktoken"
    other = tokenizer_of([(b"a", b"b")], pattern=r"\S+|\s+")
    with pytest.raises(ValueError, match="split pattern is not GPT-2's"):
        other.engine = "tiktoken"
    with pytest.raises(ValueError, match="unknown BPE engine"):
        other.engine = "fast"


def test_auto_switches_to_tiktoken_after_enough_text(trained, monkeypatch):
    monkeypatch.setattr(tiktoken_engine, "AUTO_AFTER_CHARS", 100)
    tokenizer = BPETokenizer(trained.vocab, trained.merges, trained.special_tokens)
    text = "".join(corpus())
    expected = pure_ids(trained, text)
    assert tokenizer.encode(text[:50]) == pure_ids(trained, text[:50])  # below the threshold: jaxgpt's
    tiktoken_only(tokenizer, monkeypatch).engine = "auto"
    assert tokenizer.encode(text) == expected


def test_a_lone_surrogate_is_refused_as_by_jaxgpt(trained):
    trained.engine = "tiktoken"
    with pytest.raises(ValueError, match="lone surrogate"):
        trained.encode("bad \ud800 text")


def test_pickling_keeps_the_engine(trained):
    trained.engine = "tiktoken"
    again = pickle.loads(pickle.dumps(trained))
    assert again.engine == "tiktoken" and again == trained
    assert again.encode("".join(corpus())) == pure_ids(trained, "".join(corpus()))


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60) | st.text(alphabet=" \t\n\r'sabcé🙂1٣", max_size=60))
def test_random_text_gives_jaxgpt_ids_and_round_trips(trained, text):
    trained.engine = "tiktoken"
    ids = trained.encode(text)
    assert ids == pure_ids(trained, text)
    assert trained.decode(ids) == text
