"""Log-likelihoods of text under a model, batched: the scores benchmark harnesses ask for.

For a continuation c = (c_1 … c_m) of a context x = (x_1 … x_n), with s = x ⊕ c cut from the
left to its last block_size + 1 tokens (the model reads at most block_size):

    log p(c | x) = Σ_{i=1..m} log softmax(logits(s_{<|s|}))_{|s|−m+i−1}[c_i]
    greedy(c | x) = every c_i is the argmax of its row of logits

and for a whole text t, read after a prefix token p (<|eos|>: a jaxgpt corpus puts it before
every document but the first), log p(t) = Σ_j log p(t_j | p, t_{<j}) over the windows of
`jaxgpt.data.eval_batch`: block_size tokens each, `stride` after the last, every target
counted once, exactly as `jaxgpt.evaluation` counts a text's loss.

Every request becomes a row (inputs, targets, mask). Rows are sorted by length, put in batches
of `batch_size` (the last one filled with empty rows) and padded to a `bucket` (a power of two up
to block_size/8, then multiples of it), so that a task compiles a handful of programs, one per
bucket, however many requests and lengths it has.

Continuations that share their context (a multiple-choice item's choices) are scored through
the KV cache (`score_shared`): the context is read once, its cache copied to each of its
continuations, which are then read after it. The same log-probabilities, the context's work
done once instead of once per choice.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt import data
from jaxgpt.attention import init_cache
from jaxgpt.model import GPT
from jaxgpt.tokenizers import Tokenizer

MIN_BUCKET = 16


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
        logits = model.apply({"params": params}, inputs).astype(jnp.float32)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        logprobs = picked - jax.nn.logsumexp(logits, axis=-1)
        greedy = jnp.argmax(logits, axis=-1) == targets
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
    continuation scores (0, True). Continuations that share a context and fit the block after
    it go through `score_shared`; the others are rows of their own."""
    block_size = model.cfg.block_size
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (x, c) in enumerate(pairs):
        if len(c):
            groups.setdefault(tuple(x), []).append(i)
    shared = [g for x, g in groups.items() if len(g) > 1 and x and sharable(model, len(x), g, pairs)]
    alone = sorted(set(range(len(pairs))) - {i for g in shared for i in g})
    results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
    rows = [continuation_row(pairs[i][0], pairs[i][1], block_size) for i in alone if len(pairs[i][1])]
    scores = iter(score_rows(model, params, rows, batch_size=batch_size, on_batch=on_batch))
    for i in alone:
        if len(pairs[i][1]):
            results[i] = next(scores)
    if shared:
        for group, group_scores in zip(shared, score_shared(model, params, pairs, shared, batch_size), strict=True):
            for i, score in zip(group, group_scores, strict=True):
                results[i] = score
    return results


def sharable(model: GPT, context_length: int, group: list[int], pairs) -> bool:
    """Whether a group's context can be read once into a KV cache: softmax attention (whose
    cache a padded read leaves usable), and the context and each continuation in the block."""
    longest = max(len(pairs[i][1]) for i in group)
    block_size = model.cfg.block_size
    return (model.cfg.attention == "softmax"
            and bucket(context_length, block_size) + bucket(longest, block_size) <= block_size)


@functools.cache
def _shared_scorer(model: GPT):
    """The jitted (params, contexts (G, W), lengths (G,), continuations (G, K, M), mask) →
    (Σ log-probs, all greedy) (G, K): each context read once into a KV cache, its K
    continuations read after it from copies of that cache."""

    def score(params, contexts, lengths, continuations, mask):
        (groups, width), (_, k, m) = contexts.shape, continuations.shape
        cache = init_cache(model.cfg, groups, width + m)
        logits, cache = model.apply({"params": params}, contexts, cache)
        first = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)  # (G, 1, V): predicts c_1
        cache = jax.tree.map(lambda a: jnp.repeat(a, k, axis=0), cache.replace(index=lengths))
        rows = continuations.reshape(groups * k, m)
        after, _ = model.apply({"params": params}, rows, cache)  # row j predicts c_{j+2}
        logits = jnp.concatenate([jnp.repeat(first, k, axis=0), after[:, :-1]], axis=1).astype(jnp.float32)
        picked = jnp.take_along_axis(logits, rows[..., None], axis=-1)[..., 0]
        logprobs, counted = picked - jax.nn.logsumexp(logits, axis=-1), mask.reshape(groups * k, m)
        greedy = jnp.all((jnp.argmax(logits, axis=-1) == rows) | ~counted, axis=-1)
        return jnp.sum(jnp.where(counted, logprobs, 0.0), axis=-1).reshape(groups, k), greedy.reshape(groups, k)

    return jax.jit(score)


def score_shared(model: GPT, params, pairs, groups: list[list[int]], batch_size: int) -> list[list[tuple[float, bool]]]:
    """The scores of each group's continuations (all of one context), batch_size continuations
    to a batch: max(1, batch_size // K) groups of up to K (the largest group's size)."""
    k = max(len(g) for g in groups)
    per_batch, block_size, scorer = max(1, batch_size // k), model.cfg.block_size, _shared_scorer(model)
    order = sorted(range(len(groups)), key=lambda g: -len(pairs[groups[g][0]][0]))
    chunks = [order[start:start + per_batch] for start in range(0, len(order), per_batch)]
    chunks = [part for chunk in chunks for part in _within_block(chunk, groups, pairs, block_size)]
    pending = []
    for chunk_order in chunks:
        chunk = [groups[g] for g in chunk_order]
        width, m = _widths(chunk, pairs, block_size)
        contexts, lengths = np.zeros((per_batch, width), np.int32), np.ones(per_batch, np.int32)
        continuations, mask = np.zeros((per_batch, k, m), np.int32), np.zeros((per_batch, k, m), bool)
        for b, g in enumerate(chunk):
            context = pairs[g[0]][0]
            contexts[b, :len(context)], lengths[b] = context, len(context)
            for j, i in enumerate(g):
                c = pairs[i][1]
                continuations[b, j, :len(c)], mask[b, j, :len(c)] = c, True
        pending.append(scorer(params, contexts, lengths, continuations, mask))
    results: list[list[tuple[float, bool]]] = [[] for _ in groups]
    for chunk_order, (sums, greedy) in zip(chunks, jax.device_get(pending), strict=True):
        for b, g in enumerate(chunk_order):
            results[g] = [(float(sums[b, j]), bool(greedy[b, j])) for j in range(len(groups[g]))]
    return results


def _widths(chunk: list[list[int]], pairs, block_size: int) -> tuple[int, int]:
    """The buckets of a batch's longest context and longest continuation."""
    return (bucket(max(len(pairs[g[0]][0]) for g in chunk), block_size),
            bucket(max(len(pairs[i][1]) for g in chunk for i in g), block_size))


def _within_block(chunk: list[int], groups, pairs, block_size: int) -> list[list[int]]:
    """The batch, or, when its widest context and widest continuation together pass the block,
    each of its groups alone (each fits: `sharable`)."""
    if sum(_widths([groups[g] for g in chunk], pairs, block_size)) <= block_size:
        return [chunk]
    return [[g] for g in chunk]


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
