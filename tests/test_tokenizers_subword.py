"""WordPiece and unigram tokenizers: worked examples, independent references (exact fractions,
brute-force enumeration of segmentations), round trips, files, and the data path."""

import functools
import itertools
import json
import math
import re
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxgpt import data
from jaxgpt.errors import DataError
from jaxgpt.tokenizers import UnigramTokenizer, WordPieceTokenizer, load, train_tokenizer, unigram, wordpiece

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox doesn't.\n",
    "Ünïcödé tëxt: naïve café, 東京タワー, Ελληνικά, emoji 🙂🙂 and 👩‍👩‍👧 too!\r\n",
    "Numbers 1234 and 3.14159, tabs\tand  double  spaces,\n\nnew paragraphs.\n",
    "    indented code(x) {\n        return x_y + 1;  }  // a|b <c>\n",
]
SEEN = "".join(sorted(set("".join(CORPUS))))
KINDS = ["wordpiece", "unigram"]
VOCAB_SIZE = 320

fast = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def trained(kind):
    return train_tokenizer(kind, CORPUS, vocab_size=VOCAB_SIZE)


# --- WordPiece: pre-tokens and training against an exact reference ---------------------


def test_wordpiece_pre_tokens_keep_whitespace_but_the_single_space_between_words():
    assert wordpiece.pre_tokens("Hi, you  two\n\tok x_1 (a) b") == [
        "Hi", ",", " ", "you", "  ", "two", "\n\t", "ok", "x_1", " ", "(", "a", ")", " ", "b"]
    assert wordpiece.pre_tokens(" lead trail ") == [" ", "lead", "trail", " "]


def naive_wordpiece(word_counts, room):
    """Textbook WordPiece training with exact fractions: recount every unit and pair of the
    words before each merge; merge the pair with the highest count(ab)/(count(a)count(b)),
    ties to the larger count(ab), then the smaller (a, b). Returns the learned pieces."""
    splits = {w: [w[0]] + ["##" + c for c in w[1:]] for w in word_counts}
    letters = {c for w in word_counts for c in w}
    vocab = letters | {"##" + c for c in letters}
    learned = []
    while len(vocab) < room:
        units, pairs = Counter(), Counter()
        for word, count in word_counts.items():
            units.update({u: count * n for u, n in Counter(splits[word]).items()})
            for pair in zip(splits[word], splits[word][1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break
        a, b = min(pairs, key=lambda p: (-Fraction(pairs[p], units[p[0]] * units[p[1]]), -pairs[p], p))
        merged = a + b[2:]
        for word, split in splits.items():
            out, i = [], 0
            while i < len(split):
                if split[i:i + 2] == [a, b]:
                    out.append(merged)
                    i += 2
                else:
                    out.append(split[i])
                    i += 1
            splits[word] = out
        if merged not in vocab:
            vocab.add(merged)
            learned.append(merged)
    return learned


def learned_pieces(tokenizer, n_letters):
    """The pieces after the alphabet (each letter as a first piece and as "##")."""
    return list(tokenizer.tokens[2 * n_letters:])


def test_wordpiece_first_merges_worked_example():
    # hug×10 pug×5 pun×12 bun×4 hugs×5. Units: h 15, ##u 36, ##g 20, p 17, ##n 16, b 4, ##s 5.
    # Every pair with ##u scores 1/36 (e.g. (p, ##u): 17/(17·36)); (##g, ##s) scores
    # 5/(20·5) = 1/20: merge 1 is "##gs". Then all six pairs score 1/36, and the largest
    # count(ab) is (p, ##u) = 17: merge 2 is "pu". Then ##u 19: (h, ##u) 15/(15·19),
    # (b, ##u) 4/(4·19), (##u, ##gs) 5/(19·5) tie at 1/19 and (h, ##u) counts most: "hu".
    words = Counter({"hug": 10, "pug": 5, "pun": 12, "bun": 4, "hugs": 5})
    text = " ".join(word for word, n in words.items() for _ in range(n))
    tokenizer = WordPieceTokenizer.train(text, vocab_size=4 + 14 + 3)
    assert learned_pieces(tokenizer, 7) == ["##gs", "pu", "hu"]
    assert naive_wordpiece(words, 14 + 3) == ["##gs", "pu", "hu"]
    assert tokenizer.encode("hugs pun") == [tokenizer.tokens.index(t) + 4 for t in ["hu", "##gs", "pu", "##n"]]


@pytest.mark.parametrize("seed", range(6))
def test_wordpiece_merges_equal_the_exact_reference(seed):
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(list("abcde"), size=rng.integers(1, 7))) for _ in range(12)]
    text = " ".join(rng.choice(words, size=80))
    counts = Counter(text.split())
    letters = len(set(text) - {" "})
    tokenizer = WordPieceTokenizer.train(text, vocab_size=4 + 2 * letters + 25)
    assert learned_pieces(tokenizer, letters) == naive_wordpiece(counts, 2 * letters + 25)


# --- WordPiece: greedy longest-match-first encoding ---------------------------------


def test_wordpiece_greedy_longest_match_first_worked_example():
    tokenizer = WordPieceTokenizer(["un", "##aff", "##able", "u", "##n", "##a", "##f", "##b", "##l", "##e",
                                    "ab", "a", "##bcd", "##c", "##d", "!"])
    ids = {token: i for i, token in enumerate(tokenizer.tokens, start=4)}
    # "unaffable": "una…" is no piece, "un" is the longest start; then "##aff", "##able".
    assert tokenizer.encode("unaffable") == [ids["un"], ids["##aff"], ids["##able"]]
    # Greedy commits: "ab" is taken first and "##cd" is no piece, but "##c", "##d" are.
    assert tokenizer.encode("abcd") == [ids["ab"], ids["##c"], ids["##d"]]
    assert tokenizer.encode("unable!") == [ids["un"], ids["##able"], ids["!"]]
    # A word that cannot be pieced (no "x" anywhere) is one <|unk|>, the rest goes on.
    assert tokenizer.encode("unax unable") == [tokenizer.unk_id, ids["un"], ids["##able"]]
    assert tokenizer.count_unknown("unax unable x") == 2
    # Continuations lose their "##"; the space between two words comes back.
    assert tokenizer.decode([ids["un"], ids["##able"], ids["un"], ids["##aff"]]) == "unable unaff"
    assert tokenizer.decode(tokenizer.encode("unax unable"), keep_special=True) == "<|unk|> unable"


def test_wordpiece_greedy_can_miss_a_segmentation_and_then_gives_unk():
    tokenizer = WordPieceTokenizer(["ab", "a", "##bcd"])
    # "a" + "##bcd" would piece "abcd", but greedy takes "ab" and then nothing fits.
    assert tokenizer.encode("abcd") == [tokenizer.unk_id]
    assert tokenizer.encode("a") == [5]


# --- unigram: Viterbi and EM against brute force -------------------------------------

HAND_PIECES = ["a", "b", "c", "▁", "ab", "bc", "abc", "ca", "▁a", "▁ab", "▁▁", "cab", "bca", "\n", "\n\n"]


@functools.cache
def hand_unigram():
    logp = np.random.default_rng(7).uniform(-6.0, -0.5, size=len(HAND_PIECES))
    return UnigramTokenizer(list(zip(HAND_PIECES, logp.tolist(), strict=True)))


def segmentations(text, vocab):
    """Every way to write `text` as a sequence of pieces of `vocab`."""
    if not text:
        yield []
        return
    for end in range(1, len(text) + 1):
        if text[:end] in vocab:
            for rest in segmentations(text[end:], vocab):
                yield [text[:end], *rest]


@fast
@given(text=st.text(alphabet="abc \n", max_size=11))
def test_unigram_viterbi_is_the_best_segmentation_by_brute_force(text):
    tokenizer = hand_unigram()
    logp = dict(tokenizer.pieces)
    spelled = text.replace(" ", "▁")
    scored = [(sum(logp[p] for p in seg), seg) for seg in segmentations(spelled, logp)]
    best = max(score for score, _ in scored)
    names = [tokenizer.pieces[i - 4][0] for i in tokenizer.encode(text)]
    assert "".join(names) == spelled
    assert sum(logp[p] for p in names) == pytest.approx(best, abs=1e-9)
    winners = [seg for score, seg in scored if score > best - 1e-9]
    if len(winners) == 1:
        assert names == winners[0]
    assert tokenizer.decode(tokenizer.encode(text)) == text


@fast
@given(text=st.text(alphabet="abc \n", max_size=14))
def test_unigram_pieces_without_line_breaks_encode_as_when_line_breaks_cut_segments(text):
    # Files written before pieces could hold line breaks: encoding a text whole gives the ids
    # of its old segments (line-break runs apart) one after the other.
    tokenizer = hand_unigram()
    old_segments = re.findall(r" *[^ \n]+| +|\n+", text)
    assert tokenizer.encode(text) == [i for segment in old_segments for i in tokenizer.encode(segment)]


def naive_substring_counts(runs, max_len):
    counts = Counter()
    for run, weight in runs.items():
        for i in range(len(run)):
            for j in range(i + 2, min(len(run), i + max_len) + 1):
                counts[run[i:j]] += weight
    return counts


@pytest.mark.parametrize("seed", range(4))
def test_unigram_seed_is_the_best_substrings_by_count_times_length(seed):
    rng = np.random.default_rng(seed)
    runs = Counter({"".join(rng.choice(list("ab▁\nc"), size=rng.integers(1, 12))): int(rng.integers(1, 5))
                    for _ in range(40)})
    counts = naive_substring_counts(runs, 5)
    for n in (1, 7, 30, len(counts) + 3):
        want = sorted(counts, key=lambda s: (-counts[s] * len(s), s))[:n]
        got = unigram._seed(runs, n, 5)
        assert list(got) == want
        assert got == {s: counts[s] for s in want}


@pytest.mark.parametrize("seed", range(4))
def test_unigram_lattice_holds_every_occurrence_of_every_piece(seed):
    rng = np.random.default_rng(seed)
    strings = ["".join(rng.choice(list("abc\0▁"), size=rng.integers(0, 10))) for _ in range(25)]
    pieces = sorted({s[i:j] for s in strings for i in range(len(s)) for j in range(i + 1, len(s) + 1)})
    pieces = [p for p in pieces if rng.random() < 0.5] + ["zz", "abcabcabc"]
    piece_id = {p: i for i, p in enumerate(pieces)}
    lattice = unigram._lattice(strings, np.ones(len(strings)), piece_id, 4)
    got = sorted(zip(lattice.string.tolist(), (lattice.frm - lattice.start[lattice.string]).tolist(),
                     (lattice.to - lattice.frm).tolist(), lattice.piece.tolist(), strict=True))
    want = sorted((s, i, j - i, piece_id[string[i:j]]) for s, string in enumerate(strings)
                  for i in range(len(string)) for j in range(i + 1, min(len(string), i + 4) + 1)
                  if string[i:j] in piece_id)
    assert got == want
    assert (lattice.end - lattice.start).tolist() == [len(s) for s in strings]


def test_unigram_lattice_matches_brute_force_expectations():
    # The training lattice: forward-backward expected counts and log-likelihood, and the
    # vectorised Viterbi, against sums over every segmentation.
    tokenizer = hand_unigram()
    pieces = [p for p, _ in tokenizer.pieces]
    logp = np.array([lp for _, lp in tokenizer.pieces])
    strings, weights = ["abcab", "▁abca", "▁▁bc", "cabcabc"], np.array([3.0, 1.0, 2.0, 0.5])
    lattice = unigram._lattice(strings, weights, {p: i for i, p in enumerate(pieces)}, 4)
    expected, likelihood = unigram._e_step(lattice, logp)
    want_expected, want_likelihood = np.zeros(len(pieces)), 0.0
    for string, weight in zip(strings, weights, strict=True):
        segs = list(segmentations(string, set(pieces)))
        probs = np.array([math.exp(sum(logp[pieces.index(p)] for p in seg)) for seg in segs])
        want_likelihood += weight * math.log(probs.sum())
        for seg, prob in zip(segs, probs, strict=True):
            for p in seg:
                want_expected[pieces.index(p)] += weight * prob / probs.sum()
    np.testing.assert_allclose(expected, want_expected, rtol=1e-9, atol=1e-12)
    assert likelihood == pytest.approx(want_likelihood, rel=1e-12)
    owner, used = unigram._viterbi_paths(lattice, logp, np.arange(len(strings)))
    for s, string in enumerate(strings):
        best = max(sum(logp[pieces.index(p)] for p in seg) for seg in segmentations(string, set(pieces)))
        assert sum(logp[used[owner == s]]) == pytest.approx(best, abs=1e-9)
        assert "".join(pieces[i] for i in used[owner == s][::-1]) == string  # found from the end


def em_corpus():
    rng = np.random.default_rng(3)
    words = ["the", "then", "there", "other", "rather", "hen", "her", "here", "thread", "tree", "treat", "eat"]
    weights = np.linspace(2, 1, len(words))
    return " ".join(rng.choice(words, size=400, p=weights / weights.sum()))


def test_unigram_em_never_lowers_the_likelihood_and_pruning_reaches_vocab_size():
    text = em_corpus()
    words = text.split(" ")
    runs = Counter([words[0]] + ["▁" + w for w in words[1:]])
    trace = []
    room = 40
    pieces, logp = unigram._learn_vocabulary(runs, room, 8, trace)
    assert len(pieces) == room and len(set(pieces)) == room
    assert set(text.replace(" ", "▁")) <= set(pieces)  # every character kept
    assert np.isfinite(logp).all() and np.logaddexp.reduce(logp) == pytest.approx(0.0, abs=1e-9)
    rounds = [[ll for r, _, ll in trace if r == k] for k in range(trace[-1][0] + 1)]
    assert len(rounds) >= 3  # several prunings happened
    for lls in rounds:
        assert all(b >= a - 1e-9 * abs(a) for a, b in itertools.pairwise(lls)), lls
    sizes = [n for r, n, _ in trace]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] == room
    # The tokenizer trained the same way has exactly vocab_size ids.
    tokenizer = UnigramTokenizer.train(text, vocab_size=4 + room, max_piece_length=8)
    assert tokenizer.vocab_size == 4 + room
    assert sorted(p for p, _ in tokenizer.pieces) == sorted(pieces)


def test_unigram_em_climbs_to_a_maximum_of_the_likelihood():
    # On a fixed vocabulary: each EM step raises the likelihood, and where EM stops, no
    # nearby distribution over the same pieces explains the strings better.
    words = em_corpus().split(" ")
    runs = Counter([words[0]] + ["▁" + w for w in words[1:]])
    pieces = sorted(set("".join(runs))) + ["th", "he", "er", "the", "her", "ere", "▁t", "▁th", "▁the", "at", "ea"]
    lattice = unigram._lattice(list(runs), np.array(list(runs.values()), float),
                               {p: i for i, p in enumerate(pieces)}, 4)
    alive = np.ones(len(pieces), bool)
    logp = np.full(len(pieces), -math.log(len(pieces)))
    likelihoods = []
    for _ in range(300):
        expected, likelihood = unigram._e_step(lattice, logp)
        likelihoods.append(likelihood)
        logp = unigram._m_step(expected, alive)
    assert all(b >= a - 1e-9 * abs(a) for a, b in itertools.pairwise(likelihoods))
    assert likelihoods[-1] > likelihoods[0] + 100
    rng = np.random.default_rng(0)
    for _ in range(30):
        nearby = logp + 0.05 * rng.normal(size=len(logp))
        nearby -= np.logaddexp.reduce(nearby)
        assert unigram._e_step(lattice, nearby)[1] < likelihoods[-1]


def test_unigram_makes_each_word_of_a_repetitive_text_one_piece():
    # 8 characters (h e l o ▁ w r d) + 4 pieces: 101 of the 102 segments are "▁hello" or
    # "▁world", so one piece each explains the text best.
    tokenizer = UnigramTokenizer.train(" ".join(["hello world"] * 51), vocab_size=4 + 8 + 4)
    names = [tokenizer.pieces[i - 4][0] for i in tokenizer.encode(" hello world")]
    assert names == ["▁hello", "▁world"]


def test_unigram_pieces_may_hold_line_breaks():
    # 9 characters + 1 piece: 50 of the 52 segments are "▁world\nhello" (the text's line
    # breaks are ordinary characters, as in SentencePiece), so that is the piece to keep.
    tokenizer = UnigramTokenizer.train("\n".join(["hello world"] * 51), vocab_size=4 + 9 + 1)
    names = [tokenizer.pieces[i - 4][0] for i in tokenizer.encode(" world\nhello")]
    assert names == ["▁world\nhello"]


# --- both kinds: round trips, specials, files ---------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("text", [*CORPUS, "".join(CORPUS), "", " ", "  lead and trail  ", "a,b , c ,d",
                                  "x\n\n\n  y\t\tz", "don't   stop.\r\n", "3.14159 1234"])
def test_round_trip_of_seen_characters(kind, text):
    tokenizer = trained(kind)
    assert tokenizer.count_unknown(text) == 0
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("kind", KINDS)
@fast
@given(text=st.text(alphabet=SEEN, max_size=40))
def test_round_trip_of_any_text_of_seen_characters(kind, text):
    tokenizer = trained(kind)
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("kind", KINDS)
def test_subwords_compress_their_training_text(kind):
    tokenizer = trained(kind)
    assert tokenizer.vocab_size <= VOCAB_SIZE
    text = "".join(CORPUS)
    assert len(tokenizer.encode(text)) < len(text) * 0.8


@pytest.mark.parametrize("kind", KINDS)
def test_special_text_is_ordinary_unless_allowed(kind):
    tokenizer = trained(kind)
    text = "fox <|eos|> dog<|pad|>"
    plain = tokenizer.encode(text)
    assert tokenizer.eos_id not in plain and tokenizer.pad_id not in plain
    assert tokenizer.decode(plain) == text
    allowed = tokenizer.encode(text, allow_special=True)
    assert allowed.count(tokenizer.eos_id) == 1 and allowed[-1] == tokenizer.pad_id
    assert tokenizer.decode(allowed, keep_special=True) == text
    assert tokenizer.decode(allowed) == "fox  dog"
    assert tokenizer.encode("the fox", bos=True, eos=True) == [tokenizer.bos_id, *tokenizer.encode("the fox"),
                                                               tokenizer.eos_id]
    assert tokenizer.encode_batch(["the fox", "dog"]) == [tokenizer.encode("the fox"), tokenizer.encode("dog")]
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.unk_id) == (0, 1, 2, 3)


def test_unknowns_wordpiece_counts_words_unigram_counts_characters():
    text = "the ☃ fox Ωmega ▁ dog"  # ☃, Ω and ▁ were never seen; for unigram ▁ is reserved
    word_piece, uni = trained("wordpiece"), trained("unigram")
    assert word_piece.count_unknown(text) == 3  # the pre-tokens ☃, Ωmega and ▁
    assert word_piece.encode(text).count(word_piece.unk_id) == 3
    assert word_piece.decode(word_piece.encode(text), keep_special=True) == (
        "the <|unk|> fox <|unk|> <|unk|> dog")
    assert uni.count_unknown(text) == 3
    assert uni.encode(text).count(uni.unk_id) == 3
    assert uni.decode(uni.encode(text)) == "the  fox mega  dog"
    assert uni.count_unknown("<|unk|>", allow_special=True) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_gives_identical_ids(kind, tmp_path):
    tokenizer = trained(kind)
    tokenizer.save(tmp_path / "tokenizer.json")
    loaded = load(tmp_path / "tokenizer.json")
    assert type(loaded) is type(tokenizer) and loaded == tokenizer
    text = "".join(CORPUS) + " unseen ☃ <|eos|>"
    for allow_special in (False, True):
        assert loaded.encode(text, allow_special=allow_special) == tokenizer.encode(text, allow_special=allow_special)
    file = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert (file["format"], file["version"], file["kind"]) == ("jaxgpt-tokenizer", 1, kind)


@pytest.mark.parametrize("kind, field, value", [
    ("wordpiece", "tokens", "abc"),
    ("wordpiece", "tokens", ["a", "a"]),
    ("wordpiece", "tokens", ["##,"]),
    ("wordpiece", "tokens", ["two words"]),
    ("unigram", "pieces", [["a", -1.0], ["a", -2.0]]),
    ("unigram", "pieces", [["a▁b", -1.0]]),
    ("unigram", "pieces", [["a", "x"]]),
    ("unigram", "pieces", [["a"]]),
    ("unigram", "pieces", {"a": -1.0}),
])
def test_damaged_fields_are_errors(kind, field, value, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({**trained(kind).to_dict(), field: value}), encoding="utf-8")
    with pytest.raises(ValueError, match="damaged tokenizer file"):
        load(path)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_training_settings_are_errors(kind):
    with pytest.raises(ValueError, match="needs a vocab_size"):
        train_tokenizer(kind, CORPUS)
    for bad in (4, 0, 300.0, True):
        with pytest.raises(ValueError, match="vocab_size must be an integer ≥ 5"):
            train_tokenizer(kind, CORPUS, vocab_size=bad)
    for empty in ("", [], ["", ""]):
        with pytest.raises(ValueError, match="empty text"):
            train_tokenizer(kind, empty, vocab_size=100)
    with pytest.raises(DataError, match=f"data.tokenizer='{kind}' needs data.vocab_size"):
        data.prepare({"tokenizer": kind})


@pytest.mark.parametrize("kind", KINDS)
def test_a_vocabulary_smaller_than_the_alphabet_keeps_the_frequent_characters(kind):
    tokenizer = train_tokenizer(kind, ["aaaa bbb cc d"], vocab_size=7)
    assert tokenizer.vocab_size == 7
    assert tokenizer.count_unknown("d") == 1 and tokenizer.count_unknown("a") == 0


# --- the data path ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_prepare_writes_tokens_that_decode_to_the_documents(kind, tmp_path):
    docs = {"a.txt": CORPUS[0] + CORPUS[2], "b.txt": CORPUS[3] + "  and the lazy fox.\n"}
    root = tmp_path / "corpus"
    root.mkdir()
    for name, text in docs.items():
        (root / name).write_text(text, encoding="utf-8")
    corpus = data.prepare({"source": str(root), "cache_dir": str(tmp_path / "cache"), "val_fraction": 0.0,
                           "tokenizer": kind, "vocab_size": 200})
    assert corpus.tokenizer.kind == kind and corpus.tokenizer.vocab_size <= 200
    ids = np.asarray(corpus.train).tolist()
    cuts = [i for i, t in enumerate(ids) if t == corpus.tokenizer.eos_id]
    parts = [ids[a + 1:b] for a, b in itertools.pairwise([-1, *cuts, len(ids)])]
    assert sorted(corpus.tokenizer.decode(part) for part in parts) == sorted(docs.values())
