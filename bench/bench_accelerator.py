"""GPT-2 small on an accelerator: the train step's MFU, tokens/s, peak memory and compile time
in bf16, and sampling tokens/s at batch 1 and 32.

    python bench/bench_accelerator.py              # configs/gpt2_124m.py's model, on the default device
    python bench/bench_accelerator.py --toy        # a toy size (the default on a CPU): a smoke test

The model is configs/gpt2_124m.py's (12 layers, d 768, block 1024, bf16 compute, float32
params) with attention='cudnn' on a GPU and 'xla' elsewhere; one micro-batch of --batch rows
(no accumulation) per step, random tokens, AdamW. Compile time is `lower().compile()` of
the train step; the step time is the median of --steps steps after one warm-up. MFU is
flops_per_token · tokens/s over the device's dense bf16 peak (PEAKS; on a CPU the measured
matmul peak). Peak memory is the device's peak_bytes_in_use (on a CPU the process's maxrss).
Sampling is `generate` of --new tokens after a 16-token prompt, greedy, timed after a
compiling call.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # run from a checkout, or loaded by the tests

import jax  # noqa: E402
from table import print_table  # noqa: E402

from jaxgpt import GPT, ComputeConfig, GPTConfig, flops_per_token  # noqa: E402
from jaxgpt.config import TrainConfig, load_config  # noqa: E402
from jaxgpt.metrics import cached_matmul_peak  # noqa: E402
from jaxgpt.model import param_layout  # noqa: E402
from jaxgpt.optim import learning_rate_schedule, make_optimizer  # noqa: E402
from jaxgpt.sampling import generate  # noqa: E402
from jaxgpt.training import init_state, make_train_step  # noqa: E402

# dense bf16 FLOP/s of one device, by the start of jax's device_kind
PEAKS = {"NVIDIA H200": 989e12, "NVIDIA H100": 989e12, "NVIDIA A100": 312e12, "NVIDIA L4": 121e12,
         "TPU v5 lite": 197e12, "TPU v5p": 459e12, "TPU v4": 275e12}
TOY = dict(n_layer=2, n_head=4, d_model=64, block_size=64, vocab_size=256)


def model(toy: bool) -> GPT:
    """configs/gpt2_124m.py's model (or a toy one) as it runs here: its compute settings, with
    the cudnn kernel on a GPU and xla elsewhere."""
    config = load_config(ROOT / "configs" / "gpt2_124m.py")
    cfg = GPTConfig.from_dict(dict(config.model))
    kernel = "cudnn" if jax.default_backend() == "gpu" else "xla"
    compute = ComputeConfig.from_dict({**config.compute, "kernel": kernel})
    return GPT(cfg.replace(**TOY) if toy else cfg, compute)


def peak_flops() -> tuple[float, str]:
    kind = jax.devices()[0].device_kind
    if jax.default_backend() == "cpu":
        return cached_matmul_peak(), f"{kind} (measured float32 matmul)"
    return next((peak for name, peak in PEAKS.items() if kind.startswith(name)), float("nan")), kind


def peak_memory_gib() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def train_numbers(gpt: GPT, batch: int, steps: int) -> dict:
    cfg, train = gpt.cfg, TrainConfig(steps=1000, warmup_steps=10)
    optimizer = make_optimizer(train, param_layout(gpt))
    step = jax.jit(make_train_step(gpt, optimizer, learning_rate_schedule(train)), donate_argnums=0)
    state = jax.jit(lambda key: init_state(gpt, optimizer, key))(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (batch, cfg.block_size + 1), 0, cfg.vocab_size)
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
    return {"compile_s": compile_s, "step_s": statistics.median(times), "params": state.params}


def sampling_tokens_per_s(gpt: GPT, params, batch: int, new: int) -> float:
    prompts = jax.random.randint(jax.random.key(3), (batch, 16), 0, gpt.cfg.vocab_size)
    run = lambda: generate(params, gpt.cfg, prompts, jax.random.key(4), max_new_tokens=new,  # noqa: E731
                           temperature=0.0, compute=gpt.compute)
    jax.block_until_ready(run().tokens)  # compiles
    start = time.perf_counter()
    jax.block_until_ready(run().tokens)
    return batch * new / (time.perf_counter() - start)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toy", action="store_true", help="a toy model (the default on a CPU)")
    parser.add_argument("--batch", type=int, default=None, help="rows per step (default 16; 4 at toy size)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--new", type=int, default=None, help="sampled tokens (default 256; 16 at toy size)")
    args = parser.parse_args(argv)
    toy = args.toy or jax.default_backend() == "cpu"
    gpt = model(toy)
    cfg = gpt.cfg
    batch, new = args.batch or (4 if toy else 16), args.new or (16 if toy else 256)
    trained = train_numbers(gpt, batch, args.steps)
    tokens_per_s = batch * cfg.block_size / trained["step_s"]
    peak, device = peak_flops()
    rows = [
        ("train step compile (s)", f"{trained['compile_s']:.1f}"),
        ("train step (ms)", f"{trained['step_s'] * 1e3:.1f}"),
        ("train tokens/s", f"{tokens_per_s:,.0f}"),
        ("MFU", f"{flops_per_token(cfg, cfg.block_size) * tokens_per_s / peak:.1%}"),
        ("peak memory (GiB)", f"{peak_memory_gib():.2f}"),
        *((f"sampling tokens/s, batch {b}", f"{sampling_tokens_per_s(gpt, trained['params'], b, new):,.0f}")
          for b in (1, 32)),
    ]
    print(f"{device}; {'toy model' if toy else 'GPT-2 small'} ({cfg.n_layer} layers, d {cfg.d_model}, "
          f"block {cfg.block_size}), {gpt.compute.dtype}, kernel={gpt.compute.kernel}, batch {batch}, "
          f"median of {args.steps}")
    print_table(("measure", "value"), rows)
    return rows


if __name__ == "__main__":
    main()
