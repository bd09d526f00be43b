"""Names a package exports, imported from their modules when first used (PEP 562), so that
importing one light submodule (a tokenizer in a data-preparation worker) does not start JAX."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable, Callable]:
    """(__getattr__, __dir__) for `package`, whose name n is exports[n]'s attribute n."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted([*namespace, *exports])

    return __getattr__, __dir__
