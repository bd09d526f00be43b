"""The repository's command-line scripts (sample.py, eval.py, …) as modules, so tests can call
their main(argv) in-process and reuse the compiled programs of the test session."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_script(filename: str):
    spec = importlib.util.spec_from_file_location(Path(filename).stem + "_cli", ROOT / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
