"""Data: sources → a token cache on disk → deterministic batches → devices.

    corpus = prepare(cfg.data)         # read, tokenize and cache; later runs reuse the cache
    x, y = train_batch(corpus.train, seed=0, step=s, batch_size=B, block_size=T)
    for x, y, mask in eval_batches(corpus.val, batch_size=B, block_size=T): ...
    make = lambda step, rows: train_batch(corpus.train, seed=0, step=step, batch_size=B,
                                          block_size=T, rows=rows)
    with DeviceBatches(make, start_step=s, batch_size=B, sharding=sharding) as batches:
        for step, (x, y) in batches: ...   # global jax.Arrays, made ahead by a thread

One module per stage, each importing only those before it:

    sources/       the registry of source kinds, picked by the scheme of data.source, each
                   with its own config section: files, directories, globs, JSONL, PDF,
                   images by OCR (ocr.py), stdlib; tfds:; hf:; generated:
    tfds_local.py  a TFDS builder that turns your own files into a dataset
    records.py     .jsonl/.json/.csv/.tsv records → prompt/completion turns by templates
    split.py       what is read; train/validation decided as documents stream past; the
                   tokenizer's sample
    encode.py      documents encoded by worker processes, in order
    shards.py      token shards: written .partial then renamed; read back as one array
    stream.py      a text corpus streamed into shards, resumably (progress.json checkpoints)
    cache.py       prepare(): documents → tokenizer → token files, fingerprinted and reused
    examples.py    a records corpus's examples in the cache: tokens, loss mask, origins
    batches.py     training windows as a pure function of (seed, step); evaluation windows
    packing.py     examples packed into rows; their batches as a pure function of (seed, step)
    prefetch.py    DeviceBatches: batches made ahead and laid out on the devices
    __main__.py    `python -m jaxgpt.data --config=…`: prepare without training

The settings are config.data (jaxgpt.config.DataConfig). Bad input raises
`FileNotFoundError` (a missing path) or `DataError` (a `ValueError`) with a one-line message
that says what is wrong and what to do.
"""

from jaxgpt.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("bits_per_byte", "eval_batch", "eval_batches", "num_eval_batches", "train_batch"),
                    "jaxgpt.data.batches"),
    **dict.fromkeys(("Corpus", "known_tokenizer", "open_corpus", "prepare", "tokenizer_hash"), "jaxgpt.data.cache"),
    **dict.fromkeys(("Examples", "encode_turns"), "jaxgpt.data.examples"),
    **dict.fromkeys(("Layout", "eval_rows", "num_eval_rows", "packed_batch", "plan"), "jaxgpt.data.packing"),
    **dict.fromkeys(("DeviceBatches", "process_rows"), "jaxgpt.data.prefetch"),
    **dict.fromkeys(("DocumentReader", "list_files"), "jaxgpt.data.sources"),
    "split_documents": "jaxgpt.data.split",
    "DataError": "jaxgpt.errors",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)  # an encoding worker imports no JAX
