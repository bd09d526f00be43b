"""docs/MATH.md: every `path::name` it names is defined in that file (read with ast, never
imported), each section names its code and its tests, and the sections follow the
architecture in order."""

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MATH = ROOT / "docs" / "MATH.md"
REFERENCE = re.compile(r"`([\w./-]+\.py)::([\w.]+)`")
NO_TEST = "**Tests:** none"  # how a section says that nothing checks its piece directly

# The work item's order: each must appear in a section heading, in this order (several may share one).
TOPICS = ["tokenizer", "one-hot", "embedding", "positional encoding", "queries, keys and values", "1/√d_k",
          "causal mask", "softmax", "attention weights and context vectors", "multi-head", "concatenation",
          "layer normalisation", "activations", "residual", "feed-forward", "the block", "the stack",
          "unembedding", "logits", "cross-entropy", "perplexity", "backpropagation", "gradient clipping", "adamw",
          "warmup-cosine", "greedy", "temperature", "top-k", "top-p", "beam", "kv cache"]


def references(text: str) -> list[tuple[str, str]]:
    return REFERENCE.findall(text)


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def defines(path: Path, name: str) -> bool:
    """Whether the module defines `name` as a top-level function or class, or, for a dotted
    name `Class.method`, that class with that method in its body."""
    body = parsed(path).body
    for part in name.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return False
        body = node.body
    return True


def missing(text: str, root: Path) -> list[str]:
    """The `path::name` references of a text whose file or definition does not exist under root."""
    return [f"{path}::{name}" for path, name in references(text)
            if not (root / path).is_file() or not defines(root / path, name)]


def sections(text: str) -> dict[str, str]:
    """Heading → body of each '## ' section."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_named_function_and_test_exists():
    text = MATH.read_text(encoding="utf-8")
    assert len(references(text)) > 80  # the pattern finds the references at all
    assert missing(text, ROOT) == []


def test_a_missing_file_or_name_is_reported(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "VALUE = 3\n\n"
        "def f():\n    def inner():\n        pass\n\n"
        "class C:\n    size = 1\n\n    def g(self):\n        pass\n")
    named = ["f", "C", "C.g", "gone", "inner", "g", "C.size", "VALUE", "C.g.h"]
    text = " ".join(f"`pkg/m.py::{name}`" for name in named) + " `pkg/other.py::f`"
    assert missing(text, tmp_path) == [f"pkg/m.py::{name}" for name in named[3:]] + ["pkg/other.py::f"]


def test_each_section_names_its_code_and_its_tests():
    text = MATH.read_text(encoding="utf-8")
    found = sections(text)
    assert len(found) >= 20
    for heading, body in found.items():
        paths = [path for path, _ in references(body)]
        assert any(not path.startswith("tests/") for path in paths), f"section {heading!r} names no code"
        assert any(path.startswith("tests/test_") for path in paths) or NO_TEST in body, \
            f"section {heading!r} names no test (say '{NO_TEST}' if there is none)"


def test_sections_follow_the_architecture_in_order():
    headings = [heading.lower() for heading in sections(MATH.read_text(encoding="utf-8"))]
    positions = []
    for topic in TOPICS:
        where = [i for i, heading in enumerate(headings) if topic in heading]
        assert where, f"no section heading mentions {topic!r}"
        positions.append(where[0])
    assert positions == sorted(positions), list(zip(TOPICS, positions, strict=True))
