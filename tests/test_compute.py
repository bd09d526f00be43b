"""What a model is, apart from how it runs: a run's compute settings (config.compute) change
nothing it computes, so a run directory written with any of them samples here, and a resume may
change any of them (docs/ARCHITECTURE.md, "Two configs")."""

import json

import jax
import numpy as np
import pytest
from runs import tiny_config, trained_run
from test_run import assert_trees_close, corpus, final_params  # noqa: F401  (corpus: the fixture)

from jaxgpt import ComputeConfig
from jaxgpt.decode import sampling
from jaxgpt.train.run import load_run, train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 6-step run of today's code (explicit kernel, float32, per-layer blocks), shared."""
    return trained_run(tmp_path_factory)[0]


def greedy(run_dir, compute=None) -> list[int]:
    params, cfg, _ = load_run(run_dir, compute=compute)
    result = sampling.generate(params, cfg, [[1, 2, 3]], 0, max_new_tokens=8, temperature=0.0, compute=compute)
    return result.new_tokens()[0].tolist()


def rewrite_config(run_dir, edit) -> None:
    path = run_dir / "config.json"
    saved = json.loads(path.read_text())
    edit(saved)
    path.write_text(json.dumps(saved))


@pytest.mark.parametrize("layout", ["compute section", "model section, before the split"])
def test_a_run_trained_with_cudnn_and_bfloat16_samples_on_this_machine(tmp_path, trained, layout):
    """The run directory says it ran with the cudnn kernel in bfloat16 (as on a GPU): its
    params load and sample here with this machine's compute, the same tokens as before."""
    import shutil

    run = tmp_path / "gpu_run"
    shutil.copytree(trained, run)
    want = greedy(trained)

    def as_on_a_gpu(saved):
        gpu = {"kernel": "cudnn", "dtype": "bfloat16", "param_dtype": "float32", "remat": True}
        if layout == "compute section":
            saved["compute"].update(gpu)
        else:  # before the split: the kernel was model.attention, the rest model keys too
            del saved["compute"]
            saved["model"].update(gpu, attention=gpu["kernel"])
            del saved["model"]["kernel"], saved["model"]["window"]

    rewrite_config(run, as_on_a_gpu)
    assert greedy(run) == want
    assert greedy(run, ComputeConfig(kernel="xla")) == want


def test_a_resume_may_change_every_compute_setting(tmp_path, tmp_path_factory, corpus, capsys):  # noqa: F811
    """3 steps as one machine runs them, 3 more with another kernel, remat, the blocks
    stacked: within float tolerance of 6 uninterrupted steps, and the changes are said."""
    train(tiny_config(tmp_path, corpus, "split", **{"train.steps": 3}))
    other = {"compute.kernel": "xla", "compute.remat": True, "compute.scan_layers": True}
    resumed = train(tiny_config(tmp_path, corpus, "split", **other, **{"train.steps": 6}))
    whole_dir, whole = trained_run(tmp_path_factory)  # 6 steps
    assert resumed["step"] == whole["step"] == 6
    assert_trees_close(final_params(tmp_path / "split"), final_params(whole_dir), atol=1e-5)
    assert resumed["val_loss"] == pytest.approx(whole["val_loss"], abs=1e-5)
    err = capsys.readouterr().err
    assert "resuming with other compute settings: kernel 'explicit' → 'xla', remat False → True" in err


def test_params_load_in_the_dtype_and_layout_the_caller_runs(trained):
    params32, _, _ = load_run(trained)
    stacked16, _, _ = load_run(trained, compute=ComputeConfig(param_dtype="bfloat16", scan_layers=True))
    assert "h" in stacked16 and all(leaf.dtype == np.dtype("bfloat16") for leaf in jax.tree.leaves(stacked16))
    np.testing.assert_array_equal(np.asarray(stacked16["h"]["ln_1"]["scale"][0], np.float32),
                                  np.asarray(params32["h_0"]["ln_1"]["scale"]).astype("bfloat16").astype(np.float32))
