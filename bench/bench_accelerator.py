"""The presets' train step on one accelerator: tokens/s, MFU, memory and compile time in bf16,
with cuDNN's attention against XLA's and the whole logits against the loss in chunks; and
sampling tokens/s at batch 1 and 32 against the memory bound (the device's bandwidth over the
weights' bytes, read once a step).

    python bench/bench_accelerator.py        # configs/gpt2_124m.py and speedrun_gpt2.py, on the default device
    python bench/bench_accelerator.py --configs gpt2_124m --kernels cudnn --loss_chunks preset
    python bench/bench_accelerator.py --toy  # toy sizes of the same models (the default on a CPU): a smoke test
    python bench/bench_accelerator.py --configs gpt2_124m --kernels cudnn --fp8 mlp,unembed   # FP8 matmuls

Each row is one preset as shipped on this device: its model (block 1024, bf16 compute, float32
parameters), its optimizer (AdamW; Muon for the speedrun), and its rows per step (512) taken
as the preset takes them here (jaxgpt.train.micro_batch: the most rows per device that fit the
device's memory, the rest by gradient accumulation), with the attention kernel and
compute.loss_chunk of the row ('preset': the preset's own chunk; 0: the whole logits). Tokens
are random. Compile time is `lower().compile()` of the train step; step time is the median of
--steps steps after one warm-up; memory is the compiled step's (XLA's memory analysis: its
peak where the platform reports one, else arguments + outputs + temporaries). MFU is
flops_per_token · tokens/s over the device's dense bf16 peak (PEAKS; on a CPU the measured
float32 matmul peak). Sampling is `generate` of --new tokens after a 16-token prompt, greedy,
timed after a compiling call, from the presets --sample names, with the preset's compute (its
kernel; XLA's where that kernel cannot decode, as the row says). A variant that fails says why
in its row and the others run. Sampling reads the weights in the compute dtype, cast once (as
sample.py's --param_dtype auto does on an accelerator); --sample_weights param reads them as
trained (float32) instead.
--fp8 NAMES runs every row with compute.fp8=NAMES (the weight matmuls it names in FP8: mlp,
attention, unembed; an NVIDIA GPU of compute capability ≥ 8.9 computes them on its FP8 units, a
CPU emulates them), shown in the rows and the tables.
--json appends each row to a file as it is measured; --sample_only skips training and samples from
initial weights (the same tokens/s: the weights' values do not change the work); --profile DIR
writes a jax.profiler trace of two steps of the first row, or with --sample_only of one generation
at batch 1 (perfetto_trace.json.gz under DIR).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # run from a checkout, or loaded by the tests

import jaxgpt  # noqa: E402, F401 - before jax: it keeps an absent accelerator's plugin out (jaxgpt.platforms)

# isort: split
import jax  # noqa: E402
from table import print_table  # noqa: E402

from jaxgpt import GPT, ComputeConfig, GPTConfig, flops_per_token  # noqa: E402
from jaxgpt.config import TrainConfig, load_config  # noqa: E402
from jaxgpt.decode.sampling import generate  # noqa: E402
from jaxgpt.metrics import cached_matmul_peak  # noqa: E402
from jaxgpt.model import param_layout  # noqa: E402
from jaxgpt.optim import learning_rate_schedule, make_optimizer  # noqa: E402
from jaxgpt.train.micro_batch import fitted_plan  # noqa: E402
from jaxgpt.train.step import init_state, make_train_step  # noqa: E402

# dense bf16 FLOP/s of one device, by the start of jax's device_kind
# memory bandwidth of one device, bytes/s, by the start of jax's device_kind: the bound on sampling's tokens/s
BANDWIDTHS = {"NVIDIA H200": 4.8e12, "NVIDIA H100": 3.35e12, "NVIDIA A100": 2.0e12, "NVIDIA L4": 0.3e12,
              "TPU v5 lite": 0.82e12, "TPU v5p": 2.76e12, "TPU v4": 1.2e12}
PEAKS = {"NVIDIA H200": 989e12, "NVIDIA H100": 989e12, "NVIDIA A100": 312e12, "NVIDIA L4": 121e12,
         "TPU v5 lite": 197e12, "TPU v5p": 459e12, "TPU v4": 275e12}
TOY = dict(n_layer=2, n_head=4, d_model=64, block_size=64, vocab_size=256)
TOY_ROWS, TOY_CHUNK = 8, 128  # a toy step's rows, and the chunk 'preset' stands for at toy size


@functools.cache  # a CPU's is measured (cached_matmul_peak): once a bench
def peak_flops() -> tuple[float, str]:
    kind = jax.devices()[0].device_kind
    if jax.default_backend() == "cpu":
        return cached_matmul_peak(), f"{kind} (measured float32 matmul)"
    return next((peak for name, peak in PEAKS.items() if kind.startswith(name)), float("nan")), kind


def preset(name: str, toy: bool, kernel: str, chunk: str, rows: int = 0, fp8: str = "", matmul: str = "auto"):
    """(model, train config) of configs/NAME.py as it runs here with `kernel`, `chunk`, compute.fp8=`fp8` and
    compute.matmul=`matmul`."""
    config = load_config(ROOT / "configs" / f"{name}.py")
    cfg = GPTConfig.from_dict(dict(config.model))
    loss_chunk = (TOY_CHUNK if toy else config.compute.loss_chunk) if chunk == "preset" else int(chunk)
    compute = ComputeConfig.from_dict({**config.compute, "kernel": kernel, "loss_chunk": loss_chunk, "fp8": fp8,
                                       "matmul": matmul})
    train = TrainConfig.from_mapping({**config.train, "rows_per_step": TOY_ROWS if toy else config.train.rows_per_step,
                                      "batch_size": rows})
    if toy:  # the preset's techniques kept, at a size two layers and 256 tokens hold
        cfg = cfg.replace(**TOY, value_embeds=((0, -1),) if cfg.value_embeds else (),
                          bigram_table=min(cfg.bigram_table, 64))
    return GPT(cfg, compute), train


def micro_batch(gpt: GPT, train: TrainConfig) -> tuple[int, int]:
    """(rows at once, micro-batches a step) as the preset takes them on this one device, or as
    train.batch_size sets them."""
    if train.batch_size:
        return train.batch_size, train.rows_per_step // train.batch_size
    choice = fitted_plan(train, 1, gpt.cfg, gpt.compute, jax.devices()[:1])
    return choice.batch_size, choice.grad_accum


def memory_gib(compiled) -> float:
    memory = compiled.memory_analysis()
    peak = getattr(memory, "peak_memory_in_bytes", 0)
    if peak and jax.default_backend() != "cpu":
        return peak / 2**30
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes) / 2**30


def train_numbers(gpt: GPT, train: TrainConfig, steps: int, profile: str | None = None) -> dict:
    batch, accum = micro_batch(gpt, train)
    cfg = gpt.cfg
    optimizer = make_optimizer(train, param_layout(gpt))
    step = jax.jit(make_train_step(gpt, optimizer, learning_rate_schedule(train), grad_accum=accum),
                   donate_argnums=0)
    state = jax.jit(lambda key: init_state(gpt, optimizer, key))(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (batch * accum, cfg.block_size + 1), 0, cfg.vocab_size)
    data = (tokens[:, :-1], tokens[:, 1:])
    start = time.perf_counter()
    compiled = step.lower(state, data, jax.random.key(2)).compile()
    compile_s = time.perf_counter() - start
    state, metrics = compiled(state, data, jax.random.key(2))  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for i in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, data, jax.random.key(i))
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    if profile:
        with jax.profiler.trace(profile, create_perfetto_trace=True):
            for i in range(2):
                state, metrics = compiled(state, data, jax.random.key(100 + i))
            jax.block_until_ready(metrics)
    tokens_per_s = batch * accum * cfg.block_size / step_s
    return {"rows": f"{batch}×{accum}", "compile_s": compile_s, "step_ms": step_s * 1e3,
            "tokens_per_s": tokens_per_s, "mfu": flops_per_token(cfg, cfg.block_size) * tokens_per_s / peak_flops()[0],
            "memory_gib": memory_gib(compiled), "params": state.params}


def sampling_weights(gpt: GPT, params, weights: str) -> tuple[GPT, dict]:
    """(model, params) as sampling reads them: 'compute' casts the float weights once to the compute
    dtype (param_dtype = dtype); 'param' keeps them as trained."""
    if weights == "param" or gpt.compute.param_dtype == gpt.compute.dtype:
        return gpt, params
    compute = gpt.compute.replace(param_dtype=gpt.compute.dtype)
    cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(compute.compute_dtype), p))
    return GPT(gpt.cfg, compute), cast(params)


def initial_params(gpt: GPT):
    return jax.jit(lambda key: gpt.init(key, jax.numpy.zeros((1, gpt.cfg.block_size), "int32"))["params"])(
        jax.random.key(0))


def memory_bound(params, batch: int) -> float:
    """The tokens/s no sampler can pass on this device: each step reads every weight once (its
    bandwidth over the weights' bytes), for `batch` tokens; NaN where the bandwidth is not known."""
    kind = jax.devices()[0].device_kind
    bandwidth = next((b for name, b in BANDWIDTHS.items() if kind.startswith(name)), float("nan"))
    return batch * bandwidth / sum(leaf.nbytes for leaf in jax.tree.leaves(params))


def sampling_tokens_per_s(gpt: GPT, params, batch: int, new: int, profile: str | None = None) -> tuple[float, str]:
    """(tokens/s, the kernel that sampled): the model's own, else XLA's where it cannot decode;
    with `profile`, one more generation traced into that folder."""
    prompts = jax.random.randint(jax.random.key(3), (batch, 16), 0, gpt.cfg.vocab_size)
    for compute in (gpt.compute, gpt.compute.replace(kernel="xla")):
        def run(compute=compute):
            return generate(params, gpt.cfg, prompts, jax.random.key(4), max_new_tokens=new, temperature=0.0,
                            compute=compute)
        try:
            jax.block_until_ready(run().tokens)  # compiles
        except Exception as error:  # noqa: BLE001 - the kernel cannot decode here: said, and XLA's samples
            print(f"sampling with kernel={compute.kernel}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        times = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(run().tokens)
            times.append(time.perf_counter() - start)
        if profile:
            with jax.profiler.trace(profile, create_perfetto_trace=True):
                jax.block_until_ready(run().tokens)
        return batch * new / statistics.median(times), compute.kernel
    return float("nan"), "none"


def measured(name: str, toy: bool, kernel: str, chunk: str, steps: int, rows: int = 0,
             profile: str | None = None, fp8: str = "") -> dict:
    gpt, train = preset(name, toy, kernel, chunk, rows, fp8)
    row = {"config": name, "kernel": kernel, "loss_chunk": gpt.compute.loss_chunk, "fp8": fp8}
    try:
        row.update(train_numbers(gpt, train, steps, profile))
    except Exception as error:  # noqa: BLE001 - one variant failing (memory, a kernel) must not end the bench
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toy", action="store_true", help="toy sizes (the default on a CPU)")
    parser.add_argument("--configs", default="gpt2_124m,speedrun_gpt2", help="presets in configs/, comma-separated")
    parser.add_argument("--kernels", default=None, help="attention kernels (default cudnn,xla on a GPU, else xla)")
    parser.add_argument("--loss_chunks", default="preset,0", help="compute.loss_chunk values; preset: the preset's")
    parser.add_argument("--sample", default=None, help="presets to sample from (default: the first of --configs)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro_batch", type=int, default=0, help="rows at once (default: as the preset fits them)")
    parser.add_argument("--new", type=int, default=None, help="sampled tokens (default 256; 16 at toy size)")
    parser.add_argument("--json", default=None, help="append each row, as JSON, to this file")
    parser.add_argument("--sample_only", action="store_true", help="no training: sample from initial weights")
    parser.add_argument("--sample_weights", choices=("compute", "param"), default="compute",
                        help="sample with the weights cast once to the compute dtype (default), or as trained")
    parser.add_argument("--profile", default=None, help="trace two steps of the first row into this folder")
    parser.add_argument("--matmul", default="auto", help="compute.matmul (auto: a GPU decodes few rows as a GEMM)")
    parser.add_argument("--fp8", default="", metavar="NAMES",
                        help="compute.fp8 of every row: the weight matmuls in FP8 (of mlp,attention,unembed)")
    args = parser.parse_args(argv)
    toy = args.toy or jax.default_backend() == "cpu"
    kernels = (args.kernels or ("cudnn,xla" if jax.default_backend() == "gpu" else "xla")).split(",")
    new = args.new or (16 if toy else 256)
    _, device = peak_flops()
    fp8 = f", FP8 matmuls: {args.fp8}" if args.fp8 else ""
    print(f"{device}; {'toy sizes' if toy else 'the presets'}, bf16 compute{fp8}, median of {args.steps} steps",
          flush=True)

    def say(row):
        print(json.dumps({k: v for k, v in row.items() if k != "params"}), flush=True)
        if args.json:
            with open(args.json, "a") as file:
                file.write(json.dumps({"device": device, **{k: v for k, v in row.items() if k != "params"}}) + "\n")

    rows, samples = [], []
    sample = (args.sample or args.configs.split(",")[0]).split(",")
    profile = args.profile
    for name in args.configs.split(","):
        sampled = name not in sample
        for kernel in kernels:
            for chunk in args.loss_chunks.split(","):
                if args.sample_only:
                    gpt, _ = preset(name, toy, kernel, chunk, fp8=args.fp8, matmul=args.matmul)
                    params = None if sampled else initial_params(gpt)
                else:
                    row = measured(name, toy, kernel, chunk, args.steps, args.micro_batch, profile, args.fp8)
                    profile = None
                    say(row)
                    params = row.pop("params", None)
                    rows.append(row)
                if params is not None and not sampled:
                    sampled = True
                    model = preset(name, toy, kernel, chunk, fp8=args.fp8, matmul=args.matmul)[0]
                    gpt, params = sampling_weights(model, params, args.sample_weights)
                    for batch in (1, 32):
                        speed, used = sampling_tokens_per_s(gpt, params, batch, new,
                                                            profile if args.sample_only and batch == 1 else None)
                        samples.append({"config": name, "kernel": used, "batch": batch, "tokens_per_s": speed,
                                        "bound": memory_bound(params, batch),
                                        "weights": gpt.compute.param_dtype, "fp8": args.fp8, "matmul": args.matmul})
                        say(samples[-1])
                del params
    print_table(("config", "attention", "loss", "fp8", "rows × steps", "compile (s)", "step (ms)", "tokens/s", "MFU",
                 "memory (GiB)"),
                [(r["config"], r["kernel"], f"chunks of {r['loss_chunk']}" if r["loss_chunk"] else "whole",
                  r["fp8"] or "none",
                  *((r["rows"], f"{r['compile_s']:.1f}", f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                     f"{r['mfu']:.1%}", f"{r['memory_gib']:.2f}") if "error" not in r else
                    (r["error"], "", "", "", "", ""))) for r in rows])
    print()
    print_table(("config", "attention", "weights", "fp8", "matmul", "batch", f"sampling tokens/s ({new} new)",
                 "memory bound", "of the bound"),
                [(s["config"], s["kernel"], s["weights"], s["fp8"] or "none", s["matmul"], str(s["batch"]),
                  f"{s['tokens_per_s']:,.0f}", f"{s['bound']:,.0f}", f"{s['tokens_per_s'] / s['bound']:.1%}")
                 for s in samples])
    return rows, samples


if __name__ == "__main__":
    main()
