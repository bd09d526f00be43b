"""TFDS as a source: `tfds:NAME[:SPLIT]` (split "train" by default; NAME may carry a config
and version, `name/config:1.0.0`, and SPLIT may be a slice, `train[:10%]`) gives the text
feature `data.tfds.text_feature` of each example, read through TFDS's ArrayRecord data source
(no TensorFlow needed) from `data.tfds.data_dir`. A dataset that is not prepared is prepared
first when that needs neither TensorFlow nor an unreachable network. To turn your own files
into a TFDS dataset see `jaxgpt.data.tfds_local`.
"""

from __future__ import annotations

import logging
import re
import socket
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from jaxgpt.data.sources.reader import DocumentReader
from jaxgpt.data.sources.registry import Source, SourceKind, register
from jaxgpt.data_config import DataConfig
from jaxgpt.errors import DataError, one_line

log = logging.getLogger(__name__)

UNREACHABLE_PROBE_SECONDS = 5.0

_TFDS_SPEC = re.compile(r"tfds:(?P<name>[\w./-]+(?::[\d*]+\.[\d*]+\.[\d*]+)?)(?::(?P<split>.+))?")


@register
class Tfds(SourceKind):
    """'tfds:NAME[:SPLIT]': the text feature of a TFDS dataset's examples."""

    scheme = "tfds"
    form = "tfds:NAME[:SPLIT]"
    section = "tfds"

    def open(self, spec: str, settings: DataConfig) -> Source:
        return tfds_source(spec, settings)


def tfds_source(spec: str, settings: DataConfig) -> Source:
    match = _TFDS_SPEC.fullmatch(spec)
    if match is None:
        raise DataError(f"data source {spec!r} is not tfds:NAME[:SPLIT] "
                        "(e.g. tfds:local_text_corpus:train)")
    name, split = match["name"], match["split"] or "train"
    builder = _builder(name, settings.tfds.data_dir)
    if not builder.is_prepared():
        _prepare_tfds(builder, name)
    try:
        records = builder.as_data_source(split=split)
    except NotImplementedError:
        raise DataError(f"TFDS dataset {name!r} is prepared in {builder.data_dir} in a format "
                        "without random access; prepare it again with "
                        "file_format='array_record'") from None
    except ValueError as err:
        raise DataError(f"TFDS dataset {name!r}: {one_line(err)}") from None
    feature = settings.tfds.text_feature
    features = list(builder.info.features.keys())
    if feature not in features:
        raise DataError(f"TFDS dataset {name!r} has no feature {feature!r} (its features: "
                        f"{', '.join(features)}); set data.tfds.text_feature")
    info_file = Path(builder.data_dir) / "dataset_info.json"
    identity = {
        "kind": "tfds",
        "dataset": builder.info.full_name,
        "split": split,
        "feature": feature,
        "data_dir": str(builder.data_dir),
        "examples": len(records),
        "prepared": info_file.stat().st_mtime_ns if info_file.exists() else None,
    }

    def documents(reader: DocumentReader) -> Iterator[str]:
        chunk = 1024  # records per read: fewer calls into ArrayRecord than one at a time
        for start in range(0, len(records), chunk):
            indices = list(range(start, min(start + chunk, len(records))))
            for record in records.__getitems__(indices):
                value = record[feature]
                if isinstance(value, bytes):
                    value = reader.decode(value, f"{name}:{split}")
                if not isinstance(value, str):
                    raise DataError(f"TFDS dataset {name!r}: feature {feature!r} holds "
                                    f"{type(value).__name__}, not text; set "
                                    "data.tfds.text_feature to a text feature")
                if value:
                    yield value

    return Source(f"tfds-{name}-{split}", identity, documents)


def _builder(name: str, data_dir: str | None) -> Any:
    """TFDS's builder of `name`, imported here: a run from local files never pays for
    importing tensorflow_datasets."""
    import tensorflow_datasets as tfds

    from jaxgpt.data import tfds_local  # noqa: F401  registers local_text_corpus, so that it can be prepared

    where = data_dir or "TFDS's default data directory"
    try:
        return tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        raise DataError(f"unknown TFDS dataset {name!r}: tensorflow_datasets does not know it "
                        f"and it is not prepared in {where}; check the name, or set "
                        "data.tfds.data_dir to where it was prepared") from None
    except ValueError as err:  # e.g. an unknown config or version
        raise DataError(f"TFDS dataset {name!r}: {one_line(err)}") from None


def _prepare_tfds(builder: Any, name: str) -> None:
    """Prepare a TFDS dataset as ArrayRecord, failing at once where that cannot work here."""
    import tensorflow_datasets as tfds

    manual_dir = Path(builder.data_dir_root) / "downloads" / "manual"
    if builder.MANUAL_DOWNLOAD_INSTRUCTIONS:
        if not (manual_dir.is_dir() and any(manual_dir.iterdir())):
            raise DataError(f"TFDS dataset {name!r} is not prepared and needs its files in "
                            f"{manual_dir}: put them there, or prepare it (see "
                            "jaxgpt.data.tfds_local) into data.tfds.data_dir")
    else:
        # TFDS retries a failed download for minutes; an unreachable host fails here at once.
        _check_reachable(builder.url_infos or {}, name, builder.data_dir)
    log.info("preparing TFDS dataset %s in %s", name, builder.data_dir)
    try:
        builder.download_and_prepare(
            file_format="array_record",
            download_config=tfds.download.DownloadConfig(try_download_gcs=False),
        )
    except ModuleNotFoundError as err:
        raise DataError(f"preparing TFDS dataset {name!r} needs the Python module "
                        f"{err.name!r}: install it, or prepare the dataset where it is "
                        f"installed (file_format='array_record') and copy {builder.data_dir} "
                        "here") from None


def _check_reachable(urls: Mapping[str, Any], name: str, data_dir: Any) -> None:
    hosts = set()
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        if parts.hostname:
            hosts.add((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)))
    for host, port in sorted(hosts):
        try:
            socket.create_connection((host, port), timeout=UNREACHABLE_PROBE_SECONDS).close()
        except OSError as err:
            raise DataError(f"TFDS dataset {name!r} is not prepared, and preparing it downloads "
                            f"from {host}, which cannot be reached ({err}); connect to the "
                            f"network, or prepare it elsewhere and copy it to {data_dir}") \
                from None


