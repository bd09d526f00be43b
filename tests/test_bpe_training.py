"""The byte-level BPE's merge loop (jaxgpt.tokenizers.bpe_training) against a slow reference: the
word-by-word algorithm, which fuses a pair by rescanning every word that holds it. Both must learn
the same merges, ties and runs of one letter included; and one long piece must cost what the same
letters cut by spaces cost."""

from __future__ import annotations

import random
import time
from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxgpt.tokenizers import BPETokenizer
from jaxgpt.tokenizers.bpe_training import Words, learn_merges, merge_pair


def reference_merges(word_counts: dict[bytes, int], max_tokens: int) -> tuple[list[bytes], list[tuple[int, int]]]:
    """Each step: the pair with the highest count over every word (the smallest pair of ids on a tie),
    fused left to right in every word, after which every pair of those words is counted again."""
    words = [list(word) for word in word_counts if len(word) > 1]
    counts = [word_counts[word] for word in word_counts if len(word) > 1]
    tokens = [bytes([b]) for b in range(256)]
    merges = []
    while len(tokens) < max_tokens:
        pair_counts: defaultdict[tuple[int, int], int] = defaultdict(int)
        for word, count in zip(words, counts, strict=True):
            for pair in zip(word, word[1:], strict=False):
                pair_counts[pair] += count
        if not pair_counts:
            break
        best = min(pair_counts, key=lambda pair: (-pair_counts[pair], pair))
        merged = tokens[best[0]] + tokens[best[1]]
        new = tokens.index(merged) if merged in tokens else len(tokens)
        if new == len(tokens):
            tokens.append(merged)
        merges.append(best)
        words = [merge_pair(word, *best, new) or word for word in words]
    return tokens, merges


def test_runs_of_one_letter_fuse_left_to_right():
    # "aaaaa": (a, a) four times → aa aa a; then (aa, a) and (aa, aa) once each: the smaller pair of
    # ids, (256, 97), first → aa aaa; then (aa, aaa).
    tokens, merges = learn_merges(Words.of({b"aaaaa": 1}), 259)
    assert [(tokens[a], tokens[b]) for a, b in merges] == [(b"a", b"a"), (b"aa", b"a"), (b"aa", b"aaa")]


def test_a_pair_shared_by_two_occurrences_is_counted_once():
    # "abab" × 3: (a, b) 6, (b, a) 3 → ab ab: (ab, ab) 3, and (b, a) is gone, not negative.
    tokens, merges = learn_merges(Words.of({b"abab": 3, b"ba": 2}), 260)
    assert [(tokens[a], tokens[b]) for a, b in merges] == [(b"a", b"b"), (b"ab", b"ab"), (b"b", b"a")]


@settings(max_examples=300, deadline=None)
@given(words=st.dictionaries(st.binary(min_size=1, max_size=14).map(lambda b: bytes(97 + x % 3 for x in b)),
                             st.integers(1, 5), min_size=1, max_size=8),
       merges=st.integers(1, 40))
def test_merges_equal_the_reference_on_small_alphabets(words, merges):
    assert learn_merges(Words.of(words), 256 + merges) == reference_merges(words, 256 + merges)


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.dictionaries(st.sampled_from([b"ab", b"aab", b"ba", b"abab", b"b", b"bbb"]),
                                      st.integers(1, 4)), min_size=1, max_size=3))
def test_words_counted_apart_learn_the_merges_of_their_summed_counts(parts):
    # What worker processes send back: each its own words, some of them the same (or none at all).
    summed: dict[bytes, int] = defaultdict(int)
    for part in parts:
        for word, count in part.items():
            summed[word] += count
    joined = Words.joined([Words.of(part) for part in parts])
    assert learn_merges(joined, 280) == reference_merges(summed, 280)


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.dictionaries(st.binary(min_size=1, max_size=6).map(lambda b: bytes(97 + x % 4 for x in b)),
                                      st.integers(1, 4)), min_size=1, max_size=3),
       shares=st.integers(1, 4))
def test_shares_joined_apart_and_set_side_by_side_learn_the_merges_of_the_summed_counts(parts, shares):
    # What worker processes do: each cuts its words into shares, worker k joins the k-th shares of all.
    summed: dict[bytes, int] = defaultdict(int)
    for part in parts:
        for word, count in part.items():
            summed[word] += count
    cut = [Words.of(part).shares(shares) for part in parts]
    joined = [Words.joined([pieces[k] for pieces in cut]) for k in range(shares)]
    held = [set(share.words()) for share in joined]
    assert sum(map(len, held)) == len(set().union(*held)) == len(summed)  # each word in one share only
    assert learn_merges(Words.concatenated(joined), 280) == reference_merges(summed, 280)


def test_pairs_made_by_a_token_that_another_merge_made_too_are_counted_as_the_others(monkeypatch):
    # Two merges that make the same bytes do not occur in these words, so every merge is sent down the
    # path for that case (pairs looked up before they are made), which must learn the same merges.
    from jaxgpt.tokenizers import bpe_training

    original = bpe_training._Pieces.fuse
    monkeypatch.setattr(bpe_training._Pieces, "fuse",
                        lambda self, pair, left, right, new, fresh: original(self, pair, left, right, new, False))
    words = {b"abababa": 3, b"aaab": 2, b"baba": 5, b"the cat sat on the mat": 2, b"aaaaaaa": 1}
    assert learn_merges(Words.of(words), 300) == reference_merges(words, 300)


def test_merges_equal_the_reference_on_long_pieces_and_prose():
    rng = random.Random(0)
    words = {bytes(rng.choice(b"ab") for _ in range(3000)): 1, bytes(rng.choice(b"abc ") for _ in range(2000)): 3,
             b"a" * 999: 2, b"the cat sat on the mat": 5, b" dog": 7}
    assert learn_merges(Words.of(words), 700) == reference_merges(words, 700)


def test_one_long_piece_costs_what_the_same_letters_cut_by_spaces_cost():
    # Each merge touches only the places where its pair occurs, not the whole piece that holds it:
    # word by word, one 60,000-letter piece took 60× the spaced letters' time.
    rng = random.Random(0)
    letters = "".join(rng.choice("abcdefghij") for _ in range(60_000))
    spaced = " ".join(letters[i:i + 8] for i in range(0, len(letters), 8))

    def seconds(text):
        start = time.process_time()
        BPETokenizer.train(text, vocab_size=1500)
        return time.process_time() - start

    assert min(seconds(letters) for _ in range(2)) < 4 * min(seconds(spaced) for _ in range(2))
