"""The README's first two commands are what CI runs and what a new user types. The commands of the
README and of every docs/ page must parse, and their tables must be what their commands and the
project's registries give; the README stays short, and its links and the pages' reach what they name."""

import importlib
import importlib.util
import itertools
import json
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]  # the README and the reference pages it links to
MAX_README_LINES = 250


def readme_commands():
    text = README.read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_main_job_and_test_commands():
    main, tests = readme_commands()[:2]
    assert "pip install -e ." in main and "python train.py" in main
    assert 'pip install -e ".[test]"' in tests and "pytest" in tests


def test_ci_runs_the_readme_install_and_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    tests = readme_commands()[1]
    install = tests.split(" && ")[2]  # the pip install of the test command
    assert install.replace("pip install", "pip install -q") in ci
    assert "python -m pytest -q" in ci
    assert (ROOT / "train.py").exists()


def test_every_data_key_the_docs_name_is_a_key():
    """`data.files.text_field`, `--config.data.workers`, …: a key that moves cannot stay behind in the
    README or a docs page."""
    from jaxgpt.config import default_config, unknown_key

    config = default_config()
    named = {(key, page.name) for page in DOCS
             for key in re.findall(r"(?:`|--config\.)(data(?:\.[a-z_]+)+)", page.read_text())}
    missing = [f"{key} in {page} ({unknown_key(config, key)})" for key, page in sorted(named)
               if unknown_key(config, key)]
    assert "data.ocr.lang" in {key for key, _ in named} and not missing, missing


# --- the commands and tables of the README and docs/ against the code ----------------------------

CONFIG_CLIS = ("train.py", "jaxgpt.data")  # their arguments are a config's: --config=FILE --config.KEY=VALUE
ARGPARSE_CLIS = ("eval.py", "sample.py", "jaxgpt.export", "jaxgpt.viz")  # each with its parse_args(argv)


def bash_blocks():
    """(the text after it, its command lines) for each ```bash block of the README and the docs pages,
    continuation lines joined."""
    for page in DOCS:
        text = page.read_text()
        for match in re.finditer(r"```bash\n(.*?)```", text, re.S):
            lines = [line.strip() for line in match[1].replace("\\\n", " ").splitlines()]
            yield text[match.end():], [line for line in lines if line.startswith("python ")]


def commands(program: str):
    """The argument lists of the code lines (README, docs/) that run `program` (a script or a -m module);
    a line with an elision (…) is an outline, not a command."""
    for _, lines in bash_blocks():
        for line in lines:
            argv = shlex.split(line, comments=True)[1:]
            argv = argv[1:] if argv[0] == "-m" else argv
            if argv[0] == program and "…" not in line:
                yield argv[1:]


def test_docs_config_commands_parse():
    """Every train.py and `python -m jaxgpt.data` line: its keys exist and its values have their types."""
    from jaxgpt.cli import parse_config

    parsed = 0
    for program in CONFIG_CLIS:
        for args in commands(program):
            parse_config([program, *args], ROOT / "configs" / "default.py")
            parsed += 1
    assert parsed >= 15


def test_docs_tfds_sources_are_datasets_tfds_knows():
    """A command that reads `tfds:NAME` (given, or its config's) names a dataset TFDS can build
    (looked up by name, nothing downloaded): configs/gpt2_124m.py's tfds:openwebtext is not one, so
    every command with that config that reads data must give its own source."""
    import tensorflow_datasets as tfds

    import jaxgpt.data.tfds_local  # noqa: F401  registers local_text_corpus
    from jaxgpt.cli import parse_config

    known = set(tfds.list_builders(with_community_datasets=False))
    sources = [parse_config([program, *args], ROOT / "configs" / "default.py") for program in CONFIG_CLIS
               for args in commands(program)]
    named = {config.data.source.split(":")[1].split("/")[0] for config in sources
             if config.data.source.startswith("tfds:") and not config.compile_only}  # compile_only reads no data
    assert named <= known, f"TFDS has no {sorted(named - known)}"
    assert "local_text_corpus" in named


def script(name: str):
    """A CLI script of the repository's root (eval.py, sample.py) as a module."""
    spec = importlib.util.spec_from_file_location(f"readme_{name.removesuffix('.py')}", ROOT / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_script_commands_parse():
    """Every eval.py, sample.py, export and viz line names flags that exist, with values of their types."""
    for program in ARGPARSE_CLIS:
        module = script(program) if program.endswith(".py") else importlib.import_module(program)
        lines = list(commands(program))
        assert lines, program
        for args in lines:
            module.parse_args(args)


def test_docs_bench_commands_name_scripts_and_their_flags():
    named = [found for page in DOCS
             for found in re.findall(r"python (bench/\w+\.py)((?: --?\w+(?: [\w./]+)?)*)", page.read_text())]
    assert len(named) >= 10
    for path, flags in named:
        source = (ROOT / path).read_text()
        missing = [flag for flag in re.findall(r"--\w+", flags) if f'"{flag}"' not in source]
        assert not missing, f"{path}: {missing}"


def sweep_tables():
    """(argv, the table's rows as {column: value}, the cells listed under 'Not in this table:')
    of each sweep command in the README and the docs pages, and the summary printed under it."""
    for after, lines in bash_blocks():
        sweeps = [line for line in lines if line.startswith("python -m jaxgpt.sweep")]
        if not sweeps:
            continue
        rest = after.lstrip("\n").splitlines()
        table = rest[: next(i for i, line in enumerate(rest) if not line.startswith("|"))]
        header = [cell.strip() for cell in table[0].strip("|").split("|")]
        rows = [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
                for line in table[2:]]
        left = rest[len(table) + 1:]
        listed = itertools.takewhile(lambda line: line.startswith("- "), left[1:])  # the list right below it
        left_out = [line[2:].split(": ", 1)[0] for line in listed] if left and left[0] == "Not in this table:" else []
        yield shlex.split(sweeps[0])[3:], rows, left_out


def test_docs_sweep_tables_are_their_commands_cells():
    """Each sweep table has a row per setting its command trains, in order, and lists the cells the
    config refuses; a cell configured the same in two tables has the same results in both."""
    from jaxgpt import sweep

    results = {}
    tables = list(sweep_tables())
    assert len(tables) == 16  # three grids, the modern recipe's ablation, the later techniques' twelve
    for argv, rows, left_out in tables:
        args, config_argv = sweep.parse_args(argv)
        ablations = sweep.ablations_of(args.ablate, config_argv) if args.ablate else None
        plan = sweep.cells(sweep.grid_of(args.grid, config_argv), sweep.seeds_of(args.seeds), ablations)
        sweep.parse_cells(plan, config_argv, ROOT / args.out)
        sweep.check_cells(plan, config_argv)
        trained = list(dict.fromkeys(cell.name.rsplit(",seed=", 1)[0] for cell in plan if not cell.refused))
        assert [row["setting"] for row in rows] == trained, argv
        assert left_out == [cell.name for cell in plan if cell.refused], argv
        for cell in plan:
            row = next((row for row in rows if row["setting"] == cell.name.rsplit(",seed=", 1)[0]), None)
            if cell.refused or row["seeds"] != "1":
                continue
            same_run = json.dumps(sweep.as_asked(cell.config), sort_keys=True)
            shown = {key: row[key] for key in ("final val loss", "val bpb", "params")}
            assert results.setdefault(same_run, (cell.name, shown))[1] == shown, (results[same_run][0], cell.name)
    assert len(results) < sum(len(rows) for _, rows, _ in tables if rows[0]["seeds"] == "1")  # tables share runs


def page_holding(marker: str) -> str:
    """The text of the one page (README or docs/) that holds `marker`."""
    pages = [page for page in DOCS if marker in page.read_text()]
    assert len(pages) == 1, (marker, [page.name for page in pages])
    return pages[0].read_text()


def test_docs_records_presets_are_the_presets():
    """The preset table: one row per preset of jaxgpt.data.records, with its templates."""
    from jaxgpt.data.records import PRESETS

    table = page_holding("| preset | fields |").split("| preset | fields |", 1)[1].split("\n\n")[0]
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| (.+) \|$", table, re.M)
    assert [name for name, _ in rows] == list(PRESETS)
    for name, forms in rows:
        if PRESETS[name] is not None:
            shown = tuple(form.replace("\\n", "\n") for form in re.findall(r"`([^`]+)`", forms))
            assert shown == PRESETS[name], name


def test_docs_math_table_names_functions_that_exist():
    text = page_holding("## The math and where it lives")
    table = text.split("## The math and where it lives", 1)[1].split("\n\n", 2)[1]
    named = re.findall(r"`(ops|model|optim|training|sampling|decoding|run)\.(\w+)`", table)
    assert len(named) >= 20
    missing = [f"{module}.{name}" for module, name in named
               if not hasattr(importlib.import_module(f"jaxgpt.{module}"), name)]
    assert not missing, missing


# --- the README is short, and its links reach what they name ------------------------------------


def test_readme_is_short_and_links_every_docs_page():
    """The README is a tour (the reference lives in docs/): at most MAX_README_LINES lines, and it
    links to every page of docs/."""
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    linked = {target.split("#")[0] for target in links(text)}
    unlinked = [page.name for page in DOCS[1:] if f"docs/{page.name}" not in linked]
    assert not unlinked, f"the README links to no {unlinked}"


def links(text: str) -> list[str]:
    """The relative targets of a page's Markdown links and images, outside code blocks."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", prose) if not re.match(r"\w+:", target)]


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens, a
    repeated heading numbered."""
    found, seen = set(), {}
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_links_of_the_readme_and_docs_reach_their_files_and_headings():
    broken = []
    for page in DOCS:
        for target in links(page.read_text()):
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no file)")
            elif anchor and anchor not in anchors(file.read_text()):
                broken.append(f"{page.name}: {target} (no heading)")
    assert not broken, broken


def test_anchors_are_githubs():
    assert anchors("# The modern recipe: nanoGPT's loss\n## At GPT-2's size\n## At GPT-2's size\n") == {
        "the-modern-recipe-nanogpts-loss", "at-gpt-2s-size", "at-gpt-2s-size-1"}
