"""jaxgpt.compile for GPU topologies (jaxgpt.compile.gpus, jaxgpt.compile.gpu): the programs compiled for
8 H100s without a GPU, their memory against the GPU's and the bound from the model's FLOP count;
every GPU's description accepted by XLA; the one-line errors. With the gpu extra (JAX's CUDA
plugin and ptxas) the compiles run; without it they skip, as the TPU ones do without libtpu."""

import json
import os
import subprocess
import sys

import pytest
from processes import ROOT, finished, with_devices

from jaxgpt import compile as ahead
from jaxgpt import platforms
from jaxgpt.compile import gpu as compile_gpu
from jaxgpt.compile import gpus
from jaxgpt.compile.table import format_report

# the smallest program of each kind: one layer, no accumulation loop, one new token
TINY = ["--config.model.vocab_size=256", "--config.model.n_layer=1", "--config.model.n_head=4",
        "--config.model.d_model=64", "--config.model.block_size=64", "--config.model.bias=False",
        "--config.train.batch_size=16", "--config.train.eval_batch_size=16", "--config.train.grad_accum=1",
        "--config.sample.max_new_tokens=1", "--config.compute.kernel=auto", "--config.compute.dtype=bfloat16"]


def extra_installed() -> bool:
    """Whether the gpu extra is here (the plugin possibly kept out of this process: its files)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return all(version(package) for package in ("jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12"))
    except PackageNotFoundError:
        return False


needs_extra = pytest.mark.skipif(not extra_installed(), reason=f"the gpu extra is not installed: {gpus.INSTALL}")


# --- names, descriptions and figures (no extra needed) ----------------------------------------


def test_topology_names_give_hosts_and_gpus_per_host():
    assert gpus.parse("h100:8") == (gpus.GPUS["h100"], 1, 8)
    assert gpus.parse("a100:1") == (gpus.GPUS["a100"], 1, 1)
    assert gpus.parse("h200:4x8") == (gpus.GPUS["h200"], 4, 8)


@pytest.mark.parametrize("name", ["h100:3", "h100:8x3", "h100"])
def test_an_unknown_gpu_topology_lists_the_known_ones(name):
    with pytest.raises(ValueError) as error:
        ahead.topology_devices(name)  # refused before JAX's CUDA plugin is asked
    message = str(error.value)
    assert message.startswith(f"unknown GPU topology {name!r}: known are h100:{{1|2|4|8|2x8|")
    assert "a100:{" in message and "h200:{" in message and "\n" not in message


def test_an_unknown_chip_lists_the_tpus_and_the_gpus():
    with pytest.raises(ValueError) as error:
        ahead.topology_devices("b300:8")
    message = str(error.value)
    assert message.startswith("unknown topology 'b300:8': known are v4:{") and "v5e:{" in message
    assert "h100:{1|2|4|8|2x8|4x8|8x8|16x8}" in message and "a100-40gb:{" in message and "\n" not in message


def test_chips_per_host_is_refused_for_a_gpu_topology():
    from jaxgpt.compile.args import UsageError, parse_args

    with pytest.raises(UsageError, match=r"a GPU topology names its own \(--topology=h100:2x8"):
        parse_args(["compile", "--topology=h100:8", "--chips_per_host=2x4"])


def test_target_description_is_the_gpus_figures():
    text = gpus.target_config(gpus.GPUS["a100"])
    assert "cuda_compute_capability { major: 8 minor: 0 }" in text and "core_count: 108" in text
    assert f"device_memory_size: {81920 * 2**20}" in text and 'device_description_str: "NVIDIA A100-SXM4-80GB"' in text
    assert "runtime_version { major: 12" in text  # a CUDA runtime: what XLA may call (FP8 GEMMs need 12.0)
    # gpu_device_info, its compute capability, dnn_version_info, runtime_version
    assert text.count("{") == text.count("}") == 4


@pytest.mark.parametrize("value,fraction", [(None, 0.75), ("0.9", 0.9), ("2", 0.75), ("most", 0.75)])
def test_memory_for_xla_is_jaxs_allocator_fraction(value, fraction):
    assert gpus.memory_fraction({} if value is None else {"XLA_PYTHON_CLIENT_MEM_FRACTION": value}) == fraction


class NoCost:
    """A compiled GPU program as XLA gives it: memory analysis, no cost analysis."""

    class memory:
        argument_size_in_bytes, output_size_in_bytes, alias_size_in_bytes = 3_000_000, 2_000_000, 1_990_000
        temp_size_in_bytes, generated_code_size_in_bytes, peak_memory_in_bytes = 4_000_000, 0, 7_010_000

    def memory_analysis(self):
        return self.memory

    def cost_analysis(self):
        return None

    def as_text(self):
        return ""


@pytest.mark.parametrize("memory,fits", [(80 * 2**30, True), (7_000_000, False)])
def test_a_gpu_programs_bound_is_the_models_flops_at_the_peak(memory, fits):
    """Worked example: 8 GPUs of 1e15 FLOP/s, 16,384 tokens of 1e9 FLOPs each: at least
    16384e9 / 8e15 = 2.048 ms, so at most 8e15 / 1e9 = 8e6 tokens/s; no MFU bound (it would be
    100% by construction)."""
    inputs = {"parameters": 1_000_000, "optimizer state": 2_000_000, "batch": 0}
    program = ahead.Program("train step", NoCost(), inputs, 16384, 16384e9, platform="gpu")
    chip = ahead.Chip(memory, 1e15, 3e12, 100 * 2**30)
    figures = ahead.figures(program, chip, 8)
    assert figures["flops"] is None and figures["bytes_accessed"] is None and figures["bound_from"] == "model_flops"
    assert figures["roofline_seconds"] == pytest.approx(2.048e-3) and "mfu_bound" not in figures
    assert figures["tokens_per_second_bound"] == pytest.approx(8e6)
    assert figures["total"] == 7_010_000 and figures["fits"] is fits and figures["margin"] == memory - 7_010_000
    result = {"where": "GPU topology h100:8", "devices": 8, "chip": "h100", "processes": 1, "mesh": {"data": 8},
              "chip_figures": {"hbm": memory, "flops": 1e15, "bandwidth": 3e12, "memory": 100 * 2**30},
              "programs": {"train step": figures}, "notes": ["attention: xla, not the cuDNN kernel"]}
    table = format_report(result)
    assert f"memory for XLA ({memory / (100 * 2**30):.0%} of a h100's 100.000 GiB)" in table
    assert "time ≥ model's FLOPs / peak (s)" in table and "8,000,000" in table and "MFU ≤" not in table
    assert "from the model's FLOP count" in table and "not XLA's" in table
    *_, note, verdict = table.splitlines()  # the notes, then the verdict
    assert note.endswith("cuDNN kernel") and ("yes," if fits else "NO,") in table
    assert verdict.startswith("Verdict: the train step fits," if fits else "Verdict: the train step does NOT fit,")


def test_without_the_extra_the_message_is_its_install_line(monkeypatch):
    """The gpu extra missing (here: ptxas's package, whatever else is installed): one line with
    the install line, before JAX would load anything."""
    monkeypatch.setattr(platforms, "let_cuda_plugin_in", lambda: True)
    monkeypatch.setitem(sys.modules, "nvidia.cuda_nvcc", None)  # `import nvidia.cuda_nvcc` fails: not installed
    monkeypatch.setenv("PATH", "")  # and no CUDA toolkit's ptxas either
    with pytest.raises(ValueError) as error:
        compile_gpu.open_plugin("h100:8")
    message = str(error.value)
    assert "nvidia-cuda-nvcc-cu12 (ptxas)" in message and message.endswith(f"not installed): {gpus.INSTALL}")
    assert "\n" not in message


# --- compiled for GPUs, with the extra ------------------------------------------------------


def tiny_param_bytes() -> int:
    """Float32 parameters of TINY's model, whole on every device (data-parallel): the token and
    position tables, one block's four attention and two FFN matrices, three LayerNorm scales."""
    vocab, d, block = 256, 64, 64
    return 4 * (vocab * d + block * d + 4 * d * d + 2 * d * 4 * d + 3 * d)


@needs_extra
@pytest.mark.skipif(platforms.nvidia_gpu_present(), reason="a GPU is here: its own compile is checked elsewhere")
def test_compiles_for_eight_h100s_without_a_gpu(tmp_path):
    out = tmp_path / "report.json"
    env = {key: value for key, value in os.environ.items() if key not in ("JAX_PLATFORMS", "XLA_FLAGS",
                                                                          "XLA_PYTHON_CLIENT_MEM_FRACTION")}
    done = subprocess.run([sys.executable, "-m", "jaxgpt.compile", "--topology=h100:8", f"--json={out}", *TINY],
                          env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not done.stderr.strip(), done.stderr[-3000:]  # CUDA's driver stub complaining of no GPU: kept out of sight
    assert done.stdout.startswith("GPU topology h100:8: 8 devices (h100), 1 process(es)")
    # 'auto' is cuDNN's kernel on a GPU computing in bfloat16, which needs cuDNN's library to compile
    assert ("attention: xla, not the cuDNN kernel" in done.stdout) is not compile_gpu.cudnn_present()
    report = json.loads(out.read_text())
    h100 = gpus.GPUS["h100"]
    assert report["chip_figures"]["hbm"] == int(81559 * 2**20 * 0.75) == int(h100.device_memory_size * 0.75)
    train = report["programs"]["train step"]
    assert train["parameters"] == tiny_param_bytes() and train["optimizer_state"] >= 2 * tiny_param_bytes()
    assert train["total_from"] == "peak" and train["total"] >= train["parameters"] + train["optimizer_state"]
    for figures in report["programs"].values():
        assert figures["fits"] is (figures["total"] <= figures["hbm"]) is True
        assert figures["margin"] == figures["hbm"] - figures["total"] and figures["flops"] is None
    # every gradient summed over the 8 GPUs, in bfloat16 at least (bf16 compute: XLA may reduce before the cast)
    assert train["collectives"]["all-reduce"]["bytes"] >= tiny_param_bytes() // 2
    # the bound: 8 GPUs' peak over the model's FLOPs per token, 6N + 12·L·T·d (N: the matmuls' parameters,
    # the token table counted as the tied unembedding; the LayerNorm scales, 0.3% of N, left out here)
    n = 12 * 64 * 64 + 256 * 64
    per_token = 6 * n + 12 * 1 * 64 * 64
    assert train["tokens_per_second_bound"] == pytest.approx(8 * 989.4e12 / per_token, rel=5e-3)
    assert train["tokens"] == 16 * 64 and "mfu_bound" not in train


@needs_extra
def test_the_micro_batch_planners_line_is_jaxgpts_not_xlas(tmp_path):
    """The planner's line, written while the GPU compiler's standard error becomes the report's
    'XLA: …' notes, was printed as 'XLA: jaxgpt: train.batch_size=…': it is jaxgpt's own line,
    on standard error as on any other target, and no note from XLA carries jaxgpt's words."""
    from test_user_commands import run

    planned = [arg for arg in TINY if not arg.startswith(("--config.train.batch_size", "--config.train.grad_accum"))]
    done = run(["python", "-m", "jaxgpt.compile", "--topology=h100:1", *planned, "--config.train.rows_per_step=32",
                "--config.train.batch_size=0", "--config.train.grad_accum=0"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (done.stdout + done.stderr).splitlines()
    planner = [line for line in lines if "train.rows_per_step=32:" in line]
    assert len(planner) == 1 and planner[0].startswith("jaxgpt: train.batch_size=32 (32 rows on each of 1 devices)")
    assert planner[0] in done.stderr.splitlines()
    assert not [line for line in lines if line.startswith("XLA:") and "jaxgpt" in line]


@needs_extra
def test_every_gpus_description_is_one_xla_accepts():
    script = """
import json
from jaxgpt.compile import gpu as compile_gpu
from jaxgpt.compile import gpus
out = {}
for name in gpus.GPUS:
    devices = compile_gpu.topology_devices(f"{name}:2x8")
    out[name] = [devices[0].device_kind, len(devices), len({d.process_index for d in devices}), devices[0].platform]
print(json.dumps(out))
"""
    described = json.loads(finished(with_devices(script, devices=1), timeout=300))
    for name, gpu in gpus.GPUS.items():
        assert described[name] == [gpu.device_kind, 16, 2, "gpu"], name


def test_the_gpu_compilers_warnings_become_notes_once_each():
    sort = ("W1126 14:33:39.457932    9282 sort_rewriter.cc:792] Missing deviceless CUB scratch size data for sort. "
            "Using fallback sort algorithm.")
    kept = ["WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
            "I0000 00:00:1795702350.499930   28603 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
            "GPU will not be used.", sort, "To avoid this, compile with a GPU present.", sort.replace("39.45", "41.10"),
            "To avoid this, compile with a GPU present."]
    kept.insert(4, kept[0])  # absl's banner again, after a message: not a line of it
    joined = "Missing deviceless CUB scratch size data for sort. Using fallback sort algorithm. To avoid this, compile "
    assert compile_gpu.compiler_notes(kept) == [f"XLA: {joined}with a GPU present."]
