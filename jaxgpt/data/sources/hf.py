"""Hugging Face datasets as a source: `hf:NAME_OR_PATH[:CONFIG][:SPLIT]` gives the field
`data.hf.text_field` of each row, read lazily through the `datasets` library (the hf extra:
`pip install 'jaxgpt[hf]'`).

NAME_OR_PATH is, in this order of precedence:
- a directory written by `Dataset.save_to_disk` (or `DatasetDict.save_to_disk`, whose SPLIT
  is then chosen), memory-mapped and read a batch of rows at a time;
- a local `.parquet`, `.arrow`, `.jsonl` or `.json` file, or a directory of such files (the
  layout of a dataset repository: splits from the file names, configs from its README),
  streamed;
- a dataset on the Hugging Face Hub (`owner/name`), streamed (`streaming=True`, nothing
  downloaded ahead). With HF_DATASETS_OFFLINE=1 (or HF_HUB_OFFLINE=1) a dataset downloaded
  before is read from the datasets cache instead. An unreachable Hub fails at once, in one
  line, instead of after the library's retries.

SPLIT is "train" by default. `hf:NAME:X` reads X as the split when it looks like one (train,
validation, valid, test, dev), else as the config; `hf:NAME::SPLIT` names a split plainly.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jaxgpt.data.sources.files import list_files
from jaxgpt.data.sources.reader import DocumentReader
from jaxgpt.data.sources.registry import Source, SourceKind, register
from jaxgpt.data_config import DataConfig
from jaxgpt.errors import DataError, one_line

PREFIX = "hf:"
HUB_PROBE_SECONDS = 5.0  # one HEAD request to the Hub; the library itself retries for ~20 s
HUB_INFO_SECONDS = 10.0
ROWS_PER_READ = 1024
FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json"}
DEFAULT_SPLIT = "train"
_SPLIT_LIKE = re.compile(r"(?:train|validation|valid|test|dev)")


@register
class Hf(SourceKind):
    """'hf:NAME_OR_PATH[:CONFIG][:SPLIT]': a column of a Hugging Face dataset's rows."""

    scheme = "hf"
    form = "hf:NAME_OR_PATH[:CONFIG][:SPLIT]"
    section = "hf"

    def open(self, spec: str, settings: DataConfig) -> Source:
        return hf_source(spec, settings)


def hf_source(spec: str, settings: DataConfig) -> Source:
    """The Source `spec` ("hf:…") names; the Hub is only asked for its revision here."""
    name, config, split = parse_spec(spec)
    datasets = _library()
    path = Path(name).expanduser()
    if path.exists():
        opened, identity = _local(datasets, path, config, split)
    else:
        opened, identity = _hub(datasets, name, config, split or DEFAULT_SPLIT)
    identity.update(kind="hf", config=config, split=split, text_field=settings.hf.text_field)
    label = f"hf-{path.name or name}-{split or DEFAULT_SPLIT}"
    return Source(label, identity, _documents_of(spec, opened, settings.hf.text_field))


def parse_spec(spec: str) -> tuple[str, str | None, str | None]:
    """(name or path, config or None, split or None) of 'hf:NAME[:CONFIG][:SPLIT]'."""
    parts = spec[len(PREFIX):].split(":") if spec.startswith(PREFIX) else []
    if not parts or not parts[0] or len(parts) > 3:
        raise DataError(f"data source {spec!r} is not hf:NAME_OR_PATH[:CONFIG][:SPLIT] "
                        "(e.g. hf:data/train.parquet or hf:owner/name:config:train)")
    if len(parts) == 2:
        second = parts[1]
        return (parts[0], None, second) if _SPLIT_LIKE.fullmatch(second) else (parts[0], second or None, None)
    if len(parts) == 3:
        return parts[0], parts[1] or None, parts[2] or None
    return parts[0], None, None


def _library() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError("an hf: data source needs the hf extra: pip install 'jaxgpt[hf]'") from None
    return datasets


# --- local data ------------------------------------------------------------------------------


def _local(datasets: Any, path: Path, config: str | None, split: str | None) -> tuple[Callable[[], Any], dict]:
    """How to open a local dataset, and its identity: every file's path, size and mtime."""
    files = list_files(path)
    identity = {"files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
    markers = (datasets.config.DATASET_STATE_JSON_FILENAME, datasets.config.DATASETDICT_JSON_FILENAME)
    saved = any((path / marker).is_file() for marker in markers)  # written by save_to_disk
    if config is not None and (saved or path.is_file()):
        raise DataError(f"{path} has no configs, so {config!r} names none; to name a split write "
                        f"hf:{path}::{config}")
    if saved:
        return lambda: _saved(datasets, path, split), identity
    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(f"{path} is not a file the hf: source reads ({', '.join(FILE_BUILDERS)}); give a "
                            "dataset directory, or use the file itself as data.source")
        return lambda: _load(datasets, path, builder, data_files=[str(path)], split=split or DEFAULT_SPLIT,
                             streaming=True), identity
    return lambda: _load(datasets, path, str(path), name=config, split=split or DEFAULT_SPLIT,
                         streaming=True), identity


def _saved(datasets: Any, path: Path, split: str | None) -> Any:
    """A directory written by save_to_disk: the Dataset, or the DatasetDict's split."""
    saved = datasets.load_from_disk(str(path))
    if not isinstance(saved, datasets.DatasetDict):
        if split is not None:
            raise DataError(f"{path} holds one dataset, not splits; drop ':{split}' from the data source")
        return saved
    split = split or DEFAULT_SPLIT
    if split not in saved:
        raise DataError(f"{path} has no split {split!r} (its splits: {', '.join(saved)}); name one of them")
    return saved[split]


def _load(datasets: Any, where: Path | str, *args: Any, **kwargs: Any) -> Any:
    """datasets.load_dataset(*args, **kwargs), its errors one line naming `where`."""
    try:
        return datasets.load_dataset(*args, **kwargs)
    except (ValueError, FileNotFoundError, ConnectionError, datasets.exceptions.DatasetsError) as err:
        raise DataError(f"cannot read the Hugging Face dataset {str(where)!r}: {one_line(err)}") from None


# --- the Hub -----------------------------------------------------------------------------------


def _hub(datasets: Any, name: str, config: str | None, split: str) -> tuple[Callable[[], Any], dict]:
    """How to open a Hub dataset (streamed; from the datasets cache when offline), and its
    identity: the revision it has now (online) or the one cached (offline)."""
    if datasets.config.HF_HUB_OFFLINE:
        builder = _cached_builder(datasets, name, config)
        revision = Path(builder.cache_dir).name  # the commit the cache was made from

        def opened() -> Any:
            try:
                builder.download_and_prepare()  # finds the prepared cache, reads nothing else
            except (ValueError, FileNotFoundError, ConnectionError) as err:
                raise DataError(f"cannot read {name!r} from the datasets cache: {one_line(err)}") from None
            return builder.as_dataset(split=split)

        return opened, {"dataset": name, "revision": revision}
    _check_hub_reachable(name)
    revision = _hub_revision(name)
    return lambda: _load(datasets, name, name, name=config, split=split, streaming=True, revision=revision), {
        "dataset": name, "revision": revision}


def _cached_builder(datasets: Any, name: str, config: str | None) -> Any:
    try:
        return datasets.load_dataset_builder(name, config)
    except (ValueError, FileNotFoundError, ConnectionError, datasets.exceptions.DatasetsError) as err:
        raise DataError(f"data source {name!r} is neither a local path nor in the datasets cache, and "
                        f"HF_DATASETS_OFFLINE is set ({one_line(err)}); unset it to stream the dataset from "
                        "the Hub, or give a local path") from None


def _check_hub_reachable(name: str) -> None:
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_SECONDS)
    except Exception as err:  # any transport failure (DNS, refused, timeout, proxy) means unreachable
        raise DataError(f"data source {name!r} is not a local path, and the Hugging Face Hub "
                        f"({constants.ENDPOINT}) cannot be reached ({one_line(err, with_type=True)}); check the "
                        "network, set HF_DATASETS_OFFLINE=1 to read a dataset downloaded before from the "
                        "datasets cache, or give a local path") from None


def _hub_revision(name: str) -> str:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        return HfApi().dataset_info(name, timeout=HUB_INFO_SECONDS).sha
    except GatedRepoError:
        raise DataError(f"the Hub dataset {name!r} is gated: accept its terms on its page and log in "
                        "(hf auth login)") from None
    except RepositoryNotFoundError:
        raise DataError(f"data source {name!r} is neither a local path nor a dataset on the Hugging Face "
                        "Hub (or it is private: log in with hf auth login)") from None
    except Exception as err:  # other HTTP errors, and the transport's (timeouts, dropped connections)
        raise DataError(f"cannot ask the Hugging Face Hub about {name!r}: {one_line(err, with_type=True)}") from None


# --- rows → documents --------------------------------------------------------------------------


def _documents_of(spec: str, opened: Callable[[], Any], field: str) -> Callable[[DocumentReader], Iterator[str]]:
    def documents(reader: DocumentReader) -> Iterator[str]:
        dataset = opened()
        columns = dataset.column_names  # None where a stream does not know them before reading
        if columns is not None:
            _check_field(spec, field, columns)
            dataset = dataset.select_columns([field])
        for batch in dataset.iter(batch_size=ROWS_PER_READ):
            _check_field(spec, field, list(batch))
            for text in batch[field]:
                if isinstance(text, str):
                    if text:
                        yield text
                elif text is not None:  # a missing value is no document
                    raise DataError(f"{spec}: field {field!r} holds {type(text).__name__}, not text; set "
                                    "data.hf.text_field to the field with the text")

    return documents


def _check_field(spec: str, field: str, columns: list[str]) -> None:
    if field not in columns:
        raise DataError(f"{spec} has no field {field!r} (its columns: {', '.join(columns)}); set "
                        "data.hf.text_field to the column with the text")
