"""Experiments in one command: the Cartesian product of a few settings, each cell an ordinary run.

    python -m jaxgpt.sweep --config=configs/experiment.py --grid model.positions=learned,rope,alibi \\
        --grid train.lr=1e-3,3e-4 [--seeds 0,1] --out runs/sweep-NAME [--config.train.steps=300 …]

Each cell is the config with its grid values (and seed) set as command-line overrides would
set them, trained by the same code path as train.py into OUT/<cell>/. Run the same command
again and it resumes: finished cells are skipped and an interrupted one resumes from its last
checkpoint. A combination the config refuses (e.g. post-norm with the parallel block) is
reported and left out. OUT/summary.csv has one row per cell (final and best validation loss,
bits per byte, tokens/s, parameters); OUT/summary.md the same per setting as mean ± std over
the seeds; OUT/val_loss.png every cell's validation loss against step.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import re
import statistics
import sys
from pathlib import Path

from jaxgpt import metrics, run, sharding, viz
from jaxgpt.checkpoint import CheckpointError
from jaxgpt.cli import parse_config
from jaxgpt.config import GPTConfig
from jaxgpt.errors import ConfigError, tidy_cli_output
from jaxgpt.model import param_count

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.py"
COLUMNS = ("cell", "seed", "final_val_loss", "best_val_loss", "val_bpb", "tokens_per_sec", "params", "steps")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jaxgpt.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", action="append", required=True, metavar="KEY=V1,V2,…",
                        help="a config key and its values (repeat for more keys: their product is swept)")
    parser.add_argument("--seeds", default="0", help="train.seed values, comma-separated (default 0)")
    parser.add_argument("--out", required=True, help="the sweep's directory: one run directory per cell")
    return parser.parse_known_args(argv)


def grid_of(specs: list[str]) -> dict[str, list[str]]:
    grid = {}
    for spec in specs:
        key, _, values = spec.partition("=")
        if not key or not values:
            raise ConfigError(f"--grid {spec!r}: write KEY=V1,V2,… (e.g. model.positions=learned,rope)")
        grid[key] = values.split(",")
    return grid


def cells(grid: dict[str, list[str]], seeds: list[int]) -> list[tuple[str, list[str], int]]:
    """(name, overrides, seed) of every cell of the grid × seeds."""
    out = []
    for values in itertools.product(*grid.values()):
        setting = dict(zip(grid, values, strict=True))
        name = ",".join(f"{key.split('.')[-1]}={value}" for key, value in setting.items())
        for seed in seeds:
            cell = re.sub(r"[^\w.,=+-]+", "_", f"{name},seed={seed}")
            out.append((cell, [f"--config.{k}={v}" for k, v in setting.items()], seed))
    return out


def finished(directory: Path, steps: int) -> bool:
    records = metrics.current_records(metrics.read_metrics(directory))
    return bool(records) and records[-1]["step"] >= steps and any((directory / "checkpoints").glob("[0-9]*"))


def run_cell(argv: list[str], out: Path, cell: str, overrides: list[str], seed: int) -> str:
    """Train one cell unless it is finished; 'done', 'skipped', 'invalid: …' or 'stopped'."""
    config = parse_config([*argv, *overrides, f"--config.train.seed={seed}", f"--config.run_dir={out / cell}"],
                          DEFAULT_CONFIG)
    if finished(out / cell, config.train.steps):
        return "skipped (finished)"
    try:
        result = run.train(config)
    except (ValueError, run.TrainingError) as error:  # this combination cannot be trained
        return f"invalid: {error}"
    return "stopped" if result["interrupted"] else "done"


def summarize(out: Path, names: list[tuple[str, int]]) -> tuple[list[dict], dict[str, list[tuple[int, float]]]]:
    """A row per evaluated cell, and each cell's validation loss against step."""
    rows, curves = [], {}
    for cell, seed in names:
        records = metrics.current_records(metrics.read_metrics(out / cell))
        evaluated = [r for r in records if r.get("val_loss") is not None]
        if not evaluated:
            continue
        model = json.loads((out / cell / run.CONFIG_FILE).read_text())["model"]
        rows.append({"cell": cell, "seed": seed, "final_val_loss": evaluated[-1]["val_loss"],
                     "best_val_loss": min(r["val_loss"] for r in evaluated), "val_bpb": evaluated[-1]["val_bpb"],
                     "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in records),
                     "params": param_count(GPTConfig.from_dict(model)), "steps": records[-1]["step"]})
        curves[cell] = [(r["step"], r["val_loss"]) for r in evaluated]
    return rows, curves


def write_summary(out: Path, rows: list[dict], curves: dict[str, list[tuple[int, float]]]) -> None:
    with open(out / "summary.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    settings: dict[str, list[dict]] = {}
    for row in rows:
        settings.setdefault(row["cell"].rsplit(",seed=", 1)[0], []).append(row)
    lines = ["| setting | seeds | final val loss | best val loss | val bpb | tokens/s | params |",
             "|---|---|---|---|---|---|---|"]
    for setting, group in settings.items():
        def stat(key, fmt, group=group):
            values = [r[key] for r in group]
            spread = f" ± {statistics.stdev(values):{fmt}}" if len(values) > 1 else ""
            return f"{statistics.mean(values):{fmt}}{spread}"

        lines.append(f"| {setting} | {len(group)} | {stat('final_val_loss', '.4f')} | {stat('best_val_loss', '.4f')} "
                     f"| {stat('val_bpb', '.3f')} | {stat('tokens_per_sec', ',.0f')} | {group[0]['params']:,} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    viz.plot_curves(curves, out / "val_loss.png", title=out.name)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, config_argv = parse_args(argv)
    tidy_cli_output()
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.FATAL)  # orbax's failures reach jaxgpt as exceptions
    out = Path(args.out)
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")]
        plan = cells(grid_of(args.grid), seeds)
        first = parse_config(["sweep", *config_argv, *plan[0][1]], DEFAULT_CONFIG)
        sharding.start_jax(first)  # once, before JAX starts: the cells share the process
        out.mkdir(parents=True, exist_ok=True)
        for i, (cell, overrides, seed) in enumerate(plan, start=1):
            status = run_cell(["sweep", *config_argv], out, cell, overrides, seed)
            print(f"[{i}/{len(plan)}] {cell}: {status}", file=sys.stderr)
            if status == "stopped":
                print("sweep stopped; run the same command again to resume", file=sys.stderr)
                return 130
        write_summary(out, *summarize(out, [(cell, seed) for cell, _, seed in plan]))
    except (ValueError, OSError, CheckpointError) as error:
        print(f"jaxgpt.sweep: error: {error}", file=sys.stderr)
        return 2
    print((out / "summary.md").read_text(), end="")
    print(f"wrote {out / 'summary.csv'}, summary.md, val_loss.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
