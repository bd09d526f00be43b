"""jaxgpt.compile: the train step, eval step and generate compiled ahead of time, their figures
per device, and its one-line errors. Always: 8 CPU devices in a subprocess. With libtpu: TPU
topologies, one host and several, compiled from this one process."""

import json
import math
import os
import subprocess
import sys

import pytest
from processes import ROOT, finished, with_devices

from jaxgpt import compile as ahead

TINY = ["--config.model.vocab_size=256", "--config.model.n_layer=2", "--config.model.n_head=4",
        "--config.model.d_model=64", "--config.model.block_size=64", "--config.model.bias=False",
        "--config.train.batch_size=16", "--config.train.eval_batch_size=16", "--config.train.grad_accum=2",
        "--config.sample.max_new_tokens=4"]

# one report per mesh in a process with 8 CPU devices, as JSON
REPORTS = """
import json, sys
from jaxgpt import compile as ahead
from jaxgpt.cli import parse_config
argv = sys.argv[1:]
out = {}
for name, mesh in (("data", ["--config.mesh.data=8"]), ("fsdp", ["--config.mesh.data=1", "--config.mesh.fsdp=8"])):
    config = parse_config(["compile", *argv, *mesh], ahead.DEFAULT_CONFIG)
    out[name] = ahead.report(config)
print(json.dumps(out))
"""


def expected_param_bytes(fsdp: int) -> int:
    """Float32 parameters per device: the matrices (embeddings and kernels, every dimension here
    divisible by 8) split over fsdp, the LayerNorm scales whole."""
    from jaxgpt.config import GPTConfig
    from jaxgpt.model import param_shapes

    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, block_size=64, bias=False)
    import jax

    shapes = [leaf.shape for leaf in jax.tree.leaves(param_shapes(cfg))]
    return sum(math.prod(s) * 4 // (fsdp if len(s) > 1 else 1) for s in shapes)


@pytest.fixture(scope="module")
def reports():
    return json.loads(finished(with_devices(REPORTS, *TINY, devices=8), timeout=300))


@pytest.mark.parametrize("mesh,fsdp", [("data", 1), ("fsdp", 8)])
def test_state_bytes_per_device(reports, mesh, fsdp):
    report = reports[mesh]
    assert report["devices"] == 8 and report["mesh"][mesh] == 8
    train = report["programs"]["train step"]
    params = expected_param_bytes(fsdp)
    assert train["parameters"] == params
    assert 2 * params <= train["optimizer_state"] <= 2 * params + 64  # AdamW's two moments, and its counts
    assert train["batch"] == 2 * (16 * 2 // 8) * 64 * 4  # (inputs, targets) int32, 32 rows over 8 devices
    assert set(report["programs"]) == {"train step", "eval step", "generate"}
    for figures in report["programs"].values():
        assert figures["total"] > 0 and figures["flops"] > 0 and figures["bytes_accessed"] > 0


def test_data_parallel_all_reduces_the_gradients(reports):
    collectives = reports["data"]["programs"]["train step"]["collectives"]
    assert collectives["all-reduce"]["count"] >= 1
    assert collectives["all-reduce"]["bytes"] >= expected_param_bytes(1)  # at least every gradient once
    fsdp = reports["fsdp"]["programs"]["train step"]["collectives"]
    assert fsdp["all-gather"]["count"] + fsdp["reduce-scatter"]["count"] >= 1  # the sharded weights


def test_table_has_every_figure(reports):
    table = ahead.format_report(reports["data"])
    for label in ("parameters", "optimizer state", "batch", "temporaries", "outputs", "total", "XLA FLOPs",
                  "XLA bytes accessed", *ahead.COLLECTIVES):
        assert label in table


def test_collectives_parse_hlo_lines():
    hlo = """
  %all-reduce.1 = f32[16,1024]{1,0} all-reduce(f32[16,1024]{1,0} %x), replica_groups={}
  %ag = (bf16[8,4]{1,0}, bf16[64,4]{1,0}) all-gather-start(bf16[8,4]{1,0} %y), dimensions={0}
  %agd = bf16[64,4]{1,0} all-gather-done((bf16[8,4]{1,0}, bf16[64,4]{1,0}) %ag)
  ROOT %t = (f32[2]{0}, s32[3]{0}) all-reduce(f32[2]{0} %a, s32[3]{0} %b), to_apply=%sum
"""
    found = ahead.collectives(hlo)
    assert found["all-reduce"] == {"count": 2, "bytes": 16 * 1024 * 4 + 2 * 4 + 3 * 4}
    assert found["all-gather"] == {"count": 1, "bytes": 64 * 4 * 2}
    assert found["reduce-scatter"]["count"] == 0


def run_main(*argv):
    """(exit status, standard error) of `python -m jaxgpt.compile ARGV` with 8 CPU devices."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "jaxgpt.compile", *argv], env=env, capture_output=True, text=True,
                          timeout=300)
    return done.returncode, done.stderr.strip()


def test_unknown_topology_lists_the_known_ones():
    code, err = run_main("--topology=v9:2x2", *TINY)
    assert code == 2 and err.startswith("jaxgpt.compile: unknown topology 'v9:2x2'")
    assert "v5e:{" in err and "2x4" in err and "v5p:{" in err and len(err.splitlines()) == 1


def test_mesh_that_does_not_divide_the_devices():
    code, err = run_main("--config.mesh.data=3", *TINY)
    assert code == 2 and "does not fit 8 devices" in err and len(err.splitlines()) == 1


def test_vocab_size_must_be_given():
    code, err = run_main("--config.model.vocab_size=0")
    assert code == 2 and "model.vocab_size" in err and len(err.splitlines()) == 1


@pytest.mark.skipif(bool(ahead.importlib.util.find_spec("libtpu")), reason="libtpu is installed here")
def test_topology_without_libtpu_says_how_to_install_it():
    code, err = run_main("--topology=v5e:2x2", *TINY)
    assert code == 2 and ahead.INSTALL in err and len(err.splitlines()) == 1


# --- TPU topologies, with libtpu -------------------------------------------------------------


def tpu_report(tmp_path, topology: str, *argv) -> dict:
    pytest.importorskip("libtpu")
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "jaxgpt.compile", f"--topology={topology}", f"--json={out}",
                           *TINY, *argv], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "train step" in done.stdout and "roofline" in done.stdout
    return json.loads(out.read_text())


def test_compiles_for_a_v5e_slice(tmp_path):
    report = tpu_report(tmp_path, "v5e:2x2", "--config.mesh.data=4")
    assert report["chip"] == "v5e" and report["devices"] == 4 and report["processes"] == 1
    train = report["programs"]["train step"]
    assert train["parameters"] == expected_param_bytes(1) and train["fits"] and train["hbm"] == 16 * 2**30
    assert 0 < train["mfu_bound"] < 1 and train["collectives"]["all-reduce"]["count"] >= 1


def test_compiles_for_a_multi_host_v5p_slice(tmp_path):
    report = tpu_report(tmp_path, "v5p:2x2x4", "--config.mesh.data=2", "--config.mesh.fsdp=8")
    assert report["chip"] == "v5p" and report["devices"] == 16 and report["processes"] == 4
    train = report["programs"]["train step"]
    assert train["parameters"] == expected_param_bytes(8) and train["fits"]
