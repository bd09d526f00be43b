"""A sweep: the cells of a grid are ordinary runs, the summary has a row per cell, a rerun skips
the finished cells, and a combination the config refuses is reported and left out."""

import csv

from test_run import ROOT, write_corpus

from jaxgpt.sweep import main

TINY = ["--config.model.n_layer=1", "--config.model.n_head=2", "--config.model.d_model=16",
        "--config.model.block_size=16", "--config.train.steps=2", "--config.train.eval_every=2",
        "--config.train.ckpt_every=2", "--config.train.warmup_steps=1", "--config.train.batch_size=4",
        "--config.train.eval_batch_size=4", "--config.train.eval_max_batches=1", "--config.train.log_every=1",
        "--config.train.peak_flops=1e9", "--config.mesh.cpu_devices=0"]


def test_a_sweep_writes_its_summary_and_resumes_without_redoing_cells(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt")
    args = [f"--config={ROOT / 'configs' / 'experiment.py'}", *TINY,
            f"--config.data.source={corpus}", f"--config.data.cache_dir={tmp_path / 'cache'}",
            "--grid", "model.norm_position=pre,post", "--grid", "model.parallel_block=False,True",
            "--out", str(tmp_path / "sweep")]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "norm_position=post,parallel_block=True,seed=0: invalid: GPTConfig.parallel_block=True" in err
    with open(tmp_path / "sweep" / "summary.csv") as file:
        rows = list(csv.DictReader(file))
    assert [r["cell"] for r in rows] == ["norm_position=pre,parallel_block=False,seed=0",
                                        "norm_position=pre,parallel_block=True,seed=0",
                                        "norm_position=post,parallel_block=False,seed=0"]
    assert all(float(r["final_val_loss"]) > 0 and r["steps"] == "2" for r in rows)
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert summary.count("\n") == 5 and "| norm_position=post,parallel_block=False |" in summary
    assert (tmp_path / "sweep" / "val_loss.png").stat().st_size > 1000
    metrics = {r["cell"]: (tmp_path / "sweep" / r["cell"] / "metrics.jsonl").read_text() for r in rows}

    assert main(args) == 0  # again: nothing is trained twice
    err = capsys.readouterr().err
    assert err.count("skipped (finished)") == 3
    assert metrics == {c: (tmp_path / "sweep" / c / "metrics.jsonl").read_text() for c in metrics}
