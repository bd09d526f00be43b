"""Prepare a run's data without training: `python -m jaxgpt.data --config=configs/X.py
[--config.data.workers=8 ...]`.

Reads, splits, tokenizes and caches config.data exactly as train.py would (a later run with
the same data settings reuses the cache), with a progress bar in bytes and documents; a
preparation that was stopped (Ctrl-C, a kill, a full disk) resumes where it stopped. Prints the
cache directory, what the source is where its name does not say it (`stdlib`: which Python's) and
each split's tokens; warnings print as one line each, as train.py's do.
"""

from __future__ import annotations

import signal
import sys
import warnings
from pathlib import Path

from tqdm import tqdm

from jaxgpt.data import cache
from jaxgpt.errors import ConfigError, one_line, tidy_cli_output

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.py"


class Bar:
    """A tqdm bar in bytes (so its rate reads in MB/s) that also counts documents."""

    def __init__(self):
        self.bar = tqdm(unit="B", unit_scale=True, unit_divisor=1000, desc="preparing", dynamic_ncols=True)
        self.documents = 0

    def __call__(self, documents: int, text_bytes: int) -> None:
        self.documents += documents
        if self.bar.update(text_bytes):  # True when the bar was drawn: keep the count in step
            self.bar.set_postfix_str(f"{self.documents:,} documents", refresh=False)

    def close(self) -> None:
        self.bar.set_postfix_str(f"{self.documents:,} documents", refresh=False)
        self.bar.close()


def main(argv: list[str]) -> int:
    from jaxgpt.cli import parse_config  # here, not above: each encoding worker imports this module again

    if {"-h", "--help"} & set(argv[1:]):
        print(__doc__.strip())
        return 0
    tidy_cli_output()
    warnings.showwarning = _show_warning
    signal.signal(signal.SIGTERM, _stop)  # a kill stops it as Ctrl-C does: its workers ended, resumable
    try:
        config = parse_config(argv, DEFAULT_CONFIG)
        bar = Bar()
        try:
            corpus = cache.prepare(config.data, on_progress=bar)
        finally:
            bar.close()
    except (ConfigError, ValueError, TypeError, ImportError, OSError) as error:
        print(f"prepare: {one_line(error, limit=2000)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("prepare: stopped; run the same command to resume", file=sys.stderr)
        return 130
    print(f"cache: {corpus.directory}")
    if "source_description" in corpus.meta:
        print(f"source: {corpus.meta['source_description']}")
    for split, counts in corpus.meta["splits"].items():
        shards = len(counts.get("shards", [None]))
        print(f"{split}: {counts['tokens']:,} tokens, {counts['documents']:,} documents, "
              f"{counts['bytes']:,} bytes, {shards} file(s)")
    return 0


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning on a line of its own, above the progress bar."""
    tqdm.write(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"), file=sys.stderr)


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main(sys.argv))
