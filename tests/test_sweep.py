"""A sweep: the cells of a grid are ordinary runs, every cell is checked before the first trains,
the summary has a row per cell trained as asked (and names the others), a rerun skips the cells
finished with the same config, another sweep into the same directory is refused with its summary
kept, and bad grids, ablations and targets are refused in one line with nothing trained."""

import csv
import json
import shutil

import pytest
from test_run import ROOT, write_corpus

from jaxgpt.sweep import main
from jaxgpt.sweep.summary import to_target

TINY = ["--config.model.n_layer=1", "--config.model.n_head=2", "--config.model.d_model=16",
        "--config.model.block_size=16", "--config.train.steps=2", "--config.train.eval_every=2",
        "--config.train.ckpt_every=2", "--config.train.warmup_steps=1", "--config.train.batch_size=4",
        "--config.train.eval_batch_size=4", "--config.train.eval_max_batches=1", "--config.train.log_every=1",
        "--config.train.peak_flops=1e9", "--config.mesh.cpu_devices=0"]
NORMS = ["--grid", "model.norm_position=pre,post", "--grid", "model.parallel_block=False,True"]
TRAINED = ["norm_position=pre,parallel_block=False,seed=0", "norm_position=pre,parallel_block=True,seed=0",
           "norm_position=post,parallel_block=False,seed=0"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The config arguments of a tiny sweep on a small corpus (no --grid, no --out)."""
    where = tmp_path_factory.mktemp("sweep")
    corpus = write_corpus(where / "corpus.txt")
    return [f"--config={ROOT / 'configs' / 'experiment.py'}", *TINY, f"--config.data.source={corpus}",
            f"--config.data.cache_dir={where / 'cache'}"]


@pytest.fixture(scope="module")
def finished(base, tmp_path_factory):
    """A finished sweep of the norm grid (one combination of which the config refuses)."""
    out = tmp_path_factory.mktemp("finished") / "sweep"
    assert main([*base, *NORMS, "--out", str(out)]) == 0
    return out


def summary_rows(out):
    with open(out / "summary.csv") as file:
        return list(csv.DictReader(file))


def test_a_sweep_writes_its_summary_and_resumes_without_redoing_cells(base, finished, capsys):
    rows = summary_rows(finished)
    assert [r["cell"] for r in rows] == TRAINED
    assert all(float(r["final_val_loss"]) > 0 and r["steps"] == "2" for r in rows)
    summary = (finished / "summary.md").read_text().splitlines()
    assert len(summary) == 2 + 3 + 3 and "| norm_position=post,parallel_block=False | 1 |" in summary[4]
    assert summary[-2:] == ["Not in this table:", "- norm_position=post,parallel_block=True,seed=0: refused by "
                            "the config: " + summary[-1].split("refused by the config: ")[1]]
    assert "GPTConfig.parallel_block=True" in summary[-1]
    assert (finished / "val_loss.png").stat().st_size > 1000
    metrics = {c: (finished / c / "metrics.jsonl").read_text() for c in TRAINED}

    capsys.readouterr()
    assert main([*base, *NORMS, "--out", str(finished)]) == 0  # again: nothing is trained twice
    err = capsys.readouterr().err
    assert err.count("skipped (finished)") == 3
    assert "[left out] norm_position=post,parallel_block=True,seed=0: refused by the config" in err
    assert metrics == {c: (finished / c / "metrics.jsonl").read_text() for c in metrics}


def summaries(out):
    return {name: (out / name).read_bytes() for name in ("summary.md", "summary.csv", "val_loss.png")}


@pytest.mark.parametrize("args, why", [
    (["--config.model.d_model=32"], f"its cell {min(TRAINED)} was trained with other settings: model.d_model: 16 → 32, "
                                    "trained → asked"),
    (["--grid", "model.positions=learned,rope"], f"its cell {min(TRAINED)} is not one of this sweep's"),
])
def test_another_sweep_into_a_finished_sweeps_directory_is_refused_and_its_summary_kept(
        base, finished, tmp_path, capsys, args, why):
    out = tmp_path / "moved"  # a copy: the sweep's directory may be moved
    shutil.copytree(finished, out)
    kept = summaries(out), {c: (out / c / "metrics.jsonl").read_text() for c in TRAINED}
    capsys.readouterr()
    grid = [] if "--grid" in args else NORMS
    assert main([*base, *grid, "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err == (f"jaxgpt.sweep: error: --out {out} holds another sweep ({why}): choose another --out, or give the "
                   "settings it was run with to continue it; nothing was trained\n")
    assert kept == (summaries(out), {c: (out / c / "metrics.jsonl").read_text() for c in TRAINED})


def test_a_target_no_cell_reaches_keeps_its_columns_and_says_not_reached(base, finished, tmp_path, capsys):
    out = tmp_path / "again"
    shutil.copytree(finished, out)
    assert main([*base, *NORMS, "--target_loss", "0.001", "--out", str(out)]) == 0  # the same sweep: nothing trains
    assert capsys.readouterr().err.count("skipped (finished)") == 3
    table = (out / "summary.md").read_text().splitlines()[:5]
    assert table[0].endswith("| params | steps to target | seconds to target |") and table[1].count("---") == 9
    assert all(line.endswith("| not reached | not reached |") for line in table[2:])
    assert [(r["steps_to_target"], r["seconds_to_target"]) for r in summary_rows(out)] == [("", "")] * 3


def test_a_grid_value_init_from_would_replace_is_refused_before_any_cell_trains(base, finished, tmp_path, capsys):
    source = finished / TRAINED[0]  # a run without biases
    out = tmp_path / "tuned"
    assert main([*base, f"--config.init_from={source}", "--grid", "model.bias=False,True", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxgpt.sweep: error: --grid model.bias=True is refused in every "
                                                   f"cell (init_from={source} fixes what you set: model.bias=True")
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--grid", "model.positions=learned,rop"], "--grid model.positions=rop is refused in every cell "
                                                "(GPTConfig.positions"),
    (["--grid", "model.positions=rop,rpe"], "every cell of the sweep is refused, so nothing was trained; "
                                            "positions=rop,seed=0: GPTConfig.positions"),
    (["--grid", "model.positions=rope,rope"], "--grid model.positions=rope,rope: 'rope' is listed twice, which would "
                                              "train one run and count it twice: list each value once"),
    (["--grid", "model.positions=rope", "--grid", "model.positions=alibi"],
     "--grid model.positions is given twice: put all its values in one --grid model.positions=V1,V2,…"),
    (["--grid", "model.bias=False,false"], "cells bias=False,seed=0 and bias=false,seed=0 are the same run"),
    (["--grid", "model.bias=False,True", "--config.model.bias=True"],
     "model.bias is both swept (--grid) and set (--config.model.bias=…): keep one of them"),
    (["--grid", "model.bias=False,True", "--seeds", "0,0"], "--seeds 0,0: 0 is listed twice"),
    (["--grid", "train.seed=1,2"], "--grid train.seed: the sweep sets train.seed itself; use --seeds"),
    (["--ablate", "nobias"], "--ablate 'nobias': write NAME:KEY=VALUE[,KEY=VALUE…]"),
    (["--ablate", "all:model.bias=False"], "--ablate all: the name is taken by the baseline"),
    (["--ablate", "x:model.qk_norm=False,model.qk_norm=True"], "--ablate x sets model.qk_norm twice"),
    (["--ablate", "a:train.seed=3"], "--ablate a changes train.seed, which the sweep or the command line sets"),
    (["--ablate", "a:model.bias=False", "--grid", "model.bias=False,True"], "give --grid KEY=V1,V2,… (a product"),
    (["--grid", "model.qk_norm=False,Ture"], "--grid model.qk_norm=Ture is refused in every cell (model.qk_norm takes "
                                             "True or False, not 'Ture'): correct or drop the value"),
    (["--ablate", "untie:train.untie_at=0.67"],
     "--ablate untie: train.untie_at=0.67 is refused (train.untie_at=0.67 unties the embedding and the unembedding, "
     "but model.tie_embeddings=True"),
    (["--ablate", "a:model.nonexist=3"], "--ablate a: model.nonexist=3 is refused (no key 'model.nonexist'): correct "
                                         "it, or drop this --ablate; nothing was trained"),
    (["--ablate", "b:model.bias=True,model.qk_norm=Ture"],
     "--ablate b: model.qk_norm=Ture is refused (model.qk_norm takes True or False, not 'Ture'): correct it, or drop "
     "this --ablate; nothing was trained"),
    (["--ablate", "c:model.norm_position=post,model.parallel_block=True"],
     "--ablate c: model.norm_position=post,model.parallel_block=True is refused (GPTConfig.parallel_block=True"),
    (["--config.model.norm_position=post", "--config.model.parallel_block=True", "--ablate",
      "bias:model.bias=True"], "the config as it is (the cell all, which each ablation is measured against) "
                                      "is refused (GPTConfig.parallel_block=True"),
    (["--ablate", "d:model.bias=False"], "--ablate d: d,seed=0 is the same run as all,seed=0 (the config has its "
                                         "values already): give each --ablate a change of its own"),
    (["--grid", "model.bias=False,True", "--target_loss", "nan"],
     "--target_loss nan: a target loss must be a finite positive number"),
    (["--ablate", "b:model.bias=True", "--target_loss", "-3"],
     "--target_loss -3: a target loss must be a finite positive number"),
    (["--grid", "model.bias=False,True", "--out", "{file}"],
     "cannot write in {file} (a file, not a directory): choose another --out"),
])
def test_a_bad_grid_is_refused_in_one_line_with_nothing_trained(base, tmp_path, capsys, args, message):
    (tmp_path / "file").write_text("mine")
    args = [arg.format(file=tmp_path / "file") for arg in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "sweep")]
    assert main([*base, *args, *out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"jaxgpt.sweep: error: {message.format(file=tmp_path / 'file')}")
    assert not (tmp_path / "sweep").exists() and (tmp_path / "file").read_text() == "mine"


def test_an_ablation_trains_the_config_and_each_change_alone_and_times_the_target(base, tmp_path):
    out = tmp_path / "ablation"
    assert main([*base, "--ablate", "post:model.norm_position=post", "--ablate",
                 "rope:model.positions=rope,model.bias=False", "--target_loss", "100", "--out", str(out)]) == 0
    rows = summary_rows(out)
    assert [r["cell"] for r in rows] == ["all,seed=0", "post,seed=0", "rope,seed=0"]
    models = {r["cell"]: json.loads((out / r["cell"] / "config.json").read_text())["model"] for r in rows}
    baseline = models["all,seed=0"]
    assert (baseline["norm_position"], baseline["positions"]) == ("pre", "learned")
    assert models["post,seed=0"] == {**baseline, "norm_position": "post"}
    assert models["rope,seed=0"] == {**baseline, "positions": "rope", "bias": False}
    assert all(r["steps_to_target"] == "2" and float(r["seconds_to_target"]) > 0 for r in rows)  # every loss ≤ 100
    assert "| all | 1 |" in (out / "summary.md").read_text()


def test_time_to_target_adds_the_intervals_training_seconds_worked_example():
    records = [{"step": 10, "tokens_seen": 100, "tokens_per_sec": 50.0},
               {"step": 20, "tokens_seen": 200, "tokens_per_sec": 100.0, "val_loss": 2.6},
               {"step": 30, "tokens_seen": 300, "tokens_per_sec": 25.0, "val_loss": 2.4}]
    assert to_target(records, 2.5) == (30, 2.0 + 1.0 + 4.0)
    assert to_target(records, 2.6) == (20, 3.0)
    assert to_target(records, 1.0) == (None, None) and to_target(records, None) == (None, None)


def test_an_ablation_value_may_hold_commas_inside_brackets():
    """A tuple value (a batch schedule, value-embedding tables) keeps its commas; the settings
    split at the commas outside brackets only."""
    from jaxgpt.sweep import ablations_of

    ablations = ablations_of(["sched:train.batch_schedule=((60,16),(240,32)),train.lr=0.01",
                              "tables:model.value_embeds=[(0,-1)],model.smear=False", "none:model.value_embeds=()"])
    assert ablations["sched"] == {"train.batch_schedule": "((60,16),(240,32))", "train.lr": "0.01"}
    assert ablations["tables"] == {"model.value_embeds": "[(0,-1)]", "model.smear": "False"}
    assert ablations["none"] == {"model.value_embeds": "()"}


@pytest.mark.parametrize("written", ["3.4445,-4.775,2.0315;3.0,-3.2,1.2", "((3.4445,-4.775,2.0315),(3.0,-3.2,1.2))",
                                     "[[3.4445,-4.775,2.0315],[3.0,-3.2,1.2]]"])
def test_a_muon_coeffs_table_is_one_ablation_value_in_either_form(written):
    """train.muon_coeffs rows, 'a,b,c;a,b,c' (its commas continue the value) or in brackets, are one value of
    one key, and the optimizer reads the same two rows from each form."""
    from jaxgpt.optim import ns_coefficients
    from jaxgpt.sweep import ablations_of

    setting = ablations_of([f"pe:train.muon_coeffs={written},train.muon_ns_steps=2"])["pe"]
    assert setting == {"train.muon_coeffs": written, "train.muon_ns_steps": "2"}
    assert ns_coefficients(setting["train.muon_coeffs"]) == ((3.4445, -4.775, 2.0315), (3.0, -3.2, 1.2))


def test_a_setting_that_reached_the_target_on_some_seeds_keeps_the_tables_columns():
    """One seed of two reached it: its steps and seconds, each cell saying so, in the table's columns."""
    from jaxgpt.sweep.summary import summary_table

    row = dict(final_val_loss=1.9, best_val_loss=1.9, val_bpb=2.7, tokens_per_sec=1000.0, params=10)
    rows = [dict(row, cell="a,seed=0", steps_to_target=140, seconds_to_target=9.0),
            dict(row, cell="a,seed=1", steps_to_target=None, seconds_to_target=None)]
    header, _, line = summary_table(rows, target=1.95)
    assert line.count("|") == header.count("|")
    assert line.endswith("| 140 (1 of 2 seeds) | 9.0 (1 of 2 seeds) |")
