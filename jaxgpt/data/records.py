"""Records: rows of .jsonl, .json, .csv and .tsv files turned into prompt → completion examples.

A record is a mapping of field names to values: a JSON object (one per line of a .jsonl
file; a .json file holds an array of them, or a table {"columns": [...], "rows": [[...]]}),
or a row of a .csv / .tsv file whose header row names the fields. A template turns each
record into an example: a list of turns (prompt, completion). The tokens of an example are

    prompt₁ completion₁ <|eos|>  prompt₂ completion₂ <|eos|>  …

and the loss falls on each completion and the <|eos|> that ends it (`data.records.loss_on`).

Templates are text with `{field}` placeholders; `{a.b}` reaches into nested objects, `{a.0}`
into lists; `{{` and `}}` are literal braces; a part in `[[…]]` is left out when a field it
names is missing or empty (Alpaca's input). The presets (`data.records.template`):

    prompt_completion   {prompt} → {completion}
    alpaca              ### Instruction:\\n{instruction}\\n\\n[[### Input:\\n{input}\\n\\n]]### Response:\\n → {output}
    qa                  [[Context: {context}\\n]]Question: {question}\\nAnswer:  → {answer}
    chat                {"messages": [{"role", "content"}, …]}: "Role: content\\n" per message;
                        each assistant turn is a completion after "Assistant: ", and all before it prompt

Every problem with a record is a one-line DataError naming the file and line (or record),
and what to do. Files are read as UTF-8: bytes that are not become U+FFFD, with one warning per
file that names it and counts them.
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import io
import json
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxgpt.data_config import RecordsConfig
from jaxgpt.errors import DataError

RECORD_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv")
Turn = tuple[str, str]  # (prompt, completion)


@dataclasses.dataclass(frozen=True)
class Record:
    """A record and where it came from: `where` names it in messages ('data.jsonl:17')."""

    fields: Mapping[str, Any]
    file: int  # index into the source's files
    number: int  # line (jsonl, csv, tsv) or record (json) number, from 1
    where: str


# --- reading ------------------------------------------------------------------------------------


def read_records(files: Sequence[Path], first_file: int = 0) -> Iterator[Record]:
    """Every record of the files, in order; Record.file counts the files from first_file."""
    for index, path in enumerate(files, start=first_file):
        suffix = path.suffix.lower()
        if suffix not in RECORD_SUFFIXES:
            raise DataError(f"{path} is not a records file: data.format='records' reads {', '.join(RECORD_SUFFIXES)} "
                            "files (set data.format='text' for documents)")
        text = _text(path)
        if suffix == ".jsonl":
            yield from _jsonl(text, path, index)
        elif suffix == ".json":
            yield from _json(text, path, index)
        else:
            yield from _table(text, path, index, "\t" if suffix == ".tsv" else ",")


def _text(path: Path) -> str:
    """A records file's text (a leading byte-order mark dropped); undecodable bytes are replaced,
    and counted in a warning."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = raw.decode("utf-8-sig", "replace")
    replaced = text.count("\ufffd") - raw.count("\ufffd".encode())  # U+FFFD that the file holds is text
    warnings.warn(f"{path} is not UTF-8: {replaced} undecodable byte sequence(s) became U+FFFD in its records; "
                  "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) to keep those characters", stacklevel=3)
    return text


def _jsonl(text: str, path: Path, index: int) -> Iterator[Record]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number} is not valid JSON ({err.msg}); a .jsonl file holds one JSON object "
                            "per line") from None
        if not isinstance(fields, dict):
            raise DataError(f"{path}:{number} holds a JSON {type(fields).__name__}, not an object; a records file "
                            "holds one object per line")
        yield Record(fields, index, number, f"{path}:{number}")


def _json(text: str, path: Path, index: int) -> Iterator[Record]:
    try:
        content = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno} is not valid JSON ({err.msg}); a .json records file holds an array "
                        "of objects") from None
    if isinstance(content, dict) and set(content) == {"columns", "rows"}:
        content = _table_rows(content, path)
    if not isinstance(content, list):
        raise DataError(f"{path} holds a JSON {type(content).__name__}; a .json records file holds an array of "
                        'objects, or a table {"columns": [...], "rows": [[...], ...]}')
    for number, fields in enumerate(content, start=1):
        if not isinstance(fields, dict):
            raise DataError(f"{path} record {number} is a JSON {type(fields).__name__}, not an object")
        yield Record(fields, index, number, f"{path} record {number}")


def _table_rows(table: dict, path: Path) -> list[dict]:
    columns, rows = table["columns"], table["rows"]
    if not (isinstance(columns, list) and all(isinstance(c, str) for c in columns) and isinstance(rows, list)):
        raise DataError(f'{path}: a JSON table is {{"columns": [names...], "rows": [[values...], ...]}}')
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, list) or len(row) != len(columns):
            raise DataError(f"{path} row {number} has {len(row) if isinstance(row, list) else 'no'} values for "
                            f"{len(columns)} columns; give every row one value per column")
    return [dict(zip(columns, row, strict=True)) for row in rows]


def _table(text: str, path: Path, index: int, delimiter: str) -> Iterator[Record]:
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    header = next(reader, None)
    if not header:
        raise DataError(f"{path} has no header row; the first row of a {path.suffix} file names the fields")
    for row in reader:
        if not row:
            continue
        if len(row) != len(header):
            raise DataError(f"{path}:{reader.line_num} has {len(row)} columns, the header has {len(header)}; quote "
                            f"fields that hold {'a tab' if delimiter == chr(9) else 'a comma'} or a line break")
        yield Record(dict(zip(header, row, strict=True)), index, reader.line_num, f"{path}:{reader.line_num}")


# --- templates ----------------------------------------------------------------------------------

_PIECE = re.compile(r"\{\{|\}\}|\[\[|\]\]|\{([^{}]*)\}")


@dataclasses.dataclass(frozen=True)
class Template:
    """A template's text, parsed: literal text, placeholders and optional parts."""

    text: str

    def fields(self) -> list[str]:
        return [match.group(1) for match in _PIECE.finditer(self.text) if match.group(1) is not None]

    def render(self, record: Record, first: Mapping[str, Any] | None = None) -> str:
        """The text for `record`; `first` (the first record read) tells a misspelt field from a
        missing one."""
        out, optional, dropped, position = [], None, False, 0
        for match in _PIECE.finditer(self.text):
            (optional if optional is not None else out).append(self.text[position:match.start()])
            position = match.end()
            piece = match.group(0)
            if piece in ("{{", "}}"):
                (optional if optional is not None else out).append(piece[0])
            elif piece == "[[":
                optional, dropped = [], False
            elif piece == "]]":
                out += [] if dropped or optional is None else optional
                optional = None
            else:
                value = _value(record, match.group(1), first, required=optional is None)
                dropped = dropped or value == ""
                (optional if optional is not None else out).append(value)
        out.append(self.text[position:])
        return "".join(out)


def _value(record: Record, name: str, first: Mapping[str, Any] | None, required: bool) -> str:
    value: Any = record.fields
    for key in name.split("."):
        if isinstance(value, Mapping) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        elif not required:
            return ""
        else:
            raise _missing(record, name, first)
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        raise DataError(f"{record.where}: field {name!r} holds a JSON {type(value).__name__}, not text; name a "
                        f"nested key in the template, e.g. {{{name}.…}}")
    return value if isinstance(value, str) else json.dumps(value)


def _missing(record: Record, name: str, first: Mapping[str, Any] | None) -> DataError:
    top = name.split(".")[0]
    known = list(record.fields)
    if first is None or first is record.fields or top not in first:
        near = difflib.get_close_matches(top, known, n=1)
        hint = f"; did you mean {{{near[0]}}}?" if near else ""
        return DataError(f"the template names the field {name!r}, which the records do not have (those of "
                         f"{record.where}: {', '.join(known) or 'none'}){hint} Fix data.records.prompt_template or "
                         "data.records.completion_template")
    return DataError(f"{record.where} has no field {name!r}, which the template needs: add it to the record or "
                     "remove the record")


# --- examples -----------------------------------------------------------------------------------

CHAT_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
PRESETS = {
    "prompt_completion": ("{prompt}", "{completion}"),
    "alpaca": ("### Instruction:\n{instruction}\n\n[[### Input:\n{input}\n\n]]### Response:\n", "{output}"),
    "qa": ("[[Context: {context}\n]]Question: {question}\nAnswer: ", "{answer}"),
    "chat": None,  # the messages list, see chat_turns
}


@dataclasses.dataclass(frozen=True)
class Templates:
    """How records become examples: the prompt and completion templates, or the chat form."""

    prompt: Template | None
    completion: Template | None

    @property
    def chat(self) -> bool:
        return self.prompt is None

    def identity(self) -> list[str | None]:
        return [None if t is None else t.text for t in (self.prompt, self.completion)]


def templates(settings: RecordsConfig) -> Templates:
    """The Templates the data.records settings name (a preset, or the two templates)."""
    preset, prompt, completion = settings.template, settings.prompt_template, settings.completion_template
    if preset is not None:
        if preset not in PRESETS:
            raise DataError(f"data.records.template={preset!r} is not a preset; choose one of {', '.join(PRESETS)}, "
                            "or leave it None and set data.records.prompt_template and completion_template")
        if prompt is not None or completion is not None:
            raise DataError(f"data.records.template={preset!r} and data.records.prompt_template / "
                            "completion_template are both set: choose the preset or your own templates")
        if PRESETS[preset] is None:
            return Templates(None, None)
        prompt, completion = PRESETS[preset]
    if prompt is None or completion is None:
        raise DataError("data.format='records' needs data.records.template (one of "
                        f"{', '.join(PRESETS)}) or both data.records.prompt_template and completion_template, e.g. "
                        "'Question: {question}\\nAnswer: ' and '{answer}'")
    return Templates(Template(prompt), Template(completion))


def example_turns(record: Record, forms: Templates, first: Mapping[str, Any] | None = None) -> list[Turn]:
    """The (prompt, completion) turns of a record's example."""
    if forms.chat:
        turns = chat_turns(record)
    else:
        turns = [(forms.prompt.render(record, first), forms.completion.render(record, first))]
    for _, completion in turns:
        if not completion.strip():
            raise DataError(f"{record.where} has an empty completion: give it text to learn, or remove the record")
    return turns


def chat_turns(record: Record, final_prompt: bool = False) -> list[Turn]:
    """A chat's turns: each assistant message is a completion, the messages before it (since
    the last one) its prompt. With final_prompt, messages after the last assistant turn
    become a last turn with an empty completion: the prompt to answer (sampling)."""
    messages = record.fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{record.where} has no 'messages' list; a chat record is "
                        '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}')
    turns, prompt = [], []
    for number, message in enumerate(messages, start=1):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in CHAT_ROLES or not isinstance(content, str):
            raise DataError(f"{record.where} message {number} is not {{'role': one of {', '.join(CHAT_ROLES)}, "
                            "'content': text}")
        if role == "assistant":
            turns.append(("".join(prompt) + "Assistant: ", content))
            prompt = []
        else:
            prompt.append(f"{CHAT_ROLES[role]}: {content}\n")
    if final_prompt:
        return turns + [("".join(prompt) + "Assistant: ", "")]
    if not turns:
        raise DataError(f"{record.where} is a chat without an assistant turn: nothing to learn; add the "
                        "assistant's reply or remove the record")
    return turns
