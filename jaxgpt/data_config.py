"""The data section of a run's config (config.data; jaxgpt.data reads it): the keys every
source shares (DataConfig), and a section per source kind, reader and format (data.files,
data.ocr, data.tfds, data.hf, data.records), each checked by its dataclass. The rest of the
schema is jaxgpt.config's, which re-exports these.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ml_collections import ConfigDict

from jaxgpt.errors import ConfigError, DataError, is_int, is_number


def checked_section(cls, values: Mapping[str, Any], section: str):
    """An instance of the dataclass `cls` from a config section; keys the section leaves out
    take the dataclass's defaults, keys it does not know are an error."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{section} has no key(s) {', '.join(unknown)}; its keys: {', '.join(sorted(known))}")
    return cls(**dict(values))


@dataclasses.dataclass(frozen=True)
class FilesConfig:
    """data.files: how local files are read: a file, directory or glob source, stdlib, and the
    generated records (jaxgpt.data.sources.files).

    text_field: the field of each `.jsonl` line that holds the text.
    on_bad_file: 'warn' (a file that cannot be read, e.g. a corrupt image or PDF, is skipped with
      a warning naming it) | 'error' (it stops the preparation).
    """

    text_field: str = "text"
    on_bad_file: str = "warn"

    def __post_init__(self):
        _check_data(_is_text(self.text_field), "files.text_field", self.text_field, "a non-empty string")
        _check_choice("files.on_bad_file", self.on_bad_file, ("warn", "error"))


@dataclasses.dataclass(frozen=True)
class OcrConfig:
    """data.ocr: the text of images and scanned PDF pages among local files, read by Tesseract
    (jaxgpt.data.ocr; needs the program and the ocr extra). Recognised text is cached under
    cache_dir/ocr.

    mode: 'auto' (images, and PDF pages without a text layer, are read by OCR) | 'always' (every
      PDF page too) | 'never' (images are binary files, skipped).
    lang: Tesseract's language(s), e.g. 'eng' or 'eng+deu' (apt-get install tesseract-ocr-deu).
    workers: pages recognised at once; None = the CPU cores.
    min_confidence: in [0, 100]: files whose mean OCR word confidence is lower are listed in a
      warning; None = no threshold.
    drop_low_confidence: True = those files are left out of the corpus (needs min_confidence).
    """

    mode: str = "auto"
    lang: str = "eng"
    workers: int | None = None
    min_confidence: float | None = None
    drop_low_confidence: bool = False

    def __post_init__(self):
        _check_choice("ocr.mode", self.mode, ("auto", "always", "never"))
        lang = self.lang
        _check_data(_is_text(lang) and not any(c.isspace() for c in lang), "ocr.lang", lang,
                    "Tesseract language codes joined by '+', e.g. 'eng' or 'eng+deu'")
        workers = self.workers
        _check_data(workers is None or (is_int(workers) and workers > 0), "ocr.workers", workers,
                    "None or a positive integer")
        threshold = self.min_confidence
        _check_data(threshold is None or (is_number(threshold) and 0 <= threshold <= 100), "ocr.min_confidence",
                    threshold, "None or a number in [0, 100]")
        _check_data(isinstance(self.drop_low_confidence, bool), "ocr.drop_low_confidence", self.drop_low_confidence,
                    "True or False")
        if self.drop_low_confidence and threshold is None:
            raise DataError("data.ocr.drop_low_confidence=True needs data.ocr.min_confidence (e.g. 60): the "
                            "confidence below which a file is dropped")


@dataclasses.dataclass(frozen=True)
class TfdsConfig:
    """data.tfds: a 'tfds:NAME[:SPLIT]' source (jaxgpt.data.sources.tfds).

    text_feature: the feature of a TFDS example that holds the text.
    data_dir: where TFDS datasets are prepared; None = TFDS's default (~/tensorflow_datasets,
      or $TFDS_DATA_DIR).
    """

    text_feature: str = "text"
    data_dir: str | None = None

    def __post_init__(self):
        _check_data(_is_text(self.text_feature), "tfds.text_feature", self.text_feature, "a non-empty string")
        _check_data(self.data_dir is None or _is_text(self.data_dir), "tfds.data_dir", self.data_dir,
                    "None or a non-empty string")


@dataclasses.dataclass(frozen=True)
class HfConfig:
    """data.hf: an 'hf:NAME_OR_PATH[:CONFIG][:SPLIT]' source (jaxgpt.data.sources.hf).

    text_field: the column of each row that holds the text.
    """

    text_field: str = "text"

    def __post_init__(self):
        _check_data(_is_text(self.text_field), "hf.text_field", self.text_field, "a non-empty string")


@dataclasses.dataclass(frozen=True)
class RecordsConfig:
    """data.records: how records become examples under data.format='records' (jaxgpt.data.records).

    template: a preset of templates: 'prompt_completion', 'alpaca', 'qa' or 'chat'
      (jaxgpt.data.records.PRESETS); None = prompt_template and completion_template.
    prompt_template, completion_template: a record's prompt and completion, '{field}'
      placeholders (nested keys '{a.b}'), '[[…]]' a part left out when its fields are empty.
    loss_on: 'completion' (the loss on the completion tokens and the <|eos|> after them) |
      'all' (on every token of an example).
    truncate: 'completion' (an example longer than block_size + 1 tokens loses its
      completion's tail, counted; one whose prompt alone fills the block is left out,
      counted) | 'error' (either stops the run, naming the record).
    packing: 'pack' (examples share rows, attention kept within each) | 'pad' (one example
      per row, the rest padding).
    """

    template: str | None = None
    prompt_template: str | None = None
    completion_template: str | None = None
    loss_on: str = "completion"
    truncate: str = "completion"
    packing: str = "pack"

    def __post_init__(self):
        for key, valid in (("loss_on", ("completion", "all")), ("truncate", ("completion", "error")),
                           ("packing", ("pack", "pad"))):
            _check_choice(f"records.{key}", getattr(self, key), valid)
        for key in ("template", "prompt_template", "completion_template"):
            value = getattr(self, key)
            _check_data(value is None or _is_text(value), f"records.{key}", value, "None or a non-empty string")


# The flat keys of the data section before each source had its own section: a run directory
# written then reads as the sections, and the command line names the new key.
FLAT_DATA_KEYS = {
    "text_field": ("files.text_field", "hf.text_field"),
    "on_bad_file": ("files.on_bad_file",),
    "tfds_text_feature": ("tfds.text_feature",),
    "tfds_data_dir": ("tfds.data_dir",),
    "ocr": ("ocr.mode",),
    **{f"ocr_{key}": (f"ocr.{key}",) for key in ("lang", "workers", "min_confidence", "drop_low_confidence")},
    **{key: (f"records.{key}",) for key in ("template", "prompt_template", "completion_template", "loss_on",
                                            "truncate", "packing")},
}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The data section (jaxgpt.data reads it): the keys every source shares, and one section
    per source kind or reader with that one's own keys (data.files, data.ocr, data.tfds,
    data.hf, data.records; each class's docstring lists its keys).

    source: a file, directory or glob | 'stdlib' | 'tfds:NAME[:SPLIT]' |
      'hf:NAME_OR_PATH[:CONFIG][:SPLIT]' | 'generated:NAME[:COUNT]' (jaxgpt.data.sources: the
      scheme before ':' picks the source kind).
    val_source: None (hold out part of `source`) or a second source for validation, e.g.
      'tfds:NAME:validation'; `val_fraction` is then unused.
    format: 'text' (documents become one stream of tokens) | 'records' (each record of the
      .jsonl/.json/.csv/.tsv files becomes an example: a prompt and a completion, the loss
      on the completion; data.records).
    tokenizer: 'char' | 'word' | 'bpe' | 'wordpiece' | 'unigram' (train a new one on the train
      split) or the path of a tokenizer file written by `Tokenizer.save`.
    vocab_size: ids of a new tokenizer, special ones included; None = every character or
      word seen (char, word). bpe, wordpiece and unigram need one.
    val_fraction: in [0, 1): the fraction of documents held out for validation, or of the
      text when the corpus is a single document (its tail). Text: document i is held out when
      blake2b-64(i) / 2⁶⁴ < val_fraction, or when it is the last and none was (jaxgpt.data.split).
    max_documents, max_bytes: read at most this many documents / UTF-8 bytes of each source,
      in order (the document that crosses the byte cap is cut); None = all.
    cache_dir: where token files are cached; None = $XDG_CACHE_HOME/jaxgpt/data or
      ~/.cache/jaxgpt/data. Deleting it only costs a rebuild.
    eval_stride: the step between evaluation windows (1..block_size); None = block_size.
    tokenizer_sample_bytes: a tokenizer trained here learns from the first train documents up
      to this many UTF-8 bytes (the last one cut); meta.json records the sample.
    workers: processes that encode a text corpus (the tokens do not depend on it); None = the
      CPU cores. shard_tokens: the most ids in one {split}-NNNNN.bin file of a text split.
    encode_batch_bytes: characters encoded in one batch, 2 · workers batches at a time: with
      the tokenizer sample, the bound on a preparation's memory (a document is read whole).
    max_unknown: in [0, 1]: the largest share of <|unk|> among the train tokens that a tokenizer
      not trained on this data (init_from's, or a tokenizer file) may make; above it the run
      refuses to start (jaxgpt.train.preflight.check_unknown, from jaxgpt.train.opening.open_run): a model
      would learn to predict <|unk|>.
    """

    source: str = "stdlib"
    val_source: str | None = None
    format: str = "text"
    tokenizer: str = "char"
    vocab_size: int | None = None
    val_fraction: float = 0.1
    max_documents: int | None = None
    max_bytes: int | None = None
    cache_dir: str | None = None
    eval_stride: int | None = None
    tokenizer_sample_bytes: int = 200_000_000
    workers: int | None = None
    shard_tokens: int = 100_000_000
    encode_batch_bytes: int = 1 << 22
    max_unknown: float = 0.01
    files: FilesConfig = dataclasses.field(default_factory=FilesConfig)
    ocr: OcrConfig = dataclasses.field(default_factory=OcrConfig)
    tfds: TfdsConfig = dataclasses.field(default_factory=TfdsConfig)
    hf: HfConfig = dataclasses.field(default_factory=HfConfig)
    records: RecordsConfig = dataclasses.field(default_factory=RecordsConfig)

    def __post_init__(self):
        for key in ("source", "tokenizer"):
            _check_data(_is_text(getattr(self, key)), key, getattr(self, key), "a non-empty string")
        for key in ("val_source", "cache_dir"):
            value = getattr(self, key)
            _check_data(value is None or _is_text(value), key, value, "None or a non-empty string")
        for key in ("vocab_size", "max_documents", "max_bytes", "eval_stride", "workers"):
            value = getattr(self, key)
            _check_data(value is None or (is_int(value) and value > 0), key, value, "None or a positive integer")
        for key in ("tokenizer_sample_bytes", "shard_tokens", "encode_batch_bytes"):
            value = getattr(self, key)
            _check_data(is_int(value) and value > 0, key, value, "a positive integer")
        fraction = self.val_fraction
        _check_data(is_number(fraction) and 0 <= fraction < 1, "val_fraction", fraction, "a number in [0, 1)")
        share = self.max_unknown
        _check_data(is_number(share) and 0 <= share <= 1, "max_unknown", share, "a number in [0, 1]")
        _check_choice("format", self.format, ("text", "records"))
        if self.tokenizer == "bpe" and self.vocab_size is None:
            raise DataError("data.tokenizer='bpe' needs data.vocab_size (e.g. 4096; at least 259: 256 bytes + 3 "
                            "special tokens)")
        if self.tokenizer in ("wordpiece", "unigram") and self.vocab_size is None:
            raise DataError(f"data.tokenizer={self.tokenizer!r} needs data.vocab_size (e.g. 4096; at least 5: 4 "
                            "special tokens + 1 piece)")
        for name, kind in _sections(DataConfig).items():
            section = getattr(self, name)
            _check_data(isinstance(section, kind), name, section, f"a {kind.__name__} (the data.{name} section)")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> DataConfig:
        """The data section `values` (a dict or ConfigDict, its sections nested), checked; the flat
        keys of a run directory written before the sections (FLAT_DATA_KEYS) read as theirs."""
        values = _unflattened(_plain(values))
        for name, kind in _sections(cls).items():
            if name in values:
                section = values[name]
                _check_data(isinstance(section, Mapping), name, section, f"a mapping of the data.{name} keys")
                values[name] = checked_section(kind, section, f"data.{name}")
        return checked_section(cls, values, "data")

    @property
    def cache_path(self) -> Path:
        """The cache directory, with its default resolved."""
        default = os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "jaxgpt", "data")
        return Path(self.cache_dir or default).expanduser()


def _sections(cls) -> dict[str, type]:
    """The nested sections of a config dataclass: its fields whose default is a dataclass."""
    return {field.name: field.default_factory for field in dataclasses.fields(cls)
            if dataclasses.is_dataclass(field.default_factory)}


def _plain(values: Mapping[str, Any] | ConfigDict) -> dict[str, Any]:
    """A config section, its sections too, as plain dicts (a ConfigDict's placeholders as None)."""
    if isinstance(values, ConfigDict):
        return values.to_dict()
    return {key: _plain(value) if isinstance(value, (Mapping, ConfigDict)) else value for key, value in values.items()}


def _unflattened(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each flat key of FLAT_DATA_KEYS moved into its section (a key the section
    sets itself wins)."""
    for old, new in FLAT_DATA_KEYS.items():
        if old in values and not isinstance(values[old], Mapping):
            value = values.pop(old)
            for dotted in new:
                name, key = dotted.split(".")
                section = values.get(name, {})
                values[name] = {key: value, **section} if isinstance(section, Mapping) else section
    return values


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _check_choice(key: str, value: Any, valid: tuple[str, ...]) -> None:
    *first, last = map(repr, valid)
    _check_data(value in valid, key, value, f"{', '.join(first)} or {last}")


def _check_data(ok: Any, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise DataError(f"data.{key}={value!r}: must be {expected}")

