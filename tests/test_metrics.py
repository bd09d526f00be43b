"""metrics.jsonl: readers skip a damaged line with one warning naming the file and line; the
writer only appends whole lines, even after a write that was cut short. The matmul peak kept
per machine only rises; the meter reads only the steps asked for."""

import json
from pathlib import Path

import pytest

from jaxgpt.metrics import MetricsLog, current_records, read_metrics


def test_a_damaged_line_is_skipped_with_one_warning_naming_file_and_line(tmp_path):
    lines = [json.dumps({"step": 1, "train_loss": 2.0}), "{not json", json.dumps({"step": 2, "train_loss": 1.5}),
             json.dumps([1, 2]), json.dumps({"step": 3, "train_loss": 1.0})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.warns(UserWarning, match=r"metrics.jsonl:2 and 1 more: not a metrics record; skipped") as caught:
        records = read_metrics(tmp_path)
    assert len(caught) == 1
    assert [r["step"] for r in records] == [1, 2, 3]


def test_the_writer_ends_a_torn_line_before_appending(tmp_path):
    torn = '{"step": 2, "train_lo'  # the process was killed while writing this line
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n" + torn)
    log = MetricsLog(tmp_path, total_steps=3, start_step=2)
    log.write({"step": 3, "train_loss": 1.0})
    log.close()
    with pytest.warns(UserWarning, match=r"metrics.jsonl:2: not a metrics record"):
        records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 3]


def test_a_resumed_run_replaces_the_records_it_redid():
    records = [{"step": s} for s in (1, 2, 3, 4, 3, 4, 5)]
    assert [r["step"] for r in current_records(records)] == [1, 2, 3, 4, 5]


def test_the_kept_peak_only_rises_whatever_a_busy_moment_measures(tmp_path, monkeypatch):
    """A main job measured 36 GFLOP/s on a loaded machine whose quiet peak was 104, and its MFU read
    75–95%: the first MEASUREMENTS runs measure, and the peak kept per machine and dtype is the best
    of them; after that the kept peak is used unmeasured (a run's start-up pays no measurement)."""
    import jax.numpy as jnp

    from jaxgpt import metrics

    assert metrics.MEASUREMENTS == 3
    measures = {"float32": iter([3.6e10, 1.04e11, 2e10]), "bfloat16": iter([2e11])}
    taken = []
    monkeypatch.setattr(metrics, "measure_matmul_peak",
                        lambda dtype=jnp.float32: taken.append(1) or next(measures[jnp.dtype(dtype).name]))
    path = tmp_path / "cache" / "peak_flops.json"
    kept = [metrics.cached_matmul_peak(path) for _ in range(5)]
    assert kept == [3.6e10, 1.04e11, 1.04e11, 1.04e11, 1.04e11]  # never below the best measured so far
    assert len(taken) == 3  # three runs measured it; the next ones read it
    assert json.loads(path.read_text())[metrics.machine_key()] == {"peak": 1.04e11, "measurements": 3}
    assert metrics.cached_matmul_peak(path, jnp.bfloat16) == 2e11  # each dtype its own
    assert set(json.loads(path.read_text())) == {metrics.machine_key(), metrics.machine_key(jnp.bfloat16)}
    path.write_text(json.dumps({metrics.machine_key(): 5e10}))  # as an earlier jaxgpt kept it: one measurement
    monkeypatch.setitem(measures, "float32", iter([4e10]))
    assert metrics.cached_matmul_peak(path) == 5e10
    assert json.loads(path.read_text())[metrics.machine_key()] == {"peak": 5e10, "measurements": 2}
    path.write_text("{damaged")
    monkeypatch.setitem(measures, "float32", iter([3e10]))
    assert metrics.cached_matmul_peak(path) == 3e10  # measured, and kept
    assert json.loads(path.read_text()) == {metrics.machine_key(): {"peak": 3e10, "measurements": 1}}
    assert metrics.peak_cache_path({"XDG_CACHE_HOME": "/x"}) == Path("/x/jaxgpt/peak_flops.json")


def test_a_measured_peak_is_the_best_of_its_timings(monkeypatch):
    """measure_matmul_peak's timings (matmul_rate's, injected) in any order give their maximum:
    one slow timing, while other work took the cores, does not lower the peak."""
    import itertools

    from jaxgpt import metrics

    rates = [3e10, 9.5e10, 1.2e10, 7e10]
    for order in itertools.permutations(rates):
        timings = iter(order)
        monkeypatch.setattr(metrics, "matmul_rate", lambda matmul, a, seconds, t=timings: next(t))
        assert metrics.measure_matmul_peak(n=8, trials=len(rates)) == max(rates)
    monkeypatch.undo()
    assert metrics.measure_matmul_peak(n=64, seconds=0.02, trials=2) > 0  # the real timing, briefly


def test_the_run_says_which_peak_its_mfu_is_against(tmp_path):
    """The run's first line names the peak and where it comes from: the CPU's best measured matmul
    and the file it is kept in, or train.peak_flops; each record carries the peak its MFU used."""
    from jaxgpt import metrics

    cache = tmp_path / "peak_flops.json"
    assert metrics.peak_line(1.04e11, None, cache) == (
        f"MFU against a peak of 104 GFLOP/s measured on this CPU (the best of its float32 matmuls so far, cached in "
        f"{cache})")
    assert metrics.peak_line(2e9, 2e9) == "MFU against a peak of 2 GFLOP/s (train.peak_flops=2e+09 a host × 1)"
    assert metrics.peak_line(None, None) == "MFU not reported (set train.peak_flops)"
    meter = metrics.Meter(tokens_per_step=1000, flops_per_token=1e6, peak=4e11)
    meter.fetched_at, meter.losses = meter.interval_start + 0.01, [1.0]
    record = meter.record(1)
    assert record["peak_flops"] == 4e11 and record["mfu"] == pytest.approx(1e11 / record["peak_flops"], rel=1e-6)


def test_a_measured_peak_that_training_outruns_is_measured_again_and_never_left_below_it(tmp_path, monkeypatch):
    """A peak kept from a busy moment (52 GFLOP/s while packages installed) gave MFU 108%: when
    training reaches more, the peak is measured again, kept as the larger of the new measure and
    what training reached, and MFU stays ≤ 100%."""
    from jaxgpt import metrics

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measures = iter([5e10, 1.4e11, 1.5e11])
    monkeypatch.setattr(metrics, "measure_matmul_peak", lambda dtype=None: next(measures))
    assert metrics.cached_matmul_peak() == 5e10  # measured while busy, and kept
    meter = metrics.Meter(tokens_per_step=1000, flops_per_token=1e6, peak=5e10, measured=True)
    meter.fetched_at = meter.interval_start + 0.01  # one step of 1000 tokens in 10 ms: 1e11 FLOP/s reached
    meter.losses = [1.0]
    record = meter.record(1)
    assert meter.peak == 1.4e11 and record["mfu"] == pytest.approx(1e11 / 1.4e11, rel=1e-6)
    assert json.loads(metrics.peak_cache_path().read_text()) == {metrics.machine_key(): {"peak": 1.4e11,
                                                                           "measurements": 2}}
    # a measure still below what training reached: the peak is at least that
    assert metrics.cached_matmul_peak(at_least=2e11) == 2e11
    configured = metrics.Meter(tokens_per_step=1000, flops_per_token=1e6, peak=5e10)  # train.peak_flops: as given
    configured.fetched_at, configured.losses = configured.interval_start + 0.01, [1.0]
    assert configured.record(1)["mfu"] == pytest.approx(2.0, rel=1e-6) and configured.peak == 5e10


def test_the_meter_reads_the_steps_asked_for_and_times_intervals_between_fetches():
    import jax.numpy as jnp

    from jaxgpt.metrics import Meter

    meter = Meter(tokens_per_step=100, flops_per_token=1.0, peak=None)
    for step in (1, 2, 3):
        meter.add(step, {"loss": jnp.float32(step), "grad_norm": jnp.float32(1), "lr": jnp.float32(0.1)})
    assert [s for s, _ in meter.fetch(through=2)] == [1, 2]
    assert [s for s, _ in meter.pending] == [3]  # step 3 is still on its way
    first = meter.record(2)
    assert first["train_loss"] == 1.5 and first["elapsed"] == pytest.approx(meter.fetched_at - meter.run_start)
    meter.interval_start = meter.fetched_at - 2.0  # as if the last fetch came 2 s after the one before
    assert [s for s, _ in meter.fetch()] == [3]
    second = meter.record(3)
    assert second["train_loss"] == 3.0 and second["tokens_per_sec"] == pytest.approx(100 / 2.0, rel=0.05)
