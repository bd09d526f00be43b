"""Completions of records: the model's greedy answer to each held-out example, scored against
the reference (eval.py --records), and a record's prompt formatted as training formatted it
(sample.py --record).

An example of a records corpus (jaxgpt.data.Examples) is

    prompt₁ completion₁ <|eos|>  …  prompt_n completion_n <|eos|>

with the loss mask 1 on each completion and its <|eos|>. Its last run of mask-1 tokens is the
last completion: the prompt is every token before it (earlier turns' completions and their
<|eos|> included, as training saw them), the reference is that run without its <|eos|>. The
prediction is decoded greedily (temperature 0) from the prompt until <|eos|> or
max_new_tokens (default: the longest reference + MARGIN_TOKENS).

Scores, per example, then averaged over the examples:

    exact match   prediction.strip() == reference.strip()
    token F1      SQuAD-style, on bags of words: both texts lower-cased and split on
                  whitespace (no removal of punctuation or articles, unlike SQuAD's
                  normalisation: an answer's form counts); c = the words they share (as
                  multisets), precision p = c/|prediction|, recall r = c/|reference|,
                  F1 = 2pr/(p + r), 0 when c = 0; 1 when both are empty, 0 when only one is.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxgpt.config import DataConfig, GPTConfig, RecordsConfig
from jaxgpt.data import Examples, encode_turns
from jaxgpt.data.records import PRESETS, Record, Template, Templates, chat_turns, templates
from jaxgpt.decode.sampling import SamplingOptions, generate
from jaxgpt.decode.text import encode_prompt
from jaxgpt.tokenizers import Tokenizer

MARGIN_TOKENS = 8  # new tokens allowed beyond the longest reference (one is the <|eos|>)
RUN_TEMPLATE = "run"  # sample.py --template: the run's own templates
_OPTIONAL = re.compile(r"\[\[.*?\]\]", re.DOTALL)


# --- the scores -------------------------------------------------------------------------------


def exact_match(prediction: str, reference: str) -> bool:
    """Whether the texts are equal once surrounding whitespace is stripped."""
    return prediction.strip() == reference.strip()


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD-style F1 of the bags of lower-cased, whitespace-separated words (module docstring)."""
    predicted, expected = prediction.lower().split(), reference.lower().split()
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


# --- prompts and references of examples ---------------------------------------------------------


def split_last_completion(tokens: np.ndarray, mask: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, reference) of an example: the tokens before its last completion (the last run
    of mask-1 tokens), and that completion without the <|eos|> that ends it."""
    tokens, mask = np.asarray(tokens), np.asarray(mask).astype(bool)
    if not mask.any():
        raise ValueError("the example has no completion (its loss mask is all 0)")
    end = int(np.flatnonzero(mask)[-1]) + 1
    zeros = np.flatnonzero(~mask[:end])
    start = int(zeros[-1]) + 1 if len(zeros) else 0
    # two completions with no prompt between them form one run: the last <|eos|> inside it ends the earlier
    inner = np.flatnonzero(tokens[start:end - 1] == eos_id)
    if len(inner):
        start += int(inner[-1]) + 1
    stop = end - 1 if tokens[end - 1] == eos_id else end
    return tokens[:start], tokens[start:stop]


# --- greedy decoding and the evaluation ---------------------------------------------------------


def greedy_completions(params, config: GPTConfig, prompts: Sequence[np.ndarray], *, eos_id: int | None,
                       max_new_tokens: int, batch_size: int,
                       on_batch: Callable[[int, int], None] | None = None) -> list[np.ndarray]:
    """Each prompt's greedy continuation (without the <|eos|> that stopped it), by the jitted
    `jaxgpt.decode.sampling.generate`, batch_size prompts at a time. The prompts go in order of
    length (less padding); the last batch is filled up with copies of its last prompt, so
    every batch has one shape. `on_batch(done, total)` after each batch."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    order = np.argsort([len(p) for p in prompts], kind="stable")
    options = SamplingOptions(max_new_tokens, temperature=0.0, eos_id=eos_id)
    key = jax.random.key(0)  # greedy: never drawn from
    results: list[np.ndarray | None] = [None] * len(prompts)
    total = -(-len(prompts) // batch_size)
    for number, first in enumerate(range(0, len(prompts), batch_size), start=1):
        chosen = list(order[first:first + batch_size])
        batch = [np.asarray(prompts[i]) for i in chosen]
        batch += [batch[-1]] * (batch_size - len(batch))
        new = generate(params, config, batch, key, options).new_tokens()
        for i, tokens in zip(chosen, new, strict=False):
            results[i] = tokens[:-1] if len(tokens) and eos_id is not None and tokens[-1] == eos_id else tokens
        if on_batch:
            on_batch(number, total)
    return results


def evaluate_completions(params, config: GPTConfig, tokenizer: Tokenizer, examples: Examples, *, batch_size: int,
                         max_new_tokens: int | None = None, max_records: int | None = None,
                         on_batch: Callable[[int, int], None] | None = None) -> tuple[dict, list[dict]]:
    """The model's greedy completion of each example's last prompt (the first max_records
    examples), scored against the reference. Returns the summary {"records", "exact_match",
    "token_f1", "max_new_tokens", "skipped"} and one row per example scored: {"record" (where
    it came from), "prompt" (special tokens shown), "reference", "prediction", "exact", "f1"}.
    An example with nothing before its last completion cannot be prompted: it is skipped."""
    eos_id = tokenizer.eos_id
    count = len(examples) if max_records is None else min(len(examples), max_records)
    chosen, prompts, references = [], [], []
    for i in range(count):
        prompt, reference = split_last_completion(*examples.example(i), eos_id)
        if len(prompt):
            chosen.append(i)
            prompts.append(prompt)
            references.append(reference)
    skipped = count - len(chosen)
    if not chosen:
        raise ValueError(f"no example to evaluate: the split holds {len(examples)} example(s)"
                         + (f", {skipped} without a prompt" if skipped else ""))
    if max_new_tokens is None:
        max_new_tokens = max(len(r) for r in references) + MARGIN_TOKENS
    predictions = greedy_completions(params, config, prompts, eos_id=eos_id, max_new_tokens=max_new_tokens,
                                     batch_size=batch_size, on_batch=on_batch)
    rows = []
    for i, prompt, reference, predicted in zip(chosen, prompts, references, predictions, strict=True):
        reference_text, prediction_text = tokenizer.decode(reference), tokenizer.decode(predicted)
        rows.append({"record": examples.where(i), "prompt": tokenizer.decode(prompt, keep_special=True),
                     "reference": reference_text, "prediction": prediction_text,
                     "exact": exact_match(prediction_text, reference_text),
                     "f1": token_f1(prediction_text, reference_text)})
    summary = {"records": len(rows), "exact_match": float(np.mean([r["exact"] for r in rows])),
               "token_f1": float(np.mean([r["f1"] for r in rows])), "max_new_tokens": max_new_tokens,
               "skipped": skipped}
    return summary, rows


# --- a record's prompt, as training formatted it --------------------------------------------------


def templates_named(name: str, data: Mapping[str, Any] | None = None) -> Templates:
    """The Templates of a preset (jaxgpt.data.records.PRESETS), or with name 'run' those of a
    run's data section (its config.json's "data"), which must be a records run's."""
    if name != RUN_TEMPLATE:
        if name not in PRESETS:
            raise ValueError(f"--template {name!r} is not a preset: choose one of {', '.join(PRESETS)}, or "
                             f"{RUN_TEMPLATE!r} for the run's own")
        return templates(RecordsConfig(template=name))
    settings = DataConfig.from_mapping(data or {})  # a saved data section, its sections or the flat keys before
    if settings.format != "records":
        raise ValueError(f"the run trained on {settings.format!r} data, not records, so it has no "
                         f"template: name a preset with --template ({', '.join(PRESETS)})")
    return templates(settings.records)


def required_fields(template: Template) -> list[str]:
    """The fields a template cannot do without (those outside its optional [[…]] parts), in order."""
    return Template(_OPTIONAL.sub("", template.text)).fields()


def prompt_record(forms: Templates, text: str) -> dict[str, Any]:
    """The record a raw prompt stands for: for chat, one user message; else the text fills the
    first required field of the prompt template (qa: question, alpaca: instruction,
    prompt_completion: prompt)."""
    if forms.chat:
        return {"messages": [{"role": "user", "content": text}]}
    fields = required_fields(forms.prompt)
    if not fields:
        raise ValueError(f"the prompt template {forms.prompt.text!r} has no required field for the prompt to fill: "
                         "give the fields with --record JSON")
    record: dict[str, Any] = {}
    node = record
    *parents, last = fields[0].split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = text
    return record


def record_prompt(forms: Templates, fields: Mapping[str, Any], tokenizer: Tokenizer) -> tuple[str, list[int]]:
    """(the prompt's text, its ids) for a record, as training formatted the prompt before its
    completion: the prompt template rendered; for chat, every earlier turn with its
    completion and <|eos|>, then the messages since the last assistant turn and
    'Assistant: '. A one-line ValueError for a field the prompt template needs and the
    record lacks, or text the tokenizer cannot encode."""
    if not isinstance(fields, Mapping):
        raise ValueError(f"a record is a JSON object of fields, not a {type(fields).__name__}")
    record = Record(dict(fields), 0, 1, "the record")
    if forms.chat:
        turns = chat_turns(record, final_prompt=True)
        encode_prompt(tokenizer, "".join(prompt + completion for prompt, completion in turns))  # checks the text
        ids = encode_turns(turns, tokenizer)[0].tolist()
        return tokenizer.decode(ids, keep_special=True), ids
    for name in required_fields(forms.prompt):
        if not _has_field(fields, name):
            raise ValueError(f"the record has no field {name!r}, which the prompt template {forms.prompt.text!r} "
                             f"needs: add it, e.g. {{\"{name}\": \"…\"}}")
    text = forms.prompt.render(record)
    return text, encode_prompt(tokenizer, text)


def _has_field(fields: Mapping[str, Any], name: str) -> bool:
    """Whether a template's `{name}` (dotted: nested keys, list indices) finds a value."""
    value: Any = fields
    for key in name.split("."):
        if isinstance(value, Mapping) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return False
    return True
