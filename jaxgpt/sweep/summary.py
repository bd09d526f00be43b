"""A sweep's summary, written from its cells' run directories: OUT/summary.csv (a row per cell
trained as asked), OUT/summary.md (a row per setting, mean ± std over the seeds, and the cells
left out with why) and OUT/val_loss.png (each such cell's validation loss against step).

The cells are jaxgpt.sweep's: each has a name (its directory under OUT), a seed, a status
('done', 'skipped (finished)', 'failed: …', 'stopped' or ''), `trained_as_asked` and `refused`
(why the config refuses it, or None).
"""

from __future__ import annotations

import csv
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxgpt import metrics, viz
from jaxgpt.config import GPTConfig
from jaxgpt.model import param_count
from jaxgpt.train import run

COLUMNS = ("cell", "seed", "final_val_loss", "best_val_loss", "val_bpb", "tokens_per_sec", "params", "steps",
           "steps_to_target", "seconds_to_target")
NOT_REACHED = "not reached"


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


def summarize(out: Path, plan: Sequence[Any], target: float | None = None
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


def summary_table(rows: list[dict], target: float | None = None) -> list[str]:
    """summary.md's table: a row per setting, mean ± std over its seeds; with a target, the steps
    and seconds to it over the seeds that reached it ('not reached' where none did)."""
    settings: dict[str, list[dict]] = {}
    for row in rows:
        settings.setdefault(row["cell"].rsplit(",seed=", 1)[0], []).append(row)
    timed = target is not None
    lines = ["| setting | seeds | final val loss | best val loss | val bpb | tokens/s | params |"
             + (" steps to target | seconds to target |" if timed else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if timed else "")]
    for setting, group in settings.items():
        def stat(key, fmt, rows=group):
            values = [r[key] for r in rows]
            spread = f" ± {statistics.stdev(values):{fmt}}" if len(values) > 1 else ""
            return f"{statistics.mean(values):{fmt}}{spread}"

        line = (f"| {setting} | {len(group)} | {stat('final_val_loss', '.4f')} | {stat('best_val_loss', '.4f')} "
                f"| {stat('val_bpb', '.3f')} | {stat('tokens_per_sec', ',.0f')} | {group[0]['params']:,} |")
        if timed:
            reached = [r for r in group if r["steps_to_target"] is not None]
            some = f" ({len(reached)} of {len(group)} seeds)" if len(reached) < len(group) else ""  # in each cell
            line += (f" {stat('steps_to_target', '.0f', reached)}{some} | {stat('seconds_to_target', '.1f', reached)}"
                     f"{some} |" if reached else f" {NOT_REACHED} | {NOT_REACHED} |")
        lines.append(line)
    return lines


def left_out(plan: Sequence[Any]) -> list[str]:
    """summary.md's lines for the cells that are not in its table, and why."""
    lines = [f"- {cell.name}: refused by the config: {cell.refused}" for cell in plan if cell.refused]
    lines += [f"- {cell.name}: {cell.status}" for cell in plan if cell.status.startswith("failed")]
    return ["", "Not in this table:", *lines] if lines else []


def write_summary(out: Path, plan: Sequence[Any], target: float | None = None) -> None:
    """summary.csv, summary.md and val_loss.png of the cells this sweep trained as asked (a
    picture left by an earlier run of this sweep with no such cell is removed). In summary.csv
    the steps and seconds to the target are empty where the cell did not reach it (or no target
    was given)."""
    rows, curves = summarize(out, plan, target)
    with open(out / "summary.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (out / "summary.md").write_text("\n".join([*summary_table(rows, target), *left_out(plan)]) + "\n")
    if curves:
        viz.plot_curves(curves, out / "val_loss.png", title=out.name)
    else:
        (out / "val_loss.png").unlink(missing_ok=True)
