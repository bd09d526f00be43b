"""Experiments in one command: the Cartesian product of a few settings, each cell an ordinary run.

    python -m jaxgpt.sweep --config=configs/experiment.py --grid model.positions=learned,rope,alibi \\
        --grid train.lr=1e-3,3e-4 [--seeds 0,1] --out runs/sweep-NAME [--config.train.steps=300 …]

Each cell is the config with its grid values (and seed) set as command-line overrides would
set them, trained by the same code path as train.py into OUT/<cell>/; the grid's keys and the
command line's count as set by the user, so init_from refuses to replace them. Every cell's config
is checked before the first is trained: a grid value that no cell accepts (a typo) stops the sweep
with nothing trained, and a combination the config refuses (e.g. post-norm with the parallel
block) is reported and left out. Run the same command again and it resumes: a cell finished with
the same config (OUT/cells.json records each cell's) is skipped, any other is trained (an
interrupted one resumes from its last checkpoint, one that holds another model is refused). An
OUT that holds a cell finished with settings this sweep does not train holds another sweep: it is
refused with nothing trained, its summary kept (a sweep with more cells than OUT's goes on).

An ablation instead of a grid: `--ablate NAME:KEY=VALUE[,KEY=VALUE…]` (repeated; a value may hold
commas inside brackets, e.g. `train.batch_schedule=((60,16),(240,32))`) trains the config
as it is (the cell `all`) and, for each ablation, the config with those keys changed (the cell
NAME): each element of a recipe removed in turn. Each ablation was asked for by name, so one the
config refuses (a typo in a key or a value) stops the sweep before anything is trained.

    python -m jaxgpt.sweep --config=configs/speedrun_cpu.py --ablate no_qk_norm:model.qk_norm=False \
        --ablate adamw:train.optimizer=adamw,train.lr=3e-3 --seeds 0,1 --target_loss 1.9 --out runs/ablation

OUT/summary.csv has one row per cell trained as asked (final and best validation loss, bits per
byte, tokens/s, parameters; with --target_loss, a finite positive loss, the step and the training
seconds at the first evaluation at or below it: compile included, evaluations and checkpoints not,
empty when not reached); OUT/summary.md the same per setting as mean ± std over the seeds ('not
reached' where no seed reached the target), and the cells left out with why; OUT/val_loss.png
every such cell's validation loss against step.
The sweep exits 1 when a cell failed, 2 when nothing could be trained.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxgpt import metrics, sharding
from jaxgpt.checkpoint import CheckpointError
from jaxgpt.cli import overridden_keys, parse_config
from jaxgpt.errors import ConfigError, one_line, tidy_cli_output
from jaxgpt.files import unwritable, writable_directory, write_json
from jaxgpt.sweep.summary import write_summary
from jaxgpt.train import opening, run

if TYPE_CHECKING:
    from ml_collections import ConfigDict

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.py"
BASELINE = "all"  # an ablation's cell with nothing removed
RECORD_FILE = "cells.json"  # each finished cell's config as asked: a rerun skips it only when that is unchanged
SET_BY_THE_SWEEP = {"train.seed": "--seeds", "run_dir": "--out"}
RUN_ERRORS = (ValueError, OSError, run.TrainingError, CheckpointError)


@dataclasses.dataclass
class Cell:
    """One run of the sweep: its grid values and seed, its config, and what became of it."""

    name: str
    setting: dict[str, str]
    seed: int
    ablation: str | None = None  # the --ablate name (BASELINE for the config as it is); None in a grid
    config: ConfigDict | None = None  # the parsed config (None when it does not parse)
    refused: str | None = None  # why the config refuses this cell, found before any cell trains
    status: str = ""  # done, skipped (finished), failed: …, stopped

    @property
    def overrides(self) -> list[str]:
        return [f"--config.{key}={value}" for key, value in self.setting.items()]

    @property
    def trained_as_asked(self) -> bool:
        return self.status in ("done", "skipped (finished)")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jaxgpt.sweep", description=__doc__.split("\n\n")[0],
                                     epilog="The config: --config=FILE and --config.KEY=VALUE overrides, anywhere on "
                                            "the line, as train.py takes them.")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,…",
                        help="a config key and its values (repeat for more keys: their product is swept)")
    parser.add_argument("--ablate", action="append", default=[], metavar="NAME:KEY=V[,KEY=V…]",
                        help="instead of --grid: the config as it is, and one cell per --ablate with its keys changed")
    parser.add_argument("--target_loss", type=float, default=None,
                        help="report the step and training seconds at which each cell first reaches this val loss")
    parser.add_argument("--seeds", default="0", help="train.seed values, comma-separated (default 0)")
    parser.add_argument("--out", required=True, help="the sweep's directory: one run directory per cell")
    return parser.parse_known_args(argv)


def grid_of(specs: list[str], config_argv: list[str] = ()) -> dict[str, list[str]]:
    """{key: its values} of the --grid flags; a key given twice, a value listed twice, or a key
    the command line or the sweep itself sets too is refused (one of them would be dropped)."""
    grid = {}
    for spec in specs:
        key, _, values = spec.partition("=")
        if not key or not values:
            raise ConfigError(f"--grid {spec!r}: write KEY=V1,V2,… (e.g. model.positions=learned,rope)")
        if key in grid:
            raise ConfigError(f"--grid {key} is given twice: put all its values in one --grid {key}=V1,V2,…")
        if key in SET_BY_THE_SWEEP:
            raise ConfigError(f"--grid {key}: the sweep sets {key} itself; use {SET_BY_THE_SWEEP[key]}")
        grid[key] = _distinct(values.split(","), f"--grid {spec}")
    both = [key for key in overridden_keys(list(config_argv)) if key in grid]
    if both:
        raise ConfigError(f"{both[0]} is both swept (--grid) and set (--config.{both[0]}=…): keep one of them")
    return grid


def ablations_of(specs: list[str], config_argv: list[str] = ()) -> dict[str, dict[str, str]]:
    """{name: {key: value}} of the --ablate flags, led by the baseline (BASELINE: nothing changed)."""
    ablations = {BASELINE: {}}
    for spec in specs:
        name, _, settings = spec.partition(":")
        pairs = _pairs(top_level_items(settings))
        if not re.fullmatch(r"[\w.+-]+", name) or not all(key and sep and value for key, sep, value in pairs):
            raise ConfigError(f"--ablate {spec!r}: write NAME:KEY=VALUE[,KEY=VALUE…] "
                              "(e.g. no_qk_norm:model.qk_norm=False)")
        if name in ablations:
            raise ConfigError(f"--ablate {name}: the name is taken{' by the baseline' if name == BASELINE else ''}; "
                              "give each ablation its own name")
        setting = {key: value for key, _, value in pairs}
        if len(setting) < len(pairs):
            twice = next(key for key in setting if [k for k, _, _ in pairs].count(key) > 1)
            raise ConfigError(f"--ablate {name} sets {twice} twice: give each key one value")
        taken = [key for key in setting if key in SET_BY_THE_SWEEP or key in overridden_keys(list(config_argv))]
        if taken:
            raise ConfigError(f"--ablate {name} changes {taken[0]}, which the sweep or the command line sets: "
                              "set it in one place")
        ablations[name] = setting
    return ablations


def _pairs(items: list[str]) -> list[list[str]]:
    """[key, '=', value] of each KEY=VALUE item; an item without '=' after one continues its value (the
    commas of train.muon_coeffs=a,b,c;a,b,c belong to the value)."""
    pairs: list[list[str]] = []
    for item in items:
        if "=" not in item and pairs:
            pairs[-1][2] += f",{item}"
        else:
            pairs.append(list(item.partition("=")))
    return pairs


def top_level_items(text: str) -> list[str]:
    """`text` split at the commas outside brackets: 'a=1,b=((0,1),(2,3))' → ['a=1', 'b=((0,1),(2,3))']."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [*items, text[start:]]


def seeds_of(text: str) -> list[int]:
    try:
        seeds = [int(seed) for seed in text.split(",")]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: write integers separated by commas (e.g. 0,1,2)") from None
    return _distinct(seeds, f"--seeds {text}")


def _distinct(values: list, where: str) -> list:
    if "" in values:
        raise ConfigError(f"{where}: a value is empty; write V1,V2,… without an empty one")
    repeated = next((value for value in values if values.count(value) > 1), None)
    if repeated is not None:
        raise ConfigError(f"{where}: {repeated!r} is listed twice, which would train one run and count it twice: "
                          "list each value once")
    return values


def cells(grid: dict[str, list[str]], seeds: list[int], ablations: dict[str, dict[str, str]] | None = None
          ) -> list[Cell]:
    """Every cell of the grid × seeds (or of the ablations × seeds), each with a directory name of its own."""
    out = []
    named = ablations or {",".join(f"{key.split('.')[-1]}={value}" for key, value in setting.items()): setting
                          for setting in (dict(zip(grid, values, strict=True))
                                          for values in itertools.product(*grid.values()))}
    for name, setting in named.items():
        out.extend(Cell(re.sub(r"[^\w.,=+-]+", "_", f"{name},seed={seed}"), setting, seed,
                        name if ablations else None) for seed in seeds)
    names = [cell.name for cell in out]
    clash = next((name for name in names if names.count(name) > 1), None)
    if clash is not None:
        raise ConfigError(f"two cells would share the directory {clash!r} (values that differ only in characters "
                          "a directory name cannot hold): write the values differently")
    return out


# --- every cell checked before the first is trained -------------------------------------------


def parse_cells(plan: list[Cell], config_argv: list[str], out: Path) -> None:
    """Each cell's config, or why it does not parse (cell.refused)."""
    for cell in plan:
        cell.config, cell.refused = _parsed(config_argv, [*cell.overrides, f"--config.train.seed={cell.seed}",
                                                          f"--config.run_dir={out / cell.name}"])


def _parsed(config_argv: list[str], overrides: list[str]) -> tuple[Any, str | None]:
    """(the config of the command line and `overrides`, None), or (None, why it does not parse)."""
    try:
        return parse_config(["sweep", *config_argv, *overrides], DEFAULT_CONFIG), None
    except ConfigError as error:
        return None, _tidy(one_line(error, limit=2000), config_argv)


def _checked(config, explicit_keys: list[str]) -> str | None:
    """Why opening.check_config refuses `config`, or None."""
    try:
        opening.check_config(config, explicit_keys)
    except RUN_ERRORS as error:
        return one_line(error, limit=2000)
    return None


_FLAG_ERROR = re.compile(r"flag --config\.([\w.]+)=(.*?): (.*)")
_KINDS = {bool: "True or False", int: "an integer", float: "a number"}


def _tidy(reason: str, config_argv: list[str]) -> str:
    """A value of the wrong type said as what its key takes (absl's own words are a raw tuple,
    e.g. "('Non-boolean argument to boolean flag', 'Ture')")."""
    match = _FLAG_ERROR.fullmatch(reason)
    if match is None:
        return reason
    key, value, words = match.groups()
    try:
        *sections, name = key.split(".")
        section = functools.reduce(lambda node, part: node[part],
                                   sections, parse_config(["sweep", *config_argv], DEFAULT_CONFIG))
        kind = _KINDS.get(section.get_type(name))
    except (ConfigError, KeyError, AttributeError):
        kind = None
    if kind is not None:
        return f"{key} takes {kind}, not {value!r}"
    raw = re.fullmatch(r"\('([^']*)', .*\)", words)
    return f"{key}={value}: {raw.group(1) if raw else words}"


def check_cells(plan: list[Cell], config_argv: list[str]) -> None:
    """Every check a run makes before it reads its data, for each cell (opening.check_config: the
    config schema, init_from and the mesh); then a ConfigError when an ablation (or the baseline)
    is refused, a grid value is refused in every cell that has it, or two cells are one run:
    nothing is trained then."""
    for cell in plan:
        if cell.refused is None:
            cell.refused = _checked(cell.config, explicit(cell, config_argv))
    _refuse_a_refused_ablation(plan, config_argv)
    if all(cell.refused for cell in plan):
        raise ConfigError(f"every cell of the sweep is refused, so nothing was trained; {plan[0].name}: "
                          f"{plan[0].refused}")
    for key in plan[0].setting:
        for value in dict.fromkeys(cell.setting[key] for cell in plan):
            having = [cell for cell in plan if cell.setting[key] == value]
            if all(cell.refused for cell in having):
                raise ConfigError(f"--grid {key}={value} is refused in every cell ({having[0].refused}): correct "
                                  "or drop the value; nothing was trained")
    _refuse_the_same_run_twice([cell for cell in plan if not cell.refused])


def _refuse_a_refused_ablation(plan: list[Cell], config_argv: list[str]) -> None:
    """Each ablation was asked for by name, so one the config refuses (a typo in a key or a value,
    or a combination of its changes) stops the sweep, naming the change it refuses; so does a
    refused baseline, which every ablation is measured against."""
    cell = next((cell for cell in plan if cell.ablation is not None and cell.refused), None)
    if cell is None:
        return
    if cell.ablation == BASELINE:
        raise ConfigError(f"the config as it is (the cell {BASELINE}, which each ablation is measured against) is "
                          f"refused ({cell.refused}): correct the config or its --config overrides; nothing was "
                          "trained")
    change, why = ",".join(f"{key}={value}" for key, value in cell.setting.items()), cell.refused
    for key, value in cell.setting.items():  # the first change refused on its own, if one is
        alone = [f"--config.{key}={value}"]
        config, refused = _parsed(config_argv, [*alone, f"--config.train.seed={cell.seed}"])
        refused = refused or _checked(config, overridden_keys([*config_argv, *alone]))
        if refused:
            change, why = f"{key}={value}", refused
            break
    raise ConfigError(f"--ablate {cell.ablation}: {change} is refused ({why}): correct it, or drop this --ablate; "
                      "nothing was trained")


def _refuse_the_same_run_twice(plan: list[Cell]) -> None:
    """Two spellings of one value (True and true, 1e-3 and 0.001) make two cells of one run; so
    does an ablation that changes nothing."""
    seen: dict[str, Cell] = {}
    for cell in plan:
        key = json.dumps(as_asked(cell.config), sort_keys=True)
        if key in seen and cell.ablation is not None:
            why = ("the config has its values already" if seen[key].ablation == BASELINE
                   else "their values mean the same")
            raise ConfigError(f"--ablate {cell.ablation}: {cell.name} is the same run as {seen[key].name} ({why}): "
                              "give each --ablate a change of its own")
        if key in seen:
            raise ConfigError(f"cells {seen[key].name} and {cell.name} are the same run (their values mean the same): "
                              "list each value of --grid once")
        seen[key] = cell


def explicit(cell: Cell, config_argv: list[str]) -> list[str]:
    """The keys the user set for this cell: the command line's and the grid's (init_from may not replace them)."""
    return overridden_keys([*config_argv, *cell.overrides])


def as_asked(config) -> dict:
    """The config as plain JSON values, to compare with the one a finished cell recorded; its
    run_dir (always OUT/<cell>) left out, so that a sweep's directory may be moved."""
    asked = json.loads(json.dumps(config.to_dict(), sort_keys=True, default=str))
    asked.pop("run_dir")
    return asked


# --- training -------------------------------------------------------------------------------


def finished(directory: Path, steps: int) -> bool:
    records = metrics.current_records(metrics.read_metrics(directory))
    return bool(records) and records[-1]["step"] >= steps and any((directory / "checkpoints").glob("[0-9]*"))


def run_cell(cell: Cell, out: Path, config_argv: list[str], record: dict) -> str:
    """Train one cell unless it finished with this very config; 'done', 'skipped (finished)',
    'failed: …' or 'stopped'. A cell that trains to its end is recorded in OUT/cells.json."""
    asked = as_asked(cell.config)
    if record.get(cell.name) == asked and finished(out / cell.name, cell.config.train.steps):
        return "skipped (finished)"
    try:
        result = run.train(cell.config, explicit=explicit(cell, config_argv))
    except RUN_ERRORS as error:
        return f"failed: {one_line(error, limit=2000)}"
    if result["interrupted"]:
        return "stopped"
    record[cell.name] = asked
    write_json(out / RECORD_FILE, record)
    return "done"


def differences(saved: dict, asked: dict, shown: int = 3) -> str:
    """'key: old → new' for the first `shown` dotted keys whose values differ."""
    def flat(tree: dict, prefix: str = "") -> dict:
        items = {}
        for key, value in tree.items():
            items.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
        return items

    old, new = flat(saved), flat(asked)
    keys = [key for key in dict.fromkeys([*old, *new]) if old.get(key) != new.get(key)]
    listed = [f"{key}: {old.get(key)!r} → {new.get(key)!r}" for key in keys[:shown]]
    return ", ".join(listed) + (f" and {len(keys) - shown} more" if len(keys) > shown else "")


def refuse_another_sweep(plan: list[Cell], out: Path) -> None:
    """A ConfigError when OUT holds a cell finished with settings this sweep does not train (OUT
    holds another sweep, whose summary this one would replace); the same sweep again (or one with
    more cells) goes on, skipping the cells it finished."""
    cells_by_name = {cell.name: cell for cell in plan}
    for name, trained in read_record(out).items():
        cell = cells_by_name.get(name)
        if cell is None:
            what = f"its cell {name} is not one of this sweep's"
        elif cell.refused:
            what = f"its cell {name} is refused by this sweep's config: {cell.refused}"
        elif trained != as_asked(cell.config):
            what = f"its cell {name} was trained with other settings: {differences(trained, as_asked(cell.config))}"
            what += ", trained → asked"
        else:
            continue
        raise ConfigError(f"--out {out} holds another sweep ({what}): choose another --out, or give the settings "
                          "it was run with to continue it; nothing was trained")


def read_record(out: Path) -> dict:
    try:
        return json.loads((out / RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or damaged: the cells are trained (a finished one resumes at its end)
        return {}


def train_cells(plan: list[Cell], out: Path, config_argv: list[str]) -> bool:
    """Train the cells the config accepts, in order; False when a signal stopped the sweep."""
    record = read_record(out)
    for i, cell in enumerate(plan, start=1):
        if cell.refused is not None:
            continue
        cell.status = run_cell(cell, out, config_argv, record)
        print(f"[{i}/{len(plan)}] {cell.name}: {cell.status}", file=sys.stderr)
        if cell.status == "stopped":
            return False
    return True


# --- the command line -----------------------------------------------------------------------


def sweep(args, config_argv: list[str]) -> list[Cell] | None:
    """Plan, check and train the sweep, then write its summary; None when a signal stopped it."""
    out = Path(args.out)
    if args.target_loss is not None and not (math.isfinite(args.target_loss) and args.target_loss > 0):
        raise ConfigError(f"--target_loss {args.target_loss:g}: a target loss must be a finite positive number "
                          "(a validation loss, e.g. 1.9)")
    if bool(args.grid) == bool(args.ablate):
        raise ConfigError("give --grid KEY=V1,V2,… (a product of settings) or --ablate NAME:KEY=V,… (each change "
                          "alone against the config as it is), one of the two")
    grid = grid_of(args.grid, config_argv) if args.grid else {}
    plan = cells(grid, seeds_of(args.seeds), ablations_of(args.ablate, config_argv) if args.ablate else None)
    parse_cells(plan, config_argv, out)
    first = next((cell.config for cell in plan if cell.config is not None), None)
    if first is not None:
        sharding.start_jax(first)  # once, before JAX starts: the cells share the process
    check_cells(plan, config_argv)
    refuse_another_sweep(plan, out)
    for cell in plan:
        if cell.refused:
            print(f"[left out] {cell.name}: refused by the config: {cell.refused}", file=sys.stderr)
    writable_directory(out, "choose another --out")
    if not train_cells(plan, out, config_argv):
        return None
    try:
        write_summary(out, plan, args.target_loss)
    except OSError as error:
        raise unwritable(out, error, "choose another --out") from None
    return plan


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, config_argv = parse_args(argv)
    tidy_cli_output()
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.FATAL)  # orbax's failures reach jaxgpt as exceptions
    try:
        plan = sweep(args, config_argv)
    except RUN_ERRORS as error:
        print(f"jaxgpt.sweep: error: {one_line(error, limit=2000)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second signal before a cell began training: nothing to save
        plan = None
    if plan is None:
        print("sweep stopped; run the same command again to resume", file=sys.stderr)
        return 130
    out = Path(args.out)
    print((out / "summary.md").read_text(), end="")
    print(f"wrote {out / 'summary.csv'}, summary.md" + (", val_loss.png" if (out / "val_loss.png").exists() else ""))
    failed = [cell for cell in plan if cell.status.startswith("failed")]
    if failed:
        print(f"jaxgpt.sweep: error: {len(failed)} of {len(plan)} cells failed ({failed[0].name}: "
              f"{failed[0].status.removeprefix('failed: ')}); the summary holds only the cells trained as asked",
              file=sys.stderr)
        return 1
    return 0

