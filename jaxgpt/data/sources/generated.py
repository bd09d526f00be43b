"""Records the project makes itself: tasks with a checkable answer, for fine-tuning demos and
tests on any machine, with nothing to download.

`data.source = 'generated:NAME[:COUNT]'` names one; it is written once, as JSONL, under the
data cache (the same records on every machine: a fixed seed) and read like any records file,
with data.records.template = 'qa' (fields question, answer):

    addition   {"question": "482+37", "answer": "519"}: two numbers in 0…999, every
               pair at most once (default 20000 records)
    reverse    {"question": "Reverse: kdqab", "answer": "baqdk"}: 3 to 8 letters of a–k
               (default 20000 records)
    lookup     {"context": "fruit=fig city=Lima color=red metal=tin", "question": "What is the
               city?", "answer": "Lima"}: a row of a generated table (4 of its 5 columns in a
               random order, each value one of 10) and one of its fields asked for: the
               answer is in the context, not in the model's memory (default 20000 records)
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from jaxgpt.data.sources.files import files_source
from jaxgpt.data.sources.registry import Source, SourceKind, register
from jaxgpt.data_config import DataConfig
from jaxgpt.errors import DataError
from jaxgpt.files import write_atomically

PREFIX = "generated:"
DEFAULT_COUNT = 20000
SEED = 1234
VERSION = 4  # in the file's name: raise it whenever a task's records change


def _addition(rng: random.Random, count: int) -> list[dict[str, str]]:
    if count > 10**6:
        raise DataError(f"generated:addition has 10^6 distinct problems, fewer than {count}")
    seen: set[tuple[int, int]] = set()
    records = []
    while len(records) < count:
        a, b = rng.randrange(1000), rng.randrange(1000)
        if (a, b) not in seen:
            seen.add((a, b))
            records.append({"question": f"{a}+{b}", "answer": str(a + b)})
    return records


def _reverse(rng: random.Random, count: int) -> list[dict[str, str]]:
    letters = "abcdefghijk"
    records = []
    for _ in range(count):
        word = "".join(rng.choices(letters, k=rng.randint(3, 8)))
        records.append({"question": f"Reverse: {word}", "answer": word[::-1]})
    return records


LOOKUP_FIELDS = {
    "color": ("red", "blue", "green", "black", "white", "amber", "violet", "grey", "pink", "brown"),
    "city": ("Oslo", "Lima", "Rome", "Kyiv", "Pune", "Graz", "Nice", "Bern", "Cork", "Faro"),
    "animal": ("cat", "owl", "fox", "yak", "eel", "bee", "elk", "ram", "ant", "cod"),
    "fruit": ("fig", "lime", "pear", "plum", "kiwi", "date", "apple", "grape", "lemon", "mango"),
    "metal": ("tin", "iron", "gold", "zinc", "lead", "copper", "silver", "nickel", "cobalt", "bronze"),
}


def _lookup(rng: random.Random, count: int) -> list[dict[str, str]]:
    records = []
    for _ in range(count):
        keys = rng.sample(sorted(LOOKUP_FIELDS), 4)
        row = {key: rng.choice(LOOKUP_FIELDS[key]) for key in keys}
        asked = rng.choice(keys)
        records.append({"context": " ".join(f"{key}={value}" for key, value in row.items()),
                        "question": f"What is the {asked}?", "answer": row[asked]})
    return records


TASKS: dict[str, Callable[[random.Random, int], list[dict[str, str]]]] = {
    "addition": _addition, "reverse": _reverse, "lookup": _lookup}


@register
class Generated(SourceKind):
    """'generated:NAME[:COUNT]': a task's records, written once under the data cache."""

    scheme = "generated"
    form = "generated:NAME[:COUNT]"

    def open(self, spec: str, settings: DataConfig) -> Source:
        return files_source(spec, spec.replace(":", "-"), self.record_files(spec, settings), settings)

    def record_files(self, spec: str, settings: DataConfig) -> list[Path]:
        return [generated_file(spec, settings.cache_path)]


def generated_file(spec: str, cache_dir: Path) -> Path:
    """The JSONL file of `spec` ('generated:NAME[:COUNT]'), written on first use."""
    name, _, count_text = spec[len(PREFIX):].partition(":")
    if name not in TASKS or (count_text and not (count_text.isdigit() and int(count_text) > 1)):
        raise DataError(f"data.source={spec!r}: choose 'generated:NAME' or 'generated:NAME:COUNT' (COUNT > 1) with "
                        f"NAME one of {', '.join(TASKS)}")
    count = int(count_text) if count_text else DEFAULT_COUNT
    path = cache_dir / "generated" / f"{name}-{count}-seed{SEED}-v{VERSION}.jsonl"
    if not path.is_file():
        records = TASKS[name](random.Random(SEED), count)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, "".join(json.dumps(r) + "\n" for r in records).encode("utf-8"))
    return path
