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
of `batch_size` (the last one filled with empty rows) and padded to a power of two
(`bucket`), so that a task compiles a handful of programs, one per bucket, however many
requests and lengths it has.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt import data
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
    """The padded width of rows up to `length` tokens: the next power of two, at least
    MIN_BUCKET, at most block_size."""
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
    continuation scores (0, True)."""
    block_size = model.cfg.block_size
    rows = [continuation_row(x, c, block_size) for x, c in pairs if len(c)]
    scores = iter(score_rows(model, params, rows, batch_size=batch_size, on_batch=on_batch))
    return [next(scores) if len(c) else (0.0, True) for _, c in pairs]


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
