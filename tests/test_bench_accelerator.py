"""bench/bench_accelerator.py runs end to end at its toy size on a CPU (a smoke test: its numbers
are for an accelerator); every measure it prints is a finite positive number."""

import math

from scripts import load_script


def test_accelerator_bench_runs_at_toy_size(capsys):
    rows = load_script("bench/bench_accelerator.py").main(["--toy", "--steps", "1", "--new", "4"])
    values = {name: float(value.replace(",", "").rstrip("%")) for name, value in rows}
    assert set(values) >= {"train step compile (s)", "train tokens/s", "MFU", "peak memory (GiB)",
                           "sampling tokens/s, batch 1", "sampling tokens/s, batch 32"}
    assert all(math.isfinite(v) and v > 0 for v in values.values()), values
    assert "toy model" in capsys.readouterr().out
