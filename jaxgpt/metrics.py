"""Measuring a run: step metrics fetched from the devices, throughput and MFU, and the
records written to metrics.jsonl, TensorBoard and the progress bar.

    MFU = (FLOPs per token · tokens per second) / peak FLOP/s

The peak is train.peak_flops when configured; on a CPU without one it is measured when a run
starts (the best of a few timings of a large matmul) and kept in the user's cache directory as
the best measured on this machine so far, so that a busy moment never lowers it; the run's first
line says which peak it is and where it is kept.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.platforms import cpu_model  # noqa: F401  (named here too: the bench scripts read it from metrics)

METRICS_FILE = "metrics.jsonl"
PEAK_FILE = "peak_flops.json"
# Steps the host may dispatch ahead of the devices. A few keep them busy; dozens queued on a
# mesh of CPU devices can stall XLA's collectives for good (jaxlib 0.10: a step's all-reduce
# waits forever for one device), so the meter waits for the step this far back.
IN_FLIGHT = 4


def measure_matmul_peak(dtype=jnp.float32, n: int = 1024, seconds: float = 0.5, trials: int = 5) -> float:
    """FLOP/s of a large square matmul on the default device: the CPU's practical peak, the
    best of `trials` timings (matmul_rate, each `seconds`/`trials` long), so that a moment
    when other work took the cores does not lower it."""
    a = jax.device_put(np.ones((n, n), dtype))  # made on the host: no program of its own
    matmul = jax.jit(_matmul)
    matmul(a, a).block_until_ready()
    return max(matmul_rate(matmul, a, seconds / trials) for _ in range(trials))


def _matmul(x, y):
    return x @ y


def matmul_rate(matmul, a, seconds: float) -> float:
    """FLOP/s of `matmul`(a, a) on a square `a`, repeated for `seconds`."""
    repeats, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        matmul(a, a).block_until_ready()
        repeats += 1
    return 2 * a.shape[0] ** 3 * repeats / (time.perf_counter() - start)


def peak_cache_path(environ=os.environ) -> Path:
    """Where measured peaks are kept: $XDG_CACHE_HOME/jaxgpt/peak_flops.json (~/.cache/…)."""
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxgpt" / PEAK_FILE


def machine_key(dtype=jnp.float32) -> str:
    """What a measured peak depends on: the CPU model, the cores this process may use, the
    JAX version and the dtype."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu_model()} | {cores} cores | jax {jax.__version__} | {jnp.dtype(dtype).name}"


# Runs that measure the peak before it is trusted: the best of this many measurements, each
# taken by another run (a moment's load lowers one, rarely three), is kept and used from then on.
MEASUREMENTS = 3


def cached_matmul_peak(path: Path | None = None, dtype=jnp.float32, at_least: float = 0.0) -> float:
    """The best matmul peak measured on this machine, kept in `path` (peak_cache_path()) under
    machine_key(dtype): until MEASUREMENTS runs have measured it, measure_matmul_peak now, and the
    kept peak is the best so far; after that the kept one, unmeasured. The kept peak only rises: a
    measurement below it (the machine was busy) leaves it, a higher one replaces it, and so does
    `at_least` > 0 (a throughput a run reached: the peak is never below it, measured again). An
    unreadable file is rewritten. Returns the kept peak."""
    path = Path(path or peak_cache_path())
    key = machine_key(dtype)
    try:
        peaks = json.loads(path.read_text())
        kept, measured = _kept_peak(peaks.get(key))
    except (OSError, ValueError, AttributeError):  # none yet, or not JSON, or not an object
        peaks, kept, measured = {}, None, 0
    if kept is not None and measured >= MEASUREMENTS and at_least <= kept:
        return kept
    best = max(measure_matmul_peak(dtype), kept or 0.0, at_least)
    peaks[key] = {"peak": best, "measurements": measured + 1}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(peaks, indent=1))
        partial.replace(path)  # whole or not at all, however many processes write it
    except OSError:  # a read-only home: measured again next time, nothing worse
        pass
    return best


def _kept_peak(entry) -> tuple[float | None, int]:
    """(the kept peak, how many runs measured it) of a peaks file's entry: {"peak", "measurements"},
    or a bare number (as jaxgpt kept it before: one measurement); (None, 0) for anything else."""
    if isinstance(entry, (int, float)) and not isinstance(entry, bool) and entry > 0:
        return float(entry), 1
    if isinstance(entry, dict) and isinstance(entry.get("peak"), (int, float)) and entry["peak"] > 0:
        count = entry.get("measurements")
        return float(entry["peak"]), count if isinstance(count, int) and count > 0 else 1
    return None, 0


def peak_flops(configured: float | None, cache: Path | None = None) -> float | None:
    """The peak FLOP/s for MFU: train.peak_flops (per device; on a CPU, whose devices share its
    cores, per host) times the devices or hosts; on a CPU with none configured, the best
    measured on this machine (cached_matmul_peak, kept in `cache`)."""
    if configured:
        return float(configured) * _peak_units()[0]
    return cached_matmul_peak(cache) if jax.default_backend() == "cpu" else None


def _peak_units() -> tuple[int, str]:
    """(how many, what) train.peak_flops is given for: a CPU's hosts (its devices share the cores), else devices."""
    if jax.default_backend() == "cpu":
        return jax.process_count(), "host"
    return jax.device_count(), "device"


def peak_line(peak: float | None, configured: float | None, cache: Path | None = None) -> str:
    """What the MFU is measured against (peak_flops(configured, cache) is `peak`), for a run's first line."""
    if not peak:
        return "MFU not reported (set train.peak_flops)"
    if configured:
        count, unit = _peak_units()
        return f"MFU against a peak of {peak / 1e9:.0f} GFLOP/s (train.peak_flops={configured:g} a {unit} × {count})"
    return (f"MFU against a peak of {peak / 1e9:.0f} GFLOP/s measured on this CPU (the best of its float32 matmuls so "
            f"far, cached in {Path(cache or peak_cache_path())})")


class Meter:
    """Step metrics on their way from the devices to a record.

    `add` keeps each step's metrics on the device and starts their copy to the host (and
    waits for the step IN_FLIGHT steps back, never letting the host run further ahead);
    `fetch` brings the pending ones over, up to a given step, so the loop can read step n's
    metrics after it has dispatched step n + 1 and the devices never wait for the host;
    `record` averages the losses fetched since the last record and adds throughput and MFU
    over that interval, which ends when its last step's metrics arrived; `restart_clock`
    leaves evaluation and saving out of the next interval's time. `tokens_before(step)`: the
    tokens of the steps before `step` (None: step · tokens_per_step; a batch-size schedule's)."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak: float | None, measured: bool = False,
                 tokens_before=None):
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak
        self.tokens_before = tokens_before or (lambda step: step * tokens_per_step)
        self.measured = measured  # the peak is the machine's measured one (cached_matmul_peak), not configured
        self.pending: list[tuple[int, Any]] = []
        self.losses: list[float] = []
        self.last = {"loss": math.nan, "grad_norm": math.nan, "lr": math.nan}
        self.run_start = self.interval_start = self.fetched_at = time.perf_counter()

    def add(self, step: int, metrics: dict[str, jax.Array]) -> None:
        for value in metrics.values():
            value.copy_to_host_async()
        self.pending.append((step, metrics))
        if len(self.pending) > IN_FLIGHT:
            jax.block_until_ready(self.pending[-IN_FLIGHT - 1][1])

    def fetch(self, through: int | None = None) -> list[tuple[int, dict[str, float]]]:
        """The pending steps' metrics up to step `through` (all when None) as floats, in step
        order; waits for those steps, not for later ones."""
        count = sum(1 for step, _ in self.pending if through is None or step <= through)
        due, self.pending = self.pending[:count], self.pending[count:]
        values = jax.device_get([m for _, m in due])
        self.fetched_at = time.perf_counter()
        fetched = [(step, {k: float(v) for k, v in m.items()}) for (step, _), m in zip(due, values, strict=True)]
        for _, m in fetched:
            self.losses.append(m["loss"])
            self.last.update(m)
        return fetched

    def record(self, step: int) -> dict[str, Any]:
        """The record of the interval that ends at `step` (fetch through it first); the next
        interval starts where this one ended."""
        seconds = max(self.fetched_at - self.interval_start, 1e-9)
        tokens_per_sec = (self.tokens_before(step) - self.tokens_before(step - len(self.losses))) / seconds
        if self.measured and self.peak and self.flops_per_token * tokens_per_sec > self.peak:
            # training outran the measured peak, which a busy machine measured too low: measured
            # again, and never below what training reached; the time that takes is not training
            self.peak = cached_matmul_peak(at_least=self.flops_per_token * tokens_per_sec)
            self.fetched_at = time.perf_counter()
        record = {
            "step": step,
            "train_loss": sum(self.losses) / max(len(self.losses), 1),
            "lr": self.last["lr"],
            "grad_norm": self.last["grad_norm"],
            "tokens_per_sec": tokens_per_sec,
            "mfu": self.flops_per_token * tokens_per_sec / self.peak if self.peak else None,
            "peak_flops": self.peak,
            "elapsed": self.fetched_at - self.run_start,
            "tokens_seen": self.tokens_before(step),
        }
        self.losses, self.interval_start = [], self.fetched_at
        return record

    def restart_clock(self) -> None:
        """Start the next interval now: what happened since the last fetch is not training."""
        self.interval_start = time.perf_counter()


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

    def write(self, record: dict, progress: bool = False) -> None:
        """Append the record to metrics.jsonl and TensorBoard; with `progress`, also move the
        bar to its step and show it there."""
        if not self.enabled:
            return
        if progress:
            self.progress(record)
        self.file.write((json.dumps(record) + "\n").encode())  # one write of a whole line
        self.file.flush()
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, record["step"])

    def progress(self, record: dict) -> None:
        """Move the bar to the record's step and show its loss, lr, tokens/s and MFU."""
        self.bar.update(record["step"] - self.bar.n)
        fields = {"loss": f"{record['train_loss']:.4f}", "lr": f"{record['lr']:.2e}",
                  "tok_s": f"{record['tokens_per_sec']:,.0f}"}
        if record["mfu"] is not None:
            fields["mfu"] = f"{record['mfu']:.1%}"
        for key, short in (("eval_seconds", "eval_s"), ("checkpoint_seconds", "ckpt_s")):
            if key in record:
                fields[short] = f"{record[key]:.2f}"
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
