"""Log-likelihoods of text under a model, batched: the scores benchmark harnesses ask for.

For a continuation c = (c_1 … c_m) of a context x = (x_1 … x_n), with s = x ⊕ c cut from the
left to its last block_size + 1 tokens (the model reads at most block_size):

    log p(c | x) = Σ_{i=1..m} log softmax(logits(s_{<|s|}))_{|s|−m+i−1}[c_i]
    greedy(c | x) = every c_i is the argmax of its row of logits

and for a whole text t, read after a prefix token p (<|eos|>: a jaxgpt corpus puts it before
every document but the first), log p(t) = Σ_j log p(t_j | p, t_{<j}) over the windows of
`jaxgpt.data.eval_batch`: block_size tokens each, `stride` after the last, every target
counted once, exactly as `jaxgpt.train.evaluation` counts a text's loss.

Continuations are scored through the KV cache when the attention is softmax (`score_cached`):
each context is read once into the cache, read_width tokens a call, and each of its
continuations (a multiple-choice item's choices) is read after a copy of its row, score_width
tokens a call. Every call has one of two shapes (one when block_size ≤ 256), set by batch_size and block_size
alone, so a task compiles two programs at most whatever its lengths, and they can be compiled
(`prepare`) before the requests arrive.

Otherwise (texts, and continuations under another attention form) every request becomes a row
(inputs, targets, mask). Rows are sorted by length, put in batches of `batch_size` (the last
one filled with empty rows) and padded to a `bucket` (a power of two up to block_size/8, then
multiples of it), so that a task compiles a handful of programs, one per bucket.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt import data
from jaxgpt.attention import FORMS, init_cache
from jaxgpt.loss import score_targets
from jaxgpt.model import GPT
from jaxgpt.tokenizers import Tokenizer

MIN_BUCKET = 16
# the continuation tokens each call of the engine scores: on bench_harness's task (CPU) 32 makes 13 calls
# and takes 12% less time than 16 (24 calls: a call's cost is far from proportional to its width)
SCORE_WIDTH = 32


def prefix_id(tokenizer: Tokenizer) -> int:
    """The token a text is read after: <|eos|>, which precedes every document but the first of
    a jaxgpt corpus (GPT-2's <|endoftext|> is both its bos and eos); <|bos|> if there is no eos."""
    found = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.bos_id
    if found is None:
        raise ValueError(f"the {tokenizer.kind} tokenizer has neither <|eos|> nor <|bos|> to read a text after")
    return found


def bucket(length: int, block_size: int) -> int:
    """The padded width of rows up to `length` tokens: the next power of two (at least
    MIN_BUCKET) up to block_size/8, past it the next multiple of block_size/8; at most block_size."""
    step = max(MIN_BUCKET, block_size // 8)
    if length > step:
        return min(block_size, -(-length // step) * step)
    return min(block_size, max(MIN_BUCKET, 1 << (max(length, 1) - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class Row:
    """One pass of the model: inputs and targets (n,), the targets that count (mask)."""

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray


def continuation_row(context: Sequence[int], continuation: Sequence[int], block_size: int) -> Row:
    """The row that scores `continuation` after `context`: their last block_size + 1 tokens,
    the continuation's the counted targets. ValueError for an empty context (give the prefix
    token) or a continuation longer than block_size."""
    if not context:
        raise ValueError("a continuation needs a context of at least one token: give the prefix token (<|eos|>)")
    if len(continuation) > block_size:
        raise ValueError(f"a continuation of {len(continuation)} tokens is longer than the model's context "
                         f"(block_size={block_size}): it cannot be scored")
    whole = np.asarray([*context, *continuation], np.int32)[-(block_size + 1):]
    mask = np.arange(len(whole) - 1) >= len(whole) - 1 - len(continuation)
    return Row(whole[:-1], whole[1:], mask)


def text_rows(tokens: Sequence[int], block_size: int, stride: int | None = None) -> list[Row]:
    """The windows of `jaxgpt.data.eval_batch` over `tokens` (its first is the prefix), each cut
    after its last real token: every token after the first is a counted target once."""
    tokens = np.asarray(tokens, np.int32)
    if len(tokens) < 2:
        return []
    count = data.num_eval_batches(len(tokens), batch_size=1, block_size=block_size, stride=stride)
    inputs, targets, mask = data.eval_batch(tokens, 0, batch_size=count, block_size=block_size, stride=stride)
    starts = np.arange(count) * (stride or block_size)
    lengths = np.minimum(len(tokens) - 1 - starts, block_size)
    return [Row(inputs[w, :n], targets[w, :n], mask[w, :n]) for w, n in enumerate(lengths)]


@functools.cache
def _scorer(model: GPT):
    """The jitted (params, inputs, targets, mask) → (Σ counted log-probs, all counted targets
    greedy) of each row; one program per (batch, width)."""

    def score(params, inputs, targets, mask):
        logprobs, greedy = score_targets(model, params, inputs, targets)
        return jnp.sum(jnp.where(mask, logprobs, 0.0), axis=-1), jnp.all(greedy | ~mask, axis=-1)

    return jax.jit(score)


def score_rows(model: GPT, params, rows: Sequence[Row], *, batch_size: int,
               on_batch: Callable[[int, int], None] | None = None) -> list[tuple[float, bool]]:
    """(Σ log p of the counted targets, whether greedy decoding gives them all) of each row, in
    the order given. The longest rows go first, batch_size to a batch, each batch padded to the
    `bucket` of its longest row; `on_batch(done, total)` follows the batches."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].inputs))
    block_size, scorer, pending = model.cfg.block_size, _scorer(model), []
    total = -(-len(rows) // batch_size)
    for done, start in enumerate(range(0, len(order), batch_size), start=1):
        chunk = order[start:start + batch_size]
        width = bucket(len(rows[chunk[0]].inputs), block_size)
        inputs, targets = np.zeros((2, batch_size, width), np.int32)
        mask = np.zeros((batch_size, width), bool)
        for b, i in enumerate(chunk):
            n = len(rows[i].inputs)
            inputs[b, :n], targets[b, :n], mask[b, :n] = rows[i].inputs, rows[i].targets, rows[i].mask
        pending.append(scorer(params, inputs, targets, mask))  # dispatched: the next batch is built meanwhile
        if on_batch:
            on_batch(done, total)
    results: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
    for start, (sums, greedy) in zip(range(0, len(order), batch_size), jax.device_get(pending), strict=True):
        for b, i in enumerate(order[start:start + batch_size]):
            results[i] = (float(sums[b]), bool(greedy[b]))
    return results


def score_continuations(model: GPT, params, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                        batch_size: int, on_batch=None) -> list[tuple[float, bool]]:
    """(log p(c | x), greedy(c | x)) of each (context ids, continuation ids); an empty
    continuation scores (0, True). With softmax attention every pair goes through the KV cache
    (`score_cached`: two programs at most, whatever the lengths); with another form each
    is a row of its own (`score_rows`)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    block_size = model.cfg.block_size
    scored = [i for i, (_, c) in enumerate(pairs) if len(c)]
    rows = [continuation_row(pairs[i][0], pairs[i][1], block_size) for i in scored]
    if FORMS[model.cfg.attention].slots_by_position:  # the engine copies a context's cache row by its slots
        requests = [(np.concatenate([row.inputs, row.targets[-1:]]), len(row.inputs) - int(row.mask.sum()))
                    for row in rows]
        scores = score_cached(model, params, requests, batch_size=batch_size, on_batch=on_batch)
    else:
        scores = score_rows(model, params, rows, batch_size=batch_size, on_batch=on_batch)
    results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
    for i, score in zip(scored, scores, strict=True):
        results[i] = score
    return results


# --- the engine: contexts read once into a KV cache, continuations read after them ---------------


def widths(block_size: int) -> tuple[int, int]:
    """(read, score): the tokens of a context each call of the engine reads into the cache
    (block_size/8, at least SCORE_WIDTH) and the tokens of a continuation each call scores
    (SCORE_WIDTH: most continuations a task asks about fit one call)."""
    score = min(block_size, SCORE_WIDTH)
    return min(block_size, max(score, block_size // 8)), score


@dataclasses.dataclass(frozen=True)
class Engine:
    """The calls of `score_cached`, for `rows` rows of a model's cache, each giving its cache
    up to the one it returns (the slots are written in place): read(params, cache, tokens
    (rows, read_width), start (rows,)) → the cache with each row's tokens written in its slots
    start…; score(params, cache, tokens (rows, score_width), start, targets, mask) → (that cache,
    Σ counted log-probs (rows,), all counted targets greedy (rows,)). `programs`: the jitted
    programs behind them, one when the widths are one (a read is then a score that counts nothing)."""

    rows: int
    read_width: int
    score_width: int
    read: Callable
    score: Callable
    programs: tuple


@functools.cache
def engine(model: GPT, rows: int) -> Engine:
    def read(params, cache, tokens, start):
        return model.apply({"params": params}, tokens, cache.replace(index=start))[1]

    def score(params, cache, tokens, start, targets, mask):
        logprobs, greedy, cache = score_targets(model, params, tokens, targets, cache.replace(index=start))
        return cache, jnp.sum(jnp.where(mask, logprobs, 0.0), axis=-1), jnp.all(greedy | ~mask, axis=-1)

    read_width, score_width = widths(model.cfg.block_size)
    scorer = jax.jit(score, donate_argnums=1)
    if read_width != score_width:
        reader = jax.jit(read, donate_argnums=1)
        return Engine(rows, read_width, score_width, reader, scorer, (reader, scorer))

    def read_by_scoring(params, cache, tokens, start):  # one program to compile, not two
        nothing = np.zeros(tokens.shape, np.int32)
        return scorer(params, cache, tokens, start, nothing, nothing.astype(bool))[0]

    return Engine(rows, read_width, score_width, read_by_scoring, scorer, (scorer,))


def prepare(model: GPT, params, batch_size: int) -> None:
    """Compile the engine's programs for batch_size rows and run each once (on nothing that
    counts), so that the first requests find them ready: a caller can do this while it waits
    for something else (the harness, while it builds its tasks). Nothing to do for a model
    whose cache does not keep each token in its position's slot (the engine needs that)."""
    if not FORMS[model.cfg.attention].slots_by_position:
        return
    programs, zeros = engine(model, batch_size), functools.partial(np.zeros, dtype=np.int32)
    rows, cache = programs.rows, _empty_cache(model, params, programs.rows)
    cache = programs.read(params, cache, zeros((rows, programs.read_width)), zeros(rows))
    width = programs.score_width
    jax.block_until_ready(programs.score(params, cache, zeros((rows, width)), zeros(rows), zeros((rows, width)),
                                         np.zeros((rows, width), bool)))


def score_cached(model: GPT, params, requests: Sequence[tuple[np.ndarray, int]], *, batch_size: int,
                 on_batch=None) -> list[tuple[float, bool]]:
    """(Σ log p, all greedy) of each request (tokens s, prefix p): s[:p] is a context read into
    the KV cache, s[p+1:] the continuation counted after it (s: at most block_size + 1 tokens).
    Requests with the same context share it: batch_size contexts are read at a time, longest
    first, a context to a row; then each row scores its context's continuations one after
    another, longest first, each written in the slots after the context (over the one before:
    a slot is attended only by later positions, and a window writes its slots first). Every call
    has one of two shapes (`engine`), so a task compiles two programs at most, whatever its lengths;
    `on_batch(done, total)` follows the calls that score one continuation of each row."""
    programs = engine(model, batch_size)
    groups: dict[bytes, list[int]] = {}
    for i, (tokens, prefix) in enumerate(requests):
        groups.setdefault(tokens[:prefix].tobytes(), []).append(i)
    order = sorted((sorted(g, key=lambda i: -_counted(requests[i])) for g in groups.values()),
                   key=lambda g: -requests[g[0]][1])
    batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    total, done = sum(max(map(len, batch)) for batch in batches), 0
    cache, pending = _empty_cache(model, params, batch_size), []
    for batch in batches:
        cache = _read_contexts(programs, params, cache, [requests[g[0]] for g in batch])
        for j in range(max(map(len, batch))):
            lanes = [group[j] if j < len(group) else None for group in batch]
            cache, calls = _score_lanes(programs, params, cache, [None if i is None else requests[i] for i in lanes])
            pending.append((lanes, calls))
            done += 1
            if on_batch:
                on_batch(done, total)
    results = [(0.0, True)] * len(requests)
    for lanes, calls in jax.device_get(pending):
        for row, i in enumerate(lanes):
            if i is not None:
                results[i] = (sum(float(sums[row]) for sums, _ in calls), all(bool(g[row]) for _, g in calls))
    return results


def _empty_cache(model: GPT, params, rows: int):
    """An empty cache whose every array is a buffer of its own (the programs give theirs up), on
    the device of the params, as the caches the programs return are: the programs compile once."""
    cache = jax.tree.map(jnp.copy, init_cache(model.cfg, rows))
    devices = {device for leaf in jax.tree.leaves(params) if isinstance(leaf, jax.Array) for device in leaf.devices()}
    return jax.device_put(cache, devices.pop()) if len(devices) == 1 else cache


def _counted(request: tuple[np.ndarray, int]) -> int:
    tokens, prefix = request
    return len(tokens) - 1 - prefix


def _read_contexts(programs: Engine, params, cache, contexts: list[tuple[np.ndarray, int]]):
    """The cache with each context s[:p] written in its row's slots 0…p−1, read_width tokens a
    call. A row that has read its context reads its last window again (the same keys and
    values in the same slots); the slots past a context hold what no later query attends to
    (a slot is attended only by later positions, which write it first)."""
    width = programs.read_width
    for step in range(-(-max(prefix for _, prefix in contexts) // width)):
        tokens, start = np.zeros((programs.rows, width), np.int32), np.zeros(programs.rows, np.int32)
        for row, (sequence, prefix) in enumerate(contexts):
            start[row] = first = min(step * width, max(0, prefix - width))
            window = sequence[first:min(first + width, prefix)]
            tokens[row, :len(window)] = window
        cache = programs.read(params, cache, tokens, start)
    return cache


def _score_lanes(programs: Engine, params, cache, lanes: list[tuple[np.ndarray, int] | None]):
    """(the cache, the (sums, greedy) of each call) that score one continuation in each row
    (None: the row has none left), score_width counted targets a call, after the context in the
    row's slots; each window stays within the block (the last one of a long continuation starts
    earlier and reads again what the row holds). A row done early reads its last window again."""
    width, block_size, rows = programs.score_width, cache.max_length, programs.rows
    calls = []
    for step in range(-(-max(_counted(lane) for lane in lanes if lane is not None) // width)):
        tokens, targets = np.zeros((2, rows, width), np.int32)
        mask, start = np.zeros((rows, width), bool), np.zeros(rows, np.int32)
        for row, lane in enumerate(lanes):
            if lane is None:
                continue  # the row's context is done with: what it reads there matters to nobody
            sequence, prefix = lane
            end = len(sequence) - 1  # the inputs are sequence[:end], position p predicting sequence[p + 1]
            low = prefix + min(step, max(0, -(-(end - prefix) // width) - 1)) * width
            start[row] = first = min(low, block_size - width)
            window = sequence[first:min(first + width, end) + 1]
            tokens[row, :len(window) - 1], targets[row, :len(window) - 1] = window[:-1], window[1:]
            positions = first + np.arange(width)
            mask[row] = (positions >= max(low, prefix + step * width)) & (positions < end)
        cache, sums, greedy = programs.score(params, cache, tokens, start, targets, mask)
        calls.append((sums, greedy))
    return cache, calls


def score_texts(model: GPT, params, texts: Sequence[Sequence[int]], *, batch_size: int, stride: int | None = None,
                on_batch=None) -> list[float]:
    """log p(t) of each token sequence t (its first token the prefix, not scored), summed over
    the windows `text_rows` makes; the windows of all texts share batches."""
    rows = [text_rows(tokens, model.cfg.block_size, stride) for tokens in texts]
    scores = iter(score_rows(model, params, [row for windows in rows for row in windows], batch_size=batch_size,
                             on_batch=on_batch))
    return [sum(next(scores)[0] for _ in windows) for windows in rows]


# --- text the tokenizer cannot encode ----------------------------------------------------------


class UnknownTally:
    """Counts the pieces of text (characters, words) a tokenizer without a token for them
    encodes as <|unk|>, so that a caller can say so once, with the count."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.pieces = self.texts = self.seen = 0

    def add(self, text: str) -> None:
        self.seen += 1
        if self.tokenizer.unk_id is None:
            return  # a byte-level BPE encodes every string
        found = self.tokenizer.count_unknown(text)
        self.pieces += found
        self.texts += bool(found)

    def message(self, what: str = "requests") -> str | None:
        """One line about the unknown pieces counted since the last message, or None; counting
        starts again."""
        pieces, texts, seen = self.pieces, self.texts, self.seen
        self.pieces = self.texts = self.seen = 0
        if not pieces:
            return None
        return (f"{pieces} piece(s) of text in {texts} of {seen} {what} have no token in the model's "
                f"{self.tokenizer.kind} tokenizer: they were read as <|unk|>, so their scores mean less")
