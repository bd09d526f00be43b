"""The registry of source kinds: a data.source string names its kind by its scheme, the part
before the first ':' ('tfds:…', 'hf:…'), or by a bare name ('stdlib'); anything else is a
path (a file, directory or glob). This is the one place a spec's scheme is read.

A kind is a `SourceKind` registered with `@register`: its scheme, the form of its specs (for
messages), the DataConfig section of its own keys, and `open(spec, settings)`, which gives a
`Source` (a name, the identity the token cache's fingerprint hashes, and its documents). A
kind that holds records files also answers `record_files` (data.format='records').
"""

from __future__ import annotations

import abc
import dataclasses
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jaxgpt.data.sources.reader import DocumentReader
from jaxgpt.data_config import DataConfig
from jaxgpt.errors import DataError

PATHS = ""  # the scheme of the default kind: a spec without a known scheme is a path
_SCHEME = re.compile(r"[a-z][a-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class Source:
    """Where documents come from: `identity` is cheap to compute and changes whenever the
    documents may have changed; `documents(reader)` reads them. `description` says what the spec
    stands for here where the spec alone does not (`stdlib`: which Python's standard library);
    the cache's meta.json records it."""

    name: str
    identity: dict[str, Any]
    documents: Callable[[DocumentReader], Iterator[str]]
    description: str = ""


class SourceKind(abc.ABC):
    """One kind of data source.

    scheme: specs 'SCHEME:…' are this kind's (PATHS for the default kind, which reads paths).
    bare: the scheme alone is the whole spec ('stdlib'), rather than a prefix.
    form: the form of its specs, for messages ('tfds:NAME[:SPLIT]').
    section: the DataConfig section that holds its own keys (data.<section>.*); None: it has none.
    """

    scheme: str = PATHS
    bare: bool = False
    form: str = ""
    section: str | None = None

    @abc.abstractmethod
    def open(self, spec: str, settings: DataConfig) -> Source:
        """The Source that `spec` names, read with `settings` (the whole data section)."""

    def record_files(self, spec: str, settings: DataConfig) -> list[Path]:
        """The records files `spec` names (data.format='records'); a kind of documents has none."""
        raise DataError(f"data.format='records' reads .jsonl, .json, .csv or .tsv files, not {spec!r}: set "
                        "data.source to them")


KINDS: dict[str, SourceKind] = {}


def register(kind: type[SourceKind]) -> type[SourceKind]:
    """Class decorator: make an instance of `kind` the reader of the specs of its scheme."""
    KINDS[kind.scheme] = kind()
    return kind


def kind_of(spec: str) -> SourceKind:
    """The kind that reads `spec`: the one its scheme names, else the kind of paths. A spec
    'WORD:…' whose WORD no kind claims and that is no existing path is a DataError listing the
    known forms (a misspelt scheme is not read as a missing file)."""
    scheme, colon, _ = spec.partition(":")
    kind = KINDS.get(scheme) if scheme != PATHS else None
    if kind is not None and (spec == scheme if kind.bare else bool(colon)):
        return kind
    if colon and _SCHEME.fullmatch(scheme) and not Path(spec).expanduser().exists():
        raise DataError(f"data source {spec!r}: no source kind reads '{scheme}:' specs; give {known_forms()}")
    return KINDS[PATHS]


def known_forms() -> str:
    """The forms of every registered spec, for messages."""
    forms = [kind.form for scheme, kind in sorted(KINDS.items()) if scheme != PATHS]
    return ", ".join(forms) + ", or a file, directory or glob"


def resolve(spec: str, settings: DataConfig) -> Source:
    """The Source a data.source (or data.val_source) string names."""
    return kind_of(spec).open(spec, settings)


def record_files(spec: str, settings: DataConfig) -> list[Path]:
    """The records files a data.source (or data.val_source) string names."""
    return kind_of(spec).record_files(spec, settings)
