"""Measuring a run: step metrics fetched from the devices, throughput and MFU, and the
records written to metrics.jsonl, TensorBoard and the progress bar.

    MFU = (FLOPs per token · tokens per second) / peak FLOP/s

The peak is train.peak_flops when configured; on a CPU without one it is measured (the best
of a few timings of a large matmul).
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

METRICS_FILE = "metrics.jsonl"


def measure_matmul_peak(dtype=jnp.float32, n: int = 1024, seconds: float = 0.5, trials: int = 5) -> float:
    """FLOP/s of a large square matmul on the default device: the CPU's practical peak, the
    best of `trials` timings (each `seconds`/`trials` long) so a busy moment does not lower it."""
    a = jnp.ones((n, n), dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = 0.0
    for _ in range(trials):
        repeats, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / trials:
            matmul(a, a).block_until_ready()
            repeats += 1
        best = max(best, 2 * n**3 * repeats / (time.perf_counter() - start))
    return best


def peak_flops(configured: float | None) -> float | None:
    """The peak FLOP/s for MFU: train.peak_flops (per device; on a CPU, whose devices share its
    cores, per host) times the devices or hosts; on a CPU with none configured, measured."""
    on_cpu = jax.default_backend() == "cpu"
    if configured:
        return float(configured) * (jax.process_count() if on_cpu else jax.device_count())
    return measure_matmul_peak() if on_cpu else None


class Meter:
    """Step metrics on their way from the devices to a record.

    `add` keeps each step's metrics on the device (fetching them every step would make the
    host wait for the devices); `fetch` brings the pending ones over; `record` averages the
    losses fetched since the last record and adds throughput and MFU over that interval;
    `restart_clock` leaves evaluation and saving out of the next interval's time."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak: float | None):
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak
        self.pending: list[tuple[int, Any]] = []
        self.losses: list[float] = []
        self.last = {"loss": math.nan, "grad_norm": math.nan, "lr": math.nan}
        self.run_start = self.interval_start = time.perf_counter()

    def add(self, step: int, metrics: Any) -> None:
        self.pending.append((step, metrics))

    def fetch(self) -> list[tuple[int, dict[str, float]]]:
        """The pending steps' metrics as floats, in step order."""
        fetched = [(step, {k: float(v) for k, v in jax.device_get(m).items()}) for step, m in self.pending]
        self.pending = []
        for _, values in fetched:
            self.losses.append(values["loss"])
            self.last.update(values)
        return fetched

    def record(self, step: int) -> dict[str, Any]:
        """The record of the interval that ends at `step` (fetch first)."""
        now = time.perf_counter()
        tokens_per_sec = len(self.losses) * self.tokens_per_step / max(now - self.interval_start, 1e-9)
        record = {
            "step": step,
            "train_loss": sum(self.losses) / max(len(self.losses), 1),
            "lr": self.last["lr"],
            "grad_norm": self.last["grad_norm"],
            "tokens_per_sec": tokens_per_sec,
            "mfu": self.flops_per_token * tokens_per_sec / self.peak if self.peak else None,
            "elapsed": now - self.run_start,
            "tokens_seen": step * self.tokens_per_step,
        }
        return record

    def restart_clock(self) -> int:
        """Start the next interval now; returns how many steps the last one had."""
        steps, self.losses = len(self.losses), []
        self.interval_start = time.perf_counter()
        return steps


class MetricsLog:
    """metrics.jsonl in the run directory (one JSON object per line), TensorBoard when
    tensorboardX is installed, and a progress bar on the terminal; all off when not enabled
    (processes other than the first)."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, enabled: bool = True):
        from tqdm.auto import tqdm

        self.enabled = enabled
        self.file = _open_for_whole_lines(Path(run_dir) / METRICS_FILE) if enabled else None
        self.tensorboard = _tensorboard(Path(run_dir)) if enabled else None
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                        disable=not enabled, file=sys.stderr, mininterval=0.5)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write((json.dumps(record) + "\n").encode())  # one write of a whole line
        self.file.flush()
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, record["step"])

    def progress(self, steps: int, record: dict) -> None:
        """Advance the bar by `steps` and show the record's loss, lr, tokens/s and MFU."""
        self.bar.update(steps)
        fields = {"loss": f"{record['train_loss']:.4f}", "lr": f"{record['lr']:.2e}",
                  "tok_s": f"{record['tokens_per_sec']:,.0f}"}
        if record["mfu"] is not None:
            fields["mfu"] = f"{record['mfu']:.1%}"
        self.bar.set_postfix(fields, refresh=False)

    def message(self, text: str) -> None:
        if self.enabled:
            self.bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
        if self.file:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _open_for_whole_lines(path: Path):
    """metrics.jsonl opened for appending; a last line cut short (the process was killed while
    writing it) is ended first, so the next record starts a line of its own."""
    file = open(path, "ab")  # noqa: SIM115  closed in MetricsLog.close
    if file.tell() > 0:
        with open(path, "rb") as existing:
            existing.seek(-1, 2)
            if existing.read(1) != b"\n":
                file.write(b"\n")
    return file


def _tensorboard(run_dir: Path):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


def read_metrics(run_dir) -> list[dict]:
    """The records of a run's metrics.jsonl, in the order written ([] when there is none). A
    damaged line (a torn write, an edit) is skipped with one warning naming the file and line."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    records, damaged = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        else:
            damaged.append(number)
    if damaged:
        more = f" and {len(damaged) - 1} more" if len(damaged) > 1 else ""
        warnings.warn(f"{path}:{damaged[0]}{more}: not a metrics record; skipped", stacklevel=2)
    return records


def current_records(records: list[dict]) -> list[dict]:
    """The records of the run as it finally went: a resumed run logs again from its last
    checkpoint, so a record at step s replaces every earlier record at a step ≥ s."""
    kept: list[dict] = []
    for record in records:
        while kept and kept[-1]["step"] >= record["step"]:
            kept.pop()
        kept.append(record)
    return kept
