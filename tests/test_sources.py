"""The registry of source kinds (jaxgpt.data.sources): the scheme of a spec picks its kind; a
kind registered through the interface is read like the built-in ones; a scheme that no kind
reads is a one-line error naming the known ones; each kind's keys are its own section."""

import dataclasses

import pytest
from conftest import corpus_documents

from jaxgpt import data
from jaxgpt.config import DataConfig, default_config
from jaxgpt.data import DataError, sources
from jaxgpt.data.sources import registry


@pytest.fixture
def own_registry(monkeypatch):
    """The registry as it is now, restored after the test."""
    monkeypatch.setattr(registry, "KINDS", dict(registry.KINDS))


class Words(sources.SourceKind):
    """'words:A,B,…': each comma-separated word is a document."""

    scheme = "words"
    form = "words:A,B,…"

    def open(self, spec, settings):
        words = spec.removeprefix("words:").split(",")
        return sources.Source(f"words-{len(words)}", {"kind": "words", "words": words}, lambda reader: iter(words))


def config(tmp_path, source):
    return {"source": source, "cache_dir": str(tmp_path / "cache"), "val_fraction": 0.0, "workers": 1}


def test_a_kind_registered_through_the_interface_is_picked_by_its_scheme(tmp_path, own_registry):
    sources.register(Words)
    assert isinstance(sources.kind_of("words:a,b"), Words)
    corpus = data.prepare(config(tmp_path, "words:alpha,beta,gamma"))
    assert corpus_documents(corpus) == ["alpha", "beta", "gamma"]
    shorter = data.prepare(config(tmp_path, "words:alpha,beta"))
    assert shorter.directory != corpus.directory  # the kind's identity is in the fingerprint
    with pytest.raises(DataError, match=r"data.format='records' reads \.jsonl.*not 'words:a'"):
        data.prepare({**config(tmp_path, "words:a"), "format": "records", "records": {"template": "qa"}})


def test_an_unknown_scheme_is_a_one_line_error_naming_the_known_ones(tmp_path):
    with pytest.raises(DataError) as raised:
        data.prepare(config(tmp_path, "tdfs:tiny_shakespeare"))
    message = str(raised.value)
    assert "\n" not in message and "no source kind reads 'tdfs:' specs" in message
    for form in ("stdlib", "tfds:NAME[:SPLIT]", "hf:NAME_OR_PATH[:CONFIG][:SPLIT]", "generated:NAME[:COUNT]",
                 "a file, directory or glob"):
        assert form in message


def test_schemes_pick_the_built_in_kinds_and_anything_else_is_a_path(tmp_path):
    kinds = {spec: type(sources.kind_of(spec)).__name__ for spec in (
        "stdlib", "tfds:x", "hf:owner/name", "generated:addition", "corpus.txt", "data/*.md", "hf", "stdlib.txt")}
    assert kinds == {"stdlib": "Stdlib", "tfds:x": "Tfds", "hf:owner/name": "Hf", "generated:addition": "Generated",
                     "corpus.txt": "Paths", "data/*.md": "Paths", "hf": "Paths", "stdlib.txt": "Paths"}
    colon = tmp_path / "notes:v2.txt"  # an existing path is a path, whatever it looks like
    colon.write_text("a note")
    assert type(sources.kind_of(str(colon))).__name__ == "Paths"


def test_each_kind_keeps_its_keys_in_its_own_section_of_the_data_config():
    sections = {field.name for field in dataclasses.fields(DataConfig)
                if dataclasses.is_dataclass(field.default_factory)}
    owned = {kind.section for kind in sources.KINDS.values() if kind.section}
    assert owned == {"files", "tfds", "hf"} and owned <= sections
    assert set(default_config().data) >= sections  # each one overridable as --config.data.SECTION.KEY
