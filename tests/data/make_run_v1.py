"""Writes tests/data/run_v1: a run directory of this version's train.py, kept so that later
versions prove they still load, sample and resume it (tests/test_run.py). Run from the
repository root: python tests/data/make_run_v1.py (it replaces tests/data/run_v1)."""

import shutil
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from test_run import tiny_config, write_corpus  # noqa: E402

from jaxgpt.train.run import train  # noqa: E402


def main():
    target = TESTS / "data" / "run_v1"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = write_corpus(tmp / "corpus.txt")
        train(tiny_config(tmp, corpus, "run_v1", preset="default", **{"mesh.cpu_devices": 0, "train.steps": 3}))
        saved = tmp / "run_v1" / "config.json"
        saved.write_text(saved.read_text().replace(f"{tmp}/", ""))  # the paths as relative names
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(tmp / "run_v1", target, ignore=shutil.ignore_patterns(".lock", "*.png", "events.*"))


if __name__ == "__main__":
    main()
