"""A TFDS builder for a local text corpus: your files → a TFDS dataset, with TFDS's own tools.

    import tensorflow_datasets as tfds
    import jaxgpt.data.tfds_local  # registers the builder "local_text_corpus"

    builder = tfds.builder("local_text_corpus", data_dir=DATA_DIR)
    builder.download_and_prepare(
        file_format="array_record",
        download_config=tfds.download.DownloadConfig(manual_dir="path/to/my/files"),
    )

Then train on it with `data.source = "tfds:local_text_corpus"` and
`data.tfds.data_dir = DATA_DIR`. Several corpora can live in one data directory under
names of their own: `tfds.builder("local_text_corpus", config=LocalTextCorpusConfig(
name="mycode"), ...)`, read back as `tfds:local_text_corpus/mycode`. With TensorFlow
installed, TFDS's command line does the same: `tfds build local_text_corpus
--imports=jaxgpt.data.tfds_local --manual_dir=path/to/my/files --file_format=array_record`.
ArrayRecord needs no TensorFlow to write or read; don't use the parquet format, which
tensorflow-datasets 4.9.10 writes with rows missing.

The files are read exactly like a path source of `jaxgpt.data.sources.files` (one document per text
file, one per `.jsonl` line, one per `.pdf`). Subdirectories of manual_dir named like
splits (train, validation, test) become those splits; without any, every file below
manual_dir is in the train split. Each example is {"text": the document, "source": its
file relative to manual_dir, with "#k" for the k-th document of a file}, in file order.
A corpus that is not prepared when `jaxgpt.data` asks for it is prepared from
DATA_DIR/downloads/manual, TFDS's default manual_dir.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import tensorflow_datasets as tfds

from jaxgpt.data.sources.files import list_files
from jaxgpt.data.sources.reader import DocumentReader
from jaxgpt.data_config import DataConfig, FilesConfig

SPLIT_DIRS = ("train", "validation", "test")


@dataclasses.dataclass(eq=False)
class LocalTextCorpusConfig(tfds.core.BuilderConfig):
    """A named local corpus; `text_field` is the field of `.jsonl` lines with the text."""

    text_field: str = "text"


class LocalTextCorpus(tfds.core.GeneratorBasedBuilder):
    """The text files of manual_dir as a dataset of documents."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "One example per document: text and source."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Put the corpus files (text of any extension, .jsonl, .pdf) in manual_dir, or in its "
        f"subdirectories {', '.join(SPLIT_DIRS)} to make those splits."
    )

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="A local text corpus, one example per document.",
            features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "source": tfds.features.Text()}
            ),
            disable_shuffling=True,  # keep file order, as a path source reads it
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        root = Path(dl_manager.manual_dir)
        split_dirs = [root / name for name in SPLIT_DIRS if (root / name).is_dir()]
        if not split_dirs:
            return {"train": self._generate_examples(root)}
        return {directory.name: self._generate_examples(directory) for directory in split_dirs}

    def _generate_examples(self, directory: Path) -> Iterator[tuple[str, dict[str, str]]]:
        # Without a LocalTextCorpusConfig, .jsonl lines keep their text in "text".
        text_field = getattr(self.builder_config, "text_field", "text")
        reader = DocumentReader(DataConfig(files=FilesConfig(text_field=text_field)))
        for path in list_files(directory):
            relative = path.relative_to(directory).as_posix()
            for k, document in enumerate(reader.read(path)):
                key = f"{relative}#{k}"
                yield key, {"text": document, "source": key}
        reader.warn()
