"""The names users import: every `from jaxgpt… import …` line and every dotted `jaxgpt.module.name` that the
README and docs/ show resolve, and each module that moved into a package by concern is still importable by its
old name, as the very module of its new home."""

import importlib
import re
from pathlib import Path

import pytest

import jaxgpt

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IMPORTS = re.compile(r"^\s*from (jaxgpt[\w.]*) import ([\w, ]+)", re.M)
DOTTED = re.compile(r"`(jaxgpt(?:\.\w+)+)")


def documented_imports() -> list[tuple[str, str]]:
    found = set()
    for page in PAGES:
        for module, names in IMPORTS.findall(page.read_text()):
            found |= {(module, name.strip()) for name in names.split(",") if name.strip()}
    return sorted(found)


def documented_dotted() -> list[str]:
    return sorted({name for page in PAGES for name in DOTTED.findall(page.read_text())})


def resolve(dotted: str):
    """The module, or the attribute of the longest importable module prefix, that `dotted` names."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            value = getattr(value, attribute)
        return value
    raise ModuleNotFoundError(dotted)


def test_the_docs_show_imports_and_names():
    assert len(documented_imports()) >= 3 and len(documented_dotted()) >= 10


@pytest.mark.parametrize("module, name", documented_imports())
def test_every_import_the_docs_show_works(module, name):
    assert getattr(importlib.import_module(module), name) is not None


def test_every_dotted_name_the_docs_show_resolves():
    missing = []
    for dotted in documented_dotted():
        try:
            resolve(dotted)
        except (ImportError, AttributeError) as error:
            missing.append(f"{dotted} ({error})")
    assert not missing, missing


@pytest.mark.parametrize("old, new", sorted(jaxgpt.MOVED.items()))
def test_a_moved_module_is_the_same_module_under_its_old_name(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)
    leaf = old.rsplit(".", 1)[1]
    assert getattr(importlib.import_module("jaxgpt"), leaf) is importlib.import_module(new)
