"""jaxgpt.compile: the train step, eval step and generate compiled ahead of time, their figures
per device, its verdict and its one-line errors. Always: 8 CPU devices in a subprocess, and
train.py's compile_only on the machine's own. With libtpu: TPU topologies, one host and several,
compiled from this one process."""

import json
import math
import os
import subprocess
import sys

import jax
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
    for label in ("parameters", "optimizer state", "batch", "other arguments", "outputs", "temporaries",
                  "generated code", "sum of the rows above", "XLA's peak", "XLA FLOPs",
                  "XLA bytes accessed", *ahead.COLLECTIVES):
        assert label in table


MEMORY_PARTS = ("parameters", "optimizer_state", "batch", "other_arguments", "outputs", "temporaries",
                "generated_code")


def test_memory_parts_add_up_and_the_peak_is_a_measure_of_its_own(reports):
    """The rows that are parts sum to the row that is their sum; XLA's peak, beside them, is
    at least the arguments and outputs (live together when the program ends), and on a CPU,
    whose peak leaves the temporaries out, the total that must fit is the sum."""
    for report in reports.values():
        for name, figures in report["programs"].items():
            assert sum(figures[part] for part in MEMORY_PARTS) == figures["sum"], name
            assert figures["other_arguments"] >= 0 and figures["outputs"] >= 0, name
            arguments = sum(figures[part] for part in ("parameters", "optimizer_state", "batch", "other_arguments"))
            assert figures["peak"] >= arguments + figures["outputs"], name
            assert figures["total_from"] == "sum" and figures["total"] == figures["sum"] >= figures["temporaries"]
    table = ahead.format_report(reports["data"]).splitlines()
    assert not any(line.startswith("total") for line in table)
    train = reports["data"]["programs"]["train step"]
    assert next(line for line in table if line.startswith("sum of the rows above")).split()[5:7] == \
        ahead.size(train["sum"]).split()
    assert any(line.startswith("XLA's peak (a CPU's: no temps)") for line in table)


class FakeMemory:
    """XLA's memory analysis of a program as a TPU reports it (v5e:2x2, the tiny model): the
    train step's temporaries counted 0 while its peak counts them, generate's counted more
    than are live at once."""

    def __init__(self, temp: int, peak: int):
        self.argument_size_in_bytes, self.output_size_in_bytes, self.alias_size_in_bytes = 1885184, 1879040, 1876992
        self.temp_size_in_bytes, self.generated_code_size_in_bytes, self.peak_memory_in_bytes = temp, 1900544, peak


class FakeCompiled:
    def __init__(self, memory: FakeMemory):
        self.memory = memory

    def memory_analysis(self):
        return self.memory

    def cost_analysis(self):
        return {"flops": 1e9, "bytes accessed": 1e6}

    def as_text(self):
        return ""


@pytest.mark.parametrize("temp,peak", [(0, 7156224), (1645568, 1470976)])
def test_a_tpu_program_must_fit_its_peak_beside_the_sum_of_its_parts(temp, peak):
    inputs = {"parameters": 476416, "optimizer state": 952840, "batch": 4096}
    program = ahead.Program("train step", FakeCompiled(FakeMemory(temp, peak)), inputs, 2048, 1e9, platform="tpu")
    figures = ahead.figures(program, ahead.CHIPS["v5e"], 4)
    assert figures["other_arguments"] == 1885184 - sum(inputs.values()) and figures["outputs"] == 2048
    assert figures["sum"] == 1885184 + 2048 + temp + 1900544 == sum(figures[part] for part in MEMORY_PARTS)
    assert figures["peak"] == figures["total"] == peak and figures["total_from"] == "peak"
    assert figures["margin"] == 16 * 2**30 - peak
    result = {"where": "v5e:2x2", "devices": 4, "chip": "v5e", "processes": 1, "mesh": {"data": 4},
              "chip_figures": {"hbm": 16 * 2**30, "flops": 0.0}, "programs": {"train step": figures}}
    table = ahead.format_report(result)
    assert "XLA's peak (live at once)" in table and "fits (its peak)" in table and "total" not in table


def test_collectives_parse_hlo_lines():
    hlo = """
  %all-reduce.1 = f32[16,1024]{1,0} all-reduce(f32[16,1024]{1,0} %x), replica_groups={}
  %ag = (bf16[8,4]{1,0}, bf16[64,4]{1,0}) all-gather-start(bf16[8,4]{1,0} %y), dimensions={0}
  %agd = bf16[64,4]{1,0} all-gather-done((bf16[8,4]{1,0}, bf16[64,4]{1,0}) %ag)
  ROOT %t = (f32[2]{0}, s32[3]{0}) all-reduce(f32[2]{0} %a, s32[3]{0} %b), to_apply=%sum
  %cp = (bf16[3,96]{1,0:T(8,128)(2,1)S(1)}, bf16[3,96]{1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}, u32[]{:S(2)}) \
collective-permute-start(%p), channel_id=9, source_target_pairs={{0,1},{1,0}}
  %cpd = bf16[3,96]{1,0:T(8,128)(2,1)S(1)} collective-permute-done(%cp)

%all-reduce-scatter.9.clone (input_0: f32[64,16]) -> (f32[64,16]) {
  %input_0 = f32[64,16]{1,0} parameter(0)
  ROOT %all-reduce.66 = (f32[64,16]{1,0}) all-reduce(%input_0), replica_groups={{0,1,2,3,4,5,6,7}}
}

ENTRY %main (p: f32[64,16]) -> f32[8,16] {
  ROOT %fusion.499 = (f32[8,16]{1,0:T(8,128)S(1)}) fusion(%p), kind=kOutput, calls=%all-reduce-scatter.9.clone
}
"""
    found = ahead.collectives(hlo)
    assert found["all-reduce"] == {"count": 2, "bytes": 16 * 1024 * 4 + 2 * 4 + 3 * 4}
    assert found["all-gather"] == {"count": 1, "bytes": 64 * 4 * 2}
    assert found["collective-permute"] == {"count": 1, "bytes": 3 * 96 * 2}
    assert found["reduce-scatter"] == {"count": 1, "bytes": 8 * 16 * 4}  # the fused one, its inside not counted


def command(*argv, devices: int | None = 8) -> subprocess.CompletedProcess:
    """`python -m jaxgpt.compile ARGV` on the CPU, with `devices` CPU devices forced through
    XLA_FLAGS (None: none forced, the config's mesh.cpu_devices decides)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run([sys.executable, "-m", "jaxgpt.compile", *argv], env=env, capture_output=True, text=True,
                          timeout=300)


def run_main(*argv):
    """(exit status, standard error) of `python -m jaxgpt.compile ARGV` with 8 CPU devices."""
    done = command(*argv)
    return done.returncode, done.stderr.strip()


def test_unknown_topology_lists_the_known_ones():
    code, err = run_main("--topology=v9:2x2", *TINY)
    assert code == 2 and err.startswith("jaxgpt.compile: unknown topology 'v9:2x2'")
    assert "v5e:{" in err and "2x4" in err and "v5p:{" in err and len(err.splitlines()) == 1
    assert "h100:{1|2|4|8|2x8|" in err and "a100:{" in err  # the GPU topologies too (jaxgpt.compile.gpus)


def test_mesh_that_does_not_divide_the_devices():
    code, err = run_main("--config.mesh.data=3", *TINY)
    assert code == 2 and "does not fit 8 devices" in err and len(err.splitlines()) == 1


def test_vocab_size_must_be_given(tmp_path):
    # a cache of its own: the default config's tokenizer, made by any earlier run on this machine, would fix the size
    code, err = run_main("--config.model.vocab_size=0", f"--config.data.cache_dir={tmp_path}")
    assert code == 2 and "model.vocab_size" in err and len(err.splitlines()) == 1


PLANNED = [*TINY[:6], "--config.train.rows_per_step=32", "--config.train.batch_size=0", "--config.train.grad_accum=0",
           "--config.train.eval_batch_size=16", "--config.sample.max_new_tokens=4"]


@pytest.mark.parametrize("limit_gib", [None, 0.001], ids=["ram", "memory_limit"])
def test_compile_only_ends_with_a_verdict_against_the_budget_its_micro_batch_was_chosen_by(tmp_path, limit_gib):
    """train.py --config.compile_only=True on the machine's own CPU devices said what must fit but
    gave no verdict, and its planner's budget was not in the report. The report's last line is the
    verdict, against the budget micro_batch.budget gives these devices (the RAM's share, or
    train.memory_limit_gib's), which the planner's line names too; what does not fit exits 2."""
    from test_user_commands import run

    from jaxgpt.compile.table import size
    from jaxgpt.config import TrainConfig
    from jaxgpt.train.micro_batch import budget

    limit = [f"--config.train.memory_limit_gib={limit_gib}"] if limit_gib else []
    done = run(["python", "train.py", "--config.compile_only=True", *PLANNED, *limit], tmp_path)
    devices = int(done.stdout.split(" local cpu device(s)")[0])
    train = TrainConfig(rows_per_step=32, batch_size=0, grad_accum=0, memory_limit_gib=limit_gib)
    memory, of = budget(jax.devices("cpu")[:1] * devices, train)  # the planner's, for as many CPU devices
    planner = next(line for line in done.stderr.splitlines() if "train.rows_per_step=32:" in line)
    assert planner.startswith("jaxgpt: ") and f" GiB a device ({of})," in planner
    assert f"fit {memory / 2**30:.2f} GiB" in planner or f"fit {memory / 2**30:.1f} GiB" in planner
    verdict = done.stdout.strip().splitlines()[-1]
    against = f"the {size(memory)} a device may use ({of}), the budget the micro-batch is chosen by"
    if limit_gib is None:
        assert done.returncode == 0, done.stderr[-3000:]
        assert verdict.startswith("Verdict: the train step fits, ") and against in verdict, verdict
    else:
        assert done.returncode == 2 and verdict.startswith("Verdict: the train step does NOT fit, "), verdict
        assert against in verdict and f"more than the {size(memory)} of {of}:" in done.stderr


@pytest.mark.parametrize("rows", [2, 8])
def test_the_micro_batch_the_planner_chooses_compiles_to_a_step_that_fits_its_budget(rows, capsys):
    """The planner and the compile agree: with room by the planner's estimates for `rows` rows of 64
    (train.memory_limit_gib), it takes them, and the compiled train step, by XLA's measure of what
    must fit on a CPU (the sum of its parts), fits that same budget."""
    from jaxgpt.cli import parse_config
    from jaxgpt.config import TrainConfig
    from jaxgpt.train import micro_batch, opening

    config = parse_config(["compile", *PLANNED, "--config.model.vocab_size=512", "--config.train.rows_per_step=64",
                           "--config.mesh.cpu_devices=1"], ahead.DEFAULT_CONFIG)
    cfg, compute = ahead.model_of(config), opening.compute_config(config, "cpu")
    state = micro_batch.state_bytes(cfg, compute, TrainConfig.from_mapping(config.train))
    row = micro_batch.row_bytes(cfg, compute) * micro_batch.row_margin("cpu", compute)
    config.train.memory_limit_gib = (state + (rows + 0.5) * row) / 2**30
    report = ahead.report(config, jax.devices()[:1])
    train = report["programs"]["train step"]
    assert train["tokens"] == 64 * 64 and report["budget"]["bytes"] == config.train.memory_limit_gib * 2**30
    assert f"jaxgpt: train.batch_size={rows} ({rows} rows on each of 1 devices)" in capsys.readouterr().err
    assert ahead.print_and_check(report) == 0 and train["fits"] and train["total"] <= report["budget"]["bytes"]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_the_options(flag):
    done = command(flag, "--topology=v9:2x2")
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr[-2000:]
    assert done.stdout.startswith("usage: python -m jaxgpt.compile")
    for option in ("--config=FILE", "--config.KEY=VALUE", "--topology=CHIP:SHAPE", "--chips_per_host=AxB",
                   "--json=PATH", "--option VALUE", "v5e:{", "h100:{", "mesh.cpu_devices"):
        assert option in done.stdout, option


@pytest.mark.parametrize("argv,says", [
    (["--topolgy=v5e:2x4"], "unknown option --topolgy=v5e:2x4 (did you mean --topology?)"),
    (["--config.model.vocab_size=256", "stray"], "unexpected argument 'stray'"),
    (["--json"], "--json needs a value"),
    (["--topology", "--json=out.json"], "--topology needs a value"),
    (["--chips_per_host=2x4"], "--chips_per_host lays out a TPU topology's hosts"),
    (["--topology=h100:8", "--chips_per_host=2x4"], "--chips_per_host lays out a TPU topology's hosts; a GPU"),
])
def test_refuses_what_it_does_not_understand_in_one_line(argv, says):
    code, err = run_main(*argv, *TINY)
    assert code == 2 and err.startswith(f"jaxgpt.compile: {says}") and len(err.splitlines()) == 1, err


def test_space_separated_topology_is_the_topology():
    code, err = run_main("--topology", "v9:2x2", *TINY)
    assert code == 2 and err.startswith("jaxgpt.compile: unknown topology 'v9:2x2'") and len(err.splitlines()) == 1


def test_parse_args_reads_both_forms():
    from jaxgpt.compile.args import parse_args

    options, config_argv = parse_args(["compile", "--topology", "v5e:4x4", "--chips_per_host", "2x4", "--json",
                                       "out.json", "--config", "configs/gpt2_124m.py", "--config.mesh.data", "-1",
                                       "--config.data.cache_dir", "None", "--config.compute.scan_layers",
                                       "--config.model.n_layer=3"])
    assert options == {"topology": "v5e:4x4", "chips_per_host": "2x4", "json": "out.json"}
    assert config_argv == ["compile", "--config=configs/gpt2_124m.py", "--config.mesh.data=-1",
                           "--config.data.cache_dir=None", "--config.compute.scan_layers", "--config.model.n_layer=3"]


def test_local_compile_makes_the_cpu_devices_of_the_config(tmp_path):
    out = tmp_path / "report.json"
    done = command(*TINY, "--config.mesh.cpu_devices=2", f"--json={out}", devices=None)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("2 local cpu device(s): 2 devices")
    report = json.loads(out.read_text())
    assert report["devices"] == 2 and report["mesh"]["data"] == 2


def test_space_separated_config_and_json(tmp_path):
    """Every argument as `--name VALUE`: the config file, its overrides and --json; the
    config's cpu_devices wins over XLA_FLAGS' 8."""
    out = tmp_path / "report.json"
    spaced = [part for arg in TINY for part in arg.split("=", 1)]
    done = command("--config", str(ahead.DEFAULT_CONFIG), *spaced, "--config.mesh.cpu_devices", "2", "--json",
                   str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["devices"] == 2 and report["programs"]["train step"]["parameters"] == expected_param_bytes(1)


@pytest.mark.skipif(bool(ahead.importlib.util.find_spec("libtpu")), reason="libtpu is installed here")
def test_topology_without_libtpu_says_how_to_install_it():
    code, err = run_main("--topology=v5e:2x2", *TINY)
    assert code == 2 and ahead.INSTALL in err and len(err.splitlines()) == 1


# --- TPU topologies, with libtpu -------------------------------------------------------------


def tpu_report(tmp_path, topology: str, *argv) -> dict:
    pytest.importorskip("libtpu")
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "jaxgpt.compile", f"--topology={topology}", f"--json={out}",
                           *TINY, *argv], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "train step" in done.stdout and "roofline" in done.stdout
    # libtpu's start-up complaints kept out of sight; jaxgpt's own line on a larger micro-batch may show
    assert all(line.startswith("jaxgpt.compile: ") for line in done.stderr.splitlines()), done.stderr[-3000:]
    return json.loads(out.read_text()) | {"stderr": done.stderr}


# the train step of one v5e:2x4 slice on three meshes of its 8 chips, the batch the same
MESHES = """
import json, sys
from jaxgpt import compile as ahead
from jaxgpt.cli import parse_config
devices = ahead.topology_devices("v5e:2x4")
out = {}
for name, fsdp in (("data", 1), ("fsdp2", 2), ("fsdp8", 8)):
    config = parse_config(["compile", *sys.argv[1:], f"--config.mesh.data={8 // fsdp}", f"--config.mesh.fsdp={fsdp}"],
                          ahead.DEFAULT_CONFIG)
    mesh, programs = ahead.compile_programs(config, devices)
    out[name] = ahead.figures(programs[0], ahead.CHIPS["v5e"], 8)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def v5e_meshes():
    pytest.importorskip("libtpu")
    return json.loads(finished(with_devices(MESHES, *TINY, devices=1), timeout=600))


def matrix_bytes() -> int:
    """Float32 bytes of the tiny model's matrices (the embeddings and kernels)."""
    return expected_param_bytes(1) - 5 * 64 * 4  # less the five LayerNorm scales (no biases)


def test_data_parallel_all_reduces_whole_gradients_on_a_tpu(v5e_meshes):
    train = v5e_meshes["data"]
    assert train["collectives"]["all-reduce"]["bytes"] >= expected_param_bytes(1)  # every gradient, whole
    assert train["collectives"]["all-gather"]["count"] == train["collectives"]["reduce-scatter"]["count"] == 0


@pytest.mark.parametrize("mesh,fsdp", [("fsdp2", 2), ("fsdp8", 8)])
def test_fsdp_gathers_weights_and_reduce_scatters_gradients_on_a_tpu(v5e_meshes, mesh, fsdp):
    collectives = v5e_meshes[mesh]["collectives"]
    assert collectives["all-gather"]["bytes"] >= matrix_bytes()  # each weight gathered whole where it is used
    assert collectives["reduce-scatter"]["count"] >= 1
    assert v5e_meshes[mesh]["parameters"] == expected_param_bytes(fsdp)


def test_pure_fsdp_reduce_scatters_the_blocks_gradients_and_all_reduces_no_whole_gradient(v5e_meshes):
    collectives = v5e_meshes["fsdp8"]["collectives"]
    blocks = matrix_bytes() - (256 + 64) * 64 * 4  # the blocks' matrices: all but the token and position tables
    assert collectives["reduce-scatter"]["bytes"] >= blocks // 8  # each device keeps its shard of their gradients
    assert collectives["all-reduce"]["bytes"] < expected_param_bytes(1) // 8 + 64 * 64 * 4  # shards, the table's


def test_fsdp_shrinks_memory_per_device_as_it_grows(v5e_meshes):
    totals = [v5e_meshes[mesh]["total"] for mesh in ("data", "fsdp2", "fsdp8")]
    assert totals[0] > totals[1] > totals[2]
    flops = [v5e_meshes[mesh]["flops"] for mesh in ("data", "fsdp2", "fsdp8")]
    assert flops[0] >= flops[1] >= flops[2]  # no extra work: the same model, the update on fewer weights each


def test_compiles_for_a_v5e_slice(tmp_path):
    report = tpu_report(tmp_path, "v5e:2x2", "--config.mesh.data=4")
    assert report["chip"] == "v5e" and report["devices"] == 4 and report["processes"] == 1
    train = report["programs"]["train step"]
    assert train["parameters"] == expected_param_bytes(1) and train["fits"] and train["hbm"] == 16 * 2**30
    assert 0 < train["mfu_bound"] < 1 and train["collectives"]["all-reduce"]["count"] >= 1
    # 16 rows in 2 micro-batches of a tiny model on 16 GiB chips: the whole batch in one would fit
    assert "rows per device would fit too" in report["stderr"] and "--config.train.grad_accum=1" in report["stderr"]


def test_compiles_for_a_multi_host_v5p_slice(tmp_path):
    report = tpu_report(tmp_path, "v5p:2x2x4", "--config.mesh.data=2", "--config.mesh.fsdp=8")
    assert report["chip"] == "v5p" and report["devices"] == 16 and report["processes"] == 4
    train = report["programs"]["train step"]
    assert train["parameters"] == expected_param_bytes(8) and train["fits"]


def test_a_vocabulary_left_to_the_tokenizer_is_read_from_one_that_exists(tmp_path):
    """compile_only on a char config: the vocabulary comes from the prepared token cache (or a
    run's tokenizer.json), and without either the message says to prepare the data first."""
    from runs import tiny_config, write_corpus

    from jaxgpt import data, tokenizers

    config = tiny_config(tmp_path, write_corpus(tmp_path / "corpus.txt"))
    config.model.vocab_size = 0
    with pytest.raises(ValueError, match=r"no tokenizer of this config exists yet: prepare the data first "
                                         r"\(python -m jaxgpt.data with the same --config\)"):
        ahead.model_of(config)
    corpus = data.prepare(config.data)
    assert ahead.model_of(config).vocab_size == corpus.tokenizer.vocab_size
    pinned = tokenizers.CharTokenizer.train("xyz")
    (tmp_path / "run").mkdir()
    pinned.save(tmp_path / "run" / "tokenizer.json")  # a run's own tokenizer comes first
    assert ahead.model_of(config).vocab_size == pinned.vocab_size != corpus.tokenizer.vocab_size


COUNTED = TINY[1:-4] + ["--config.model.vocab_size=512", "--config.model.block_size=32",
                         "--config.train.optimizer=muon", "--config.mesh.data=1", "--config.mesh.cpu_devices=1",
                         "--config.train.eval_batch_size=16"]


@pytest.fixture(scope="module")
def counted():
    """XLA's counts of the tiny model's train and eval steps, with what it leaves out of their loops added back
    (jaxgpt.compile.counts): 16 rows at once, and 8 rows twice (grad_accum) with the loss 32 tokens at a time (8
    chunks a micro-batch)."""
    from jaxgpt.cli import parse_config

    steps = {"whole": ["--config.train.batch_size=16", "--config.train.grad_accum=1"],
             "looped": ["--config.train.batch_size=8", "--config.train.grad_accum=2", "--config.compute.loss_chunk=32"]}
    out = {}
    for name, argv in steps.items():
        config = parse_config(["compile", *COUNTED, *argv], ahead.DEFAULT_CONFIG)
        out[name] = {p.name: (ahead.figures(p, None, 1), p) for p in ahead.compile_programs(config, generate=False)[1]}
    return out


def test_a_steps_counts_hold_every_micro_batch_and_chunk_and_the_update_once(counted):
    """The same tokens make the same FLOPs and about the same bytes, however the step loops over them: XLA counts a
    loop's body once, and the report adds back what it leaves out."""
    for step in ("train step", "eval step"):
        (whole, _), (looped, program) = counted["whole"][step], counted["looped"][step]
        assert looped["flops"] == pytest.approx(whole["flops"], rel=0.03), step
        assert looped["bytes_accessed"] == pytest.approx(whole["bytes_accessed"], rel=0.25), step
        raw = program.loop * ahead._cost(program.compiled)["flops"]  # what XLA's count alone would say
        assert abs(raw - whole["flops"]) > 0.1 * whole["flops"], step  # so the check above could fail
