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
interrupted one resumes from its last checkpoint, one that holds another model is refused).

An ablation instead of a grid: `--ablate NAME:KEY=VALUE[,KEY=VALUE…]` (repeated) trains the config
as it is (the cell `all`) and, for each ablation, the config with those keys changed (the cell
NAME): each element of a recipe removed in turn.

    python -m jaxgpt.sweep --config=configs/speedrun_cpu.py --ablate no_qk_norm:model.qk_norm=False \
        --ablate adamw:train.optimizer=adamw,train.lr=3e-3 --seeds 0,1 --target_loss 1.9 --out runs/ablation

OUT/summary.csv has one row per cell trained as asked (final and best validation loss, bits per
byte, tokens/s, parameters; with --target_loss, the step and the training seconds at the first
evaluation at or below it: compile included, evaluations and checkpoints not); OUT/summary.md the
same per setting as mean ± std over the seeds, and the cells left out with why; OUT/val_loss.png
every such cell's validation loss against step.
The sweep exits 1 when a cell failed, 2 when nothing could be trained.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from jaxgpt import metrics, run, sharding, viz
from jaxgpt.checkpoint import CheckpointError
from jaxgpt.cli import overridden_keys, parse_config
from jaxgpt.config import GPTConfig
from jaxgpt.errors import ConfigError, one_line, tidy_cli_output
from jaxgpt.files import unwritable, writable_directory, write_json
from jaxgpt.model import param_count

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.py"
COLUMNS = ("cell", "seed", "final_val_loss", "best_val_loss", "val_bpb", "tokens_per_sec", "params", "steps",
           "steps_to_target", "seconds_to_target")
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
    config: Any = None  # the parsed config (None when it does not parse)
    refused: str | None = None  # why the config refuses this cell, found before any cell trains
    status: str = ""  # done, skipped (finished), failed: …, stopped

    @property
    def overrides(self) -> list[str]:
        return [f"--config.{key}={value}" for key, value in self.setting.items()]

    @property
    def trained_as_asked(self) -> bool:
        return self.status in ("done", "skipped (finished)")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jaxgpt.sweep", description=__doc__.split("\n\n")[0])
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
        pairs = [item.partition("=") for item in settings.split(",")]
        if not re.fullmatch(r"[\w.+-]+", name) or not all(key and sep and value for key, sep, value in pairs):
            raise ConfigError(f"--ablate {spec!r}: write NAME:KEY=VALUE[,KEY=VALUE…] "
                              "(e.g. no_qk_norm:model.qk_norm=False)")
        if name in ablations:
            raise ConfigError(f"--ablate {name}: the name is taken{' by the baseline' if name == BASELINE else ''}; "
                              "give each ablation its own name")
        setting = {key: value for key, _, value in pairs}
        taken = [key for key in setting if key in SET_BY_THE_SWEEP or key in overridden_keys(list(config_argv))]
        if taken:
            raise ConfigError(f"--ablate {name} changes {taken[0]}, which the sweep or the command line sets: "
                              "set it in one place")
        ablations[name] = setting
    return ablations


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
        out.extend(Cell(re.sub(r"[^\w.,=+-]+", "_", f"{name},seed={seed}"), setting, seed) for seed in seeds)
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
        try:
            cell.config = parse_config(["sweep", *config_argv, *cell.overrides, f"--config.train.seed={cell.seed}",
                                        f"--config.run_dir={out / cell.name}"], DEFAULT_CONFIG)
        except ConfigError as error:
            cell.refused = one_line(error, limit=2000)


def check_cells(plan: list[Cell], config_argv: list[str]) -> None:
    """Every check a run makes before it reads its data, for each cell (run.check_config: the
    config schema, init_from and the mesh); then a ConfigError when a grid value is refused in
    every cell that has it, or two cells are one run: nothing is trained then."""
    for cell in plan:
        if cell.refused is None:
            try:
                run.check_config(cell.config, explicit(cell, config_argv))
            except RUN_ERRORS as error:
                cell.refused = one_line(error, limit=2000)
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


def _refuse_the_same_run_twice(plan: list[Cell]) -> None:
    """Two spellings of one value (True and true, 1e-3 and 0.001) make two cells of one run."""
    seen = {}
    for cell in plan:
        key = json.dumps(as_asked(cell.config), sort_keys=True)
        if key in seen:
            raise ConfigError(f"cells {seen[key]} and {cell.name} are the same run (their values mean the same): "
                              "list each value of --grid once")
        seen[key] = cell.name


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
    'failed: …' or 'stopped'. A cell that trains to its end is recorded in OUT/cells.json; one
    that finished with other settings is not this config's run, and is refused."""
    asked = as_asked(cell.config)
    if cell.name in record and finished(out / cell.name, cell.config.train.steps):
        if record[cell.name] == asked:
            return "skipped (finished)"
        return (f"failed: {out / cell.name} finished with other settings ({differences(record[cell.name], asked)}, "
                "trained → asked), so its results are not this sweep's: give another --out, or the settings it was "
                "trained with")
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


# --- the summary ----------------------------------------------------------------------------


def to_target(records: list[dict], target: float | None) -> tuple[int | None, float | None]:
    """(step, training seconds) at the first evaluation at or below `target`: the seconds of the
    log intervals up to it (each interval's tokens / its tokens/s: compile included, evaluations
    and checkpoints not); (None, None) when none is, or there is no target."""
    seconds, tokens = 0.0, 0
    for r in records:
        seconds += (r["tokens_seen"] - tokens) / max(r["tokens_per_sec"], 1e-9)
        tokens = r["tokens_seen"]
        if target is not None and r.get("val_loss") is not None and r["val_loss"] <= target:
            return r["step"], seconds
    return None, None


def summarize(out: Path, plan: list[Cell], target: float | None = None
              ) -> tuple[list[dict], dict[str, list[tuple[int, float]]]]:
    """A row per cell trained as asked in this sweep and evaluated, and its validation loss against step."""
    rows, curves = [], {}
    for cell in plan:
        if not cell.trained_as_asked:
            continue
        records = metrics.current_records(metrics.read_metrics(out / cell.name))
        evaluated = [r for r in records if r.get("val_loss") is not None]
        if not evaluated:
            continue
        model = json.loads((out / cell.name / run.CONFIG_FILE).read_text())["model"]
        rows.append({"cell": cell.name, "seed": cell.seed, "final_val_loss": evaluated[-1]["val_loss"],
                     "best_val_loss": min(r["val_loss"] for r in evaluated), "val_bpb": evaluated[-1]["val_bpb"],
                     "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in records),
                     "params": param_count(GPTConfig.from_dict(model)), "steps": records[-1]["step"]})
        rows[-1]["steps_to_target"], rows[-1]["seconds_to_target"] = to_target(records, target)
        curves[cell.name] = [(r["step"], r["val_loss"]) for r in evaluated]
    return rows, curves


def summary_table(rows: list[dict]) -> list[str]:
    """summary.md's table: a row per setting, mean ± std over its seeds."""
    settings: dict[str, list[dict]] = {}
    for row in rows:
        settings.setdefault(row["cell"].rsplit(",seed=", 1)[0], []).append(row)
    target = any(row["steps_to_target"] is not None for row in rows)
    lines = ["| setting | seeds | final val loss | best val loss | val bpb | tokens/s | params |"
             + (" steps to target | seconds to target |" if target else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if target else "")]
    for setting, group in settings.items():
        def stat(key, fmt, rows=group):
            values = [r[key] for r in rows]
            spread = f" ± {statistics.stdev(values):{fmt}}" if len(values) > 1 else ""
            return f"{statistics.mean(values):{fmt}}{spread}"

        line = (f"| {setting} | {len(group)} | {stat('final_val_loss', '.4f')} | {stat('best_val_loss', '.4f')} "
                f"| {stat('val_bpb', '.3f')} | {stat('tokens_per_sec', ',.0f')} | {group[0]['params']:,} |")
        if target:
            reached = [r for r in group if r["steps_to_target"] is not None]
            line += (f" {stat('steps_to_target', '.0f', reached)} | {stat('seconds_to_target', '.1f', reached)} |"
                     + (f" ({len(reached)} of {len(group)} seeds)" if len(reached) < len(group) else "")
                     if reached else " not reached | not reached |")
        lines.append(line)
    return lines


def left_out(plan: list[Cell]) -> list[str]:
    """summary.md's lines for the cells that are not in its table, and why."""
    lines = [f"- {cell.name}: refused by the config: {cell.refused}" for cell in plan if cell.refused]
    lines += [f"- {cell.name}: {cell.status}" for cell in plan if cell.status.startswith("failed")]
    return ["", "Not in this table:", *lines] if lines else []


def write_summary(out: Path, plan: list[Cell], target: float | None = None) -> None:
    """summary.csv, summary.md and val_loss.png of the cells this sweep trained as asked (a
    picture left by an earlier sweep with no such cell is removed)."""
    rows, curves = summarize(out, plan, target)
    with open(out / "summary.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (out / "summary.md").write_text("\n".join([*summary_table(rows), *left_out(plan)]) + "\n")
    if curves:
        viz.plot_curves(curves, out / "val_loss.png", title=out.name)
    else:
        (out / "val_loss.png").unlink(missing_ok=True)


# --- the command line -----------------------------------------------------------------------


def sweep(args, config_argv: list[str]) -> list[Cell] | None:
    """Plan, check and train the sweep, then write its summary; None when a signal stopped it."""
    out = Path(args.out)
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


if __name__ == "__main__":
    sys.exit(main())
