"""Multiple choice without the harness: each item's choices scored by the model, as the
lm-evaluation-harness scores a `multiple_choice` task, and the harness's accuracies.

An item is a context, its choices and the index of the right one: a JSONL record
{"context", "choices", "label"}, or HellaSwag's {"ctx", "endings", "label"} (llm.c's
hellaswag.py reads the same). Choice j is scored as the continuation " " + choice_j of the
context (the harness's target_delimiter), encoded as the harness encodes a request
(`encode_request`), with ℓ_j = log p(" " + choice_j | context) (`jaxgpt.score.likelihood`). Then, as
`lm_eval.api.task.ConfigurableTask.process_results` defines them:

    acc       = [argmax_j ℓ_j = label]
    acc_norm  = [argmax_j ℓ_j / len(choice_j) = label]        len in characters, no delimiter
    acc_bytes = [argmax_j ℓ_j / bytes(choice_j) = label]      its UTF-8 bytes

each averaged over the items (ties go to the first choice, as NumPy's argmax).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from jaxgpt.model import GPT
from jaxgpt.score.likelihood import UnknownTally, prefix_id, score_continuations
from jaxgpt.tokenizers import Tokenizer

DELIMITER = " "  # the harness's default target_delimiter
FORMS = (("context", "choices"), ("ctx", "endings"))  # the fields of an item: ours, HellaSwag's


@dataclasses.dataclass(frozen=True)
class Item:
    context: str
    choices: tuple[str, ...]
    label: int


def read_items(path: str | Path) -> list[Item]:
    """The items of a JSONL file, one record per line (blank lines skipped); ValueError, naming
    the file and line, for a line that is not an item."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read the choices file {path} ({err.strerror if isinstance(err, OSError) else err}):"
                         " give a JSONL file of {context, choices, label} records") from None
    items = [_item(line, f"{path}:{number}") for number, line in enumerate(lines, start=1) if line.strip()]
    if not items:
        raise ValueError(f"{path} holds no items: give one {{context, choices, label}} record per line")
    return items


def _item(line: str, where: str) -> Item:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not JSON ({err.msg}): give one record per line") from None
    form = next((f for f in FORMS if isinstance(record, dict) and all(k in record for k in f)), None)
    if form is None:
        raise ValueError(f"{where} needs the fields context, choices and label (or HellaSwag's ctx, endings, label)")
    context, choices, label = record[form[0]], record[form[1]], record.get("label")
    if not isinstance(context, str) or not isinstance(choices, list) or not choices \
            or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"{where}: {form[0]} must be a string and {form[1]} a non-empty list of strings")
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)  # HellaSwag's labels are strings in some copies
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
        raise ValueError(f"{where}: label must be the index of the right choice, 0…{len(choices) - 1}, got {label!r}")
    return Item(context, tuple(choices), label)


def encode_request(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as the harness makes them for a causal model: the
    context's trailing whitespace moves to the continuation, context + continuation is encoded
    whole and split after the context's own tokens; an empty context is the prefix token."""
    if not context:
        ids = tokenizer.encode(continuation)
        prefix = prefix_id(tokenizer)
        return ([prefix], ids) if not ids or ids[0] != prefix else (ids[:1], ids[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, context_ids = tokenizer.encode(context + continuation), tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


def score_items(model: GPT, params, tokenizer: Tokenizer, items: Sequence[Item], *, batch_size: int,
                on_batch: Callable[[int, int], None] | None = None) -> tuple[list[list[float]], str | None]:
    """Each item's ℓ_j, and one line about text the tokenizer had no token for (None if none)."""
    tally, pairs = UnknownTally(tokenizer), []
    for item in items:
        for choice in item.choices:
            tally.add(item.context + DELIMITER + choice)
            pairs.append(encode_request(tokenizer, item.context, DELIMITER + choice))
    scores = iter(score_continuations(model, params, pairs, batch_size=batch_size, on_batch=on_batch))
    return [[next(scores)[0] for _ in item.choices] for item in items], tally.message("choices")


def accuracies(items: Sequence[Item], loglikelihoods: Sequence[Sequence[float]]) -> tuple[dict, list[dict]]:
    """({items, acc, acc_norm, acc_bytes}, a prediction row per item) by the module's definitions."""
    rows = []
    for index, (item, lls) in enumerate(zip(items, loglikelihoods, strict=True)):
        lls = np.asarray(lls, np.float64)
        chars = np.array([len(c) for c in item.choices], np.float64)
        size = np.array([len(c.encode("utf-8")) for c in item.choices], np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):  # an empty choice: as the harness, ±inf or nan
            picks = {"prediction": lls, "prediction_norm": lls / chars, "prediction_bytes": lls / size}
            picks = {name: int(np.argmax(values)) for name, values in picks.items()}
        rows.append({"index": index, "label": item.label, **picks, "loglikelihoods": lls.tolist()})
    summary = {"items": len(rows)}
    for metric, column in (("acc", "prediction"), ("acc_norm", "prediction_norm"), ("acc_bytes", "prediction_bytes")):
        summary[metric] = float(np.mean([row[column] == row["label"] for row in rows]))
    return summary, rows
