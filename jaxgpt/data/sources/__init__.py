"""Sources: where the documents of a corpus come from, a registry of kinds.

The scheme of a data.source string picks its kind (jaxgpt.data.sources.registry, the one
place it is read); each kind is one module here, registered by `@register`, and owns its
section of the data config:

    files.py      a file, directory or glob (data.files; images and scans by OCR: data.ocr);
                  'stdlib', the standard library's .py files
    tfds.py       'tfds:NAME[:SPLIT]' (data.tfds)
    hf.py         'hf:NAME_OR_PATH[:CONFIG][:SPLIT]' (data.hf)
    generated.py  'generated:NAME[:COUNT]', records the project makes itself
    reader.py     DocumentReader: local files read as documents, repairs counted

A `Source` has a cheap identity (what the token cache's fingerprint hashes) and a generator
of its documents, read lazily (a `.jsonl` file a line at a time). A new kind is a subclass of
`SourceKind` registered with `@register`, and imported here.
"""

from jaxgpt.data.sources import files, generated, hf, tfds  # noqa: F401  each registers its kind
from jaxgpt.data.sources.files import list_files, stdlib_files
from jaxgpt.data.sources.reader import DocumentReader
from jaxgpt.data.sources.registry import KINDS, Source, SourceKind, kind_of, record_files, register, resolve

__all__ = ["KINDS", "DocumentReader", "Source", "SourceKind", "kind_of", "list_files", "record_files", "register",
           "resolve", "stdlib_files"]
