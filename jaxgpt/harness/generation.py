"""Generation for the harness's generate_until: batches of prompts decoded by
`jaxgpt.decode.sampling.stream` (the compiled step of `generate`, with the KV cache) until every row
has drawn <|eos|>, written one of the stop strings, or drawn max_new_tokens tokens."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import jax
import numpy as np

from jaxgpt.config import GPTConfig
from jaxgpt.decode import sampling
from jaxgpt.tokenizers import Tokenizer

log = logging.getLogger(__name__)
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p")


def sampling_options(gen_kwargs: dict, *, max_new_tokens: int, eos_id: int, pad_id: int) -> sampling.SamplingOptions:
    """The harness's normalised generation kwargs as jaxgpt's options: greedy unless do_sample
    with a temperature > 0; top_k and top_p as given; other keys are said to be ignored."""
    ignored = sorted(set(gen_kwargs) - set(SAMPLING_KEYS))
    if ignored:
        log.warning("jaxgpt: generation kwargs %s are not jaxgpt sampling options; ignored", ", ".join(ignored))
    temperature = float(gen_kwargs.get("temperature") or 0.0) if gen_kwargs.get("do_sample") else 0.0
    top_k, top_p = gen_kwargs.get("top_k"), gen_kwargs.get("top_p")
    return sampling.SamplingOptions(max_new_tokens=max_new_tokens, temperature=temperature,
                                    top_k=int(top_k) if top_k else None, top_p=float(top_p) if top_p else None,
                                    eos_id=eos_id, pad_id=pad_id)


def generate_texts(params, config: GPTConfig, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]],
                   gen_kwargs: dict, until: Sequence[str], *, max_new_tokens: int, batch_size: int, key) -> list[str]:
    """The text each prompt's new tokens decode to (special tokens dropped), not yet cut at the
    stop strings. The longest prompts go first, batch_size to a batch; a short last batch is
    filled with copies of its first prompt so that every batch has one shape."""
    eos_id = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.bos_id
    options = sampling_options(gen_kwargs, max_new_tokens=max_new_tokens, eos_id=eos_id,
                               pad_id=tokenizer.pad_id if tokenizer.pad_id is not None else eos_id)
    stops = [stop for stop in until if stop]
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    texts = [""] * len(prompts)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        rows = [list(prompts[i]) for i in chunk]
        rows += [rows[0]] * (batch_size - len(rows))
        key_of_batch = jax.random.fold_in(key, start)
        new = _until_stopped(params, config, tokenizer, rows, len(chunk), options, stops, key_of_batch)
        for row, i in enumerate(chunk):
            texts[i] = new[row]
    return texts


def _until_stopped(params, config, tokenizer, rows, real_rows: int, options, stops, key) -> list[str]:
    """Each row's new text, decoding step by step until each of the first real_rows rows has
    stopped (<|eos|>, a stop string in its text, or max_new_tokens)."""
    tokens: list[list[int]] = [[] for _ in rows]
    done = np.arange(len(rows)) >= real_rows  # the filling rows never hold generation up
    for step in sampling.stream(params, config, rows, key, options):
        for b in np.flatnonzero(step.active & ~done):
            if step.token[b] < tokenizer.vocab_size:  # a model's padded vocabulary has ids without text
                tokens[b].append(int(step.token[b]))
            done[b] = any(stop in tokenizer.decode(tokens[b]) for stop in stops)
        done |= ~step.active | (step.token == options.eos_id)
        if done.all():
            break
    return [tokenizer.decode(row) for row in tokens]
