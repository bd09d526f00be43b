"""metrics.jsonl: readers skip a damaged line with one warning naming the file and line; the
writer only appends whole lines, even after a write that was cut short."""

import json

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
