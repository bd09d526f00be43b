"""The house rules of docs/ARCHITECTURE.md ("Layers"), checked on the source: imports go downward, no cycles, presets
import only the config schema, and no module or function outgrows one concern.

Every module of jaxgpt/ is parsed with `ast` (imports inside functions count too). A module
belongs to a layer; it may import modules of lower layers and, within its own package, its
siblings (as long as they form no cycle). A new module must be given a layer here, which is
the moment to decide where it belongs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxgpt"

# Lowest first. ops ← model ← (decode, train) ← compile ← CLIs; data, tokenizers and optim
# know nothing of the model; checkpoint, sharding and metrics are leaf utilities. A package
# (decode, score, train, compile, sweep, loss, optim) is one unit: its modules may import each other.
LAYERS = (
    ("errors", "files", "lazy", "ops", "blocks", "axes", "platforms"),
    # blocks: their names and layer layouts; axes: the mesh's names; platforms: JAX's
    # the equations' platform forms: ops computed another way, named by the compute config; XLA's named flag sets
    ("platforms.forms", "platforms.xla_flags"),
    # the schema beneath the code: the model's and the data's sections, the rows of each step; it names no
    # implementation (the names a key may take are checked where a config is opened: registries)
    ("model_config", "data_config", "batch_schedule"),
    ("config",),  # the whole run's schema: its sections, defaults and loading
    ("layout",),  # parameters' declarations: logical axes, groups, the rules to the mesh
    # registries of forms, kernels, schemes; stack: the blocks composed, with value embeddings and U-net skips;
    # previous: what a token takes from the token before it (smear, bigram hash); quantize.layers: the int8 layers
    ("attention", "positions", "stack", "previous", "quantize.layers"),
    # optim: the optimizers and Muon's banks (a train section's names checked against its registries);
    # registries: a model's and a compute section's names checked against the registries where they are defined
    ("optim", "registries"),
    ("programs",),  # compiled programs and traced values kept with a fingerprint of what made them
    ("tokenizers", "checkpoint", "sharding", "metrics", "lock"),
    ("cli",),
    ("data", "model"),
    # what the model says of its targets: the loss and log-probabilities, whole or a chunk at a time, k tokens ahead
    ("loss",),
    ("convert", "quantize"),
    ("decode",),  # generation: the next-token logits, sampling, beam search, text in and out
    ("score",),  # likelihoods, multiple choice, records' prompts answered
    ("train",),  # a run opened and checked, its step, evaluation, the loop, run directories
    ("viz", "compile"),  # compile: train's programs compiled ahead of time for TPU and GPU targets
    ("analysis", "export", "harness"),  # harness: the lm-evaluation-harness's model "jaxgpt"
    ("sweep",),  # experiments: grids and ablations of ordinary runs, and their summary
    ("jaxgpt",),  # the package's __init__: re-exports for users, never imported from inside
)
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
LONGER_FUNCTIONS: dict[tuple[str, str], int] = {}  # (module, function) → its own limit, with the reason


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imports_of(name: str, source: str, known: set[str]) -> set[str]:
    """The jaxgpt modules `source` (the module `name`) imports: `from jaxgpt import x` names
    the module jaxgpt.x when there is one, else the package itself."""
    found = set()
    package = name if name in {k.rpartition(".")[0] for k in known} else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "jaxgpt"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package upward
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "jaxgpt":
                continue
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found - {name}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    found = modules(root)
    return {name: imports_of(name, path.read_text(), set(found)) for name, path in found.items()}


# A package is one unit, but for a module of it that LAYERS names by its dotted name: quantize.layers, the int8
# layers the model picks (by compute.weights), lies below the model, and quantize's params (which trace the model
# to find its matrices) above it. A module belongs to the longest unit name that prefixes it.
UNITS = {name for units in LAYERS for name in units}


def unit(name: str) -> str:
    """The unit a module's layer is decided by: jaxgpt.data.cache → data; jaxgpt.quantize.layers →
    quantize.layers, jaxgpt.quantize.params → quantize; jaxgpt → jaxgpt."""
    parts = name.split(".")
    named = [".".join(parts[1:cut]) for cut in range(len(parts), 2, -1) if ".".join(parts[1:cut]) in UNITS]
    return named[0] if named else parts[1] if len(parts) > 1 else parts[0]


def layer_of(name: str) -> int:
    for rank, units in enumerate(LAYERS):
        if unit(name) in units:
            return rank
    raise KeyError(name)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a module's own layer or a higher one (other than siblings in one package)."""
    bad = []
    for importer, imported in sorted(graph.items()):
        for target in sorted(imported):
            same_package = unit(importer) == unit(target) != "jaxgpt"
            if not same_package and layer_of(target) >= layer_of(importer):
                bad.append(f"{importer} imports {target} (layer {layer_of(importer)} → {layer_of(target)})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle found by a depth-first search, each as the path that closes it."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


# --- the rules, on this repository ------------------------------------------------------------


def test_every_module_has_a_layer():
    missing = [name for name in modules() if not any(unit(name) in units for units in LAYERS)]
    assert not missing, f"give these modules a layer in tests/test_layout.py::LAYERS: {missing}"


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" → ".join(cycle) for cycle in found)


def test_imports_go_downward():
    bad = upward_imports(import_graph())
    assert not bad, "upward or sideways imports: " + "; ".join(bad)


def test_ops_imports_nothing_of_jaxgpt():
    assert import_graph()["jaxgpt.ops"] == set()


@pytest.mark.parametrize("lower", ["data", "tokenizers", "optim"])
def test_data_tokenizers_and_optim_know_nothing_of_the_model(lower):
    model_side = {"model", "train", "decode", "score", "loss", "viz"}
    graph = import_graph()
    bad = [f"{a} imports {b}" for a, targets in graph.items() if unit(a) == lower
           for b in targets if unit(b) in model_side]
    assert not bad, bad


def transitive_imports(graph: dict[str, set[str]], name: str) -> set[str]:
    """Every jaxgpt module `name` imports, directly or through others (a package's __init__ included)."""
    found, todo = set(), [name]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in found:
                found.add(target)
                todo.append(target)
    return found


def third_party_imports(source: str) -> set[str]:
    """The top-level names of the packages outside jaxgpt that `source` imports."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - {"jaxgpt"}


def test_the_model_imports_its_configs_from_model_config_not_the_run_schema():
    """What a model is (GPTConfig) and how it runs (ComputeConfig) come from model_config: the
    model knows nothing of the run's schema, the data section or ml_collections."""
    graph, found = import_graph(), modules()
    below = transitive_imports(graph, "jaxgpt.model")
    assert not below & {"jaxgpt.config", "jaxgpt.data_config"}, sorted(below)
    assert "jaxgpt.model_config" in below
    with_ml_collections = [name for name in below | {"jaxgpt.model"}
                           if "ml_collections" in third_party_imports(found[name].read_text())]
    assert not with_ml_collections, with_ml_collections


# Callers ask a form, scheme or kernel's record what it does (Form.has_weights, Scheme.asks,
# Kernel.dropout, …), never its name. The registries' own files, and the check of a config's
# names where it is opened (registries.py), are where names are read.
NAMES_READ_HERE = ("jaxgpt/attention/", "jaxgpt/positions.py", "jaxgpt/registries.py")
# Tests by name in files their owners are changing now, at most so many: each to ask the record instead
NAME_TESTS_TO_GO: dict[str, int] = {}


def registry_names() -> set[str]:
    from jaxgpt.attention import FORMS, KERNELS
    from jaxgpt.positions import SCHEMES

    # 'none' (no positions) is also how a command line spells None, which cli.py reads
    return (set(FORMS) | set(SCHEMES) | set(KERNELS)) - {"none"}


def name_tests(source: str, names: set[str]) -> list[int]:
    """The lines of `source` that compare something with one of `names` (==, !=, in, not in: a
    string, or a tuple, list or set of them)."""
    def named(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(element) for element in node.elts)
        return isinstance(node, ast.Constant) and node.value in names

    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Compare) and any(named(side) for side in (node.left, *node.comparators))]


def test_no_module_tests_a_form_scheme_or_kernel_by_name():
    names, found = registry_names(), {}
    for path in modules().values():
        relative = path.relative_to(ROOT).as_posix()
        lines = name_tests(path.read_text(), names)
        if lines and not relative.startswith(NAMES_READ_HERE):
            found[relative] = lines
    grown = {path: lines for path, lines in found.items() if len(lines) > NAME_TESTS_TO_GO.get(path, 0)}
    assert not grown, f"ask the registry's record (jaxgpt.attention, jaxgpt.positions), not the name: {grown}"


def test_the_name_check_finds_a_comparison_with_a_registry_name():
    source = 'if cfg.attention == "linear":\n    pass\nok = kind in ("rope", "alibi")\nmessage = "linear"\n'
    assert name_tests(source, {"linear", "alibi"}) == [1, 3]


def test_configs_import_only_the_config_schema():
    for path in sorted((ROOT / "configs").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module]
            else:
                continue
            assert set(names) <= {"jaxgpt.config", "__future__"}, f"{path.name} imports {names}"


def test_modules_and_functions_fit_on_a_screen():
    too_long = []
    for path in modules().values():
        source = path.read_text()
        relative = path.relative_to(PACKAGE).as_posix()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{relative}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > LONGER_FUNCTIONS.get((relative, node.name), MAX_FUNCTION_LINES):
                    too_long.append(f"{relative}::{node.name}: {length} lines")
    assert not too_long, "split by concern: " + "; ".join(too_long)


def architecture_diagram() -> list[tuple[str, ...]]:
    """The layer diagram of docs/ARCHITECTURE.md ("Layers"), lowest row first: each row's module
    names, the words before its note (a note follows two spaces or more)."""
    section = (ROOT / "docs" / "ARCHITECTURE.md").read_text().split("\n## Layers\n", 1)[1]
    block = section.split("```\n", 2)[1]
    return [tuple(line.split("  ")[0].split()) for line in block.splitlines() if line.strip()]


def test_the_architecture_diagram_is_the_layers():
    """Every layer of LAYERS is a row of the diagram, with the same modules, in the same order."""
    assert architecture_diagram() == list(LAYERS)


# --- the checker itself can fail ----------------------------------------------------------------


def write_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "jaxgpt"
    for relative, source in {"__init__.py": "", **files}.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(source)
    return root


def test_checker_finds_a_cycle_and_names_its_path(tmp_path):
    root = write_package(tmp_path, {
        "ops.py": "from jaxgpt import model\n",
        "model.py": "def f():\n    from jaxgpt.ops import relu\n",  # lazy imports count too
    })
    assert cycles(import_graph(root)) == [["jaxgpt.model", "jaxgpt.ops", "jaxgpt.model"]]


def test_checker_names_an_upward_import(tmp_path):
    root = write_package(tmp_path, {
        "model.py": "import jaxgpt.ops\n",
        "ops.py": "",
        "data/__init__.py": "from jaxgpt.data.cache import prepare\n",
        "data/cache.py": "from jaxgpt.model import GPT\nfrom jaxgpt.data import sources\n",
        "data/sources.py": "",
    })
    data_and_model = layer_of("jaxgpt.model")  # one layer: neither may import the other
    assert upward_imports(import_graph(root)) == [
        f"jaxgpt.data.cache imports jaxgpt.model (layer {data_and_model} → {data_and_model})"]


def test_checker_resolves_relative_and_package_imports(tmp_path):
    root = write_package(tmp_path, {
        "data/__init__.py": "from .cache import prepare\n",
        "data/cache.py": "from . import sources\nfrom jaxgpt import errors\n",
        "data/sources.py": "",
        "errors.py": "",
    })
    graph = import_graph(root)
    assert graph["jaxgpt.data"] == {"jaxgpt.data.cache"}
    assert graph["jaxgpt.data.cache"] == {"jaxgpt.data.sources", "jaxgpt.errors"}
