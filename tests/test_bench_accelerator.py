"""bench/bench_accelerator.py runs end to end at its toy size on a CPU (a smoke test: its numbers
are for an accelerator): both presets train, with their own optimizers and the loss in chunks,
and sampling runs; every measure is a finite positive number, and the tokens a step are the
rows the micro-batch plan took."""

import math

from scripts import load_script


def test_accelerator_bench_runs_both_presets_at_toy_size(capsys):
    bench = load_script("bench/bench_accelerator.py")
    rows, samples = bench.main(["--toy", "--steps", "1", "--new", "4", "--loss_chunks", "preset"])
    assert [(r["config"], r["loss_chunk"]) for r in rows] == [("gpt2_124m", bench.TOY_CHUNK),
                                                               ("speedrun_gpt2", bench.TOY_CHUNK)]
    for row in rows:
        assert "error" not in row, row
        batch, accum = map(int, row["rows"].split("×"))
        assert batch * accum == bench.TOY_ROWS
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("compile_s", "step_ms", "tokens_per_s", "mfu",
                                                                   "memory_gib")), row
        assert math.isclose(row["tokens_per_s"], bench.TOY_ROWS * bench.TOY["block_size"] / row["step_ms"] * 1e3)
    assert [(s["config"], s["batch"]) for s in samples] == [("gpt2_124m", 1), ("gpt2_124m", 32)]
    assert all(math.isfinite(s["tokens_per_s"]) and s["tokens_per_s"] > 0 for s in samples)
    assert "toy sizes" in capsys.readouterr().out
