"""Names a package exports, imported from their modules when first used (PEP 562), so that
importing one light submodule (a tokenizer in a data-preparation worker) does not start JAX; and
modules that moved, found by their old names (alias_moved)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
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


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a module by the name it had before it moved: the module is its new home's, one object."""

    def __init__(self, moved: dict[str, str]):
        self.moved = moved

    def find_spec(self, name: str, path=None, target=None):
        if name not in self.moved:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        return importlib.import_module(self.moved[spec.name])

    def exec_module(self, module) -> None:  # the new home ran it already: the old name is that one module
        pass


def alias_moved(moved: dict[str, str]) -> None:
    """Let `import OLD` (and `from OLD import x`) give the module now named moved[OLD], for code written
    against the old layout: one finder at the end of sys.meta_path, asked only for the old names."""
    if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
        sys.meta_path.append(_Moved(moved))
