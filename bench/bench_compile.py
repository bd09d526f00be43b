"""Compile time of the train step at 12 and 48 layers, with the blocks as a Python loop and as
one nn.scan (model.scan_layers).

    python bench/bench_compile.py [--d_model 768] [--repeat 3]

GPT-2 small's width (d 768, 12 heads, vocab 50257, block 1024; batch 8) at 12 and 48 layers,
each with scan_layers off and on. The train step (AdamW, clipping, one micro-batch) is lowered
from abstract shapes (nothing is allocated) and compiled by XLA; each figure is the median
wall time of `lower(...).compile()` over --repeat fresh processes' worth of work (the jit
cache is bypassed by building the step anew each time; the persistent compilation cache is
not used here). With the loop, XLA compiles n_layer copies of the block; with scan, one.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from table import print_table  # noqa: E402

from jaxgpt import GPT, ComputeConfig, GPTConfig  # noqa: E402
from jaxgpt.config import TrainConfig  # noqa: E402
from jaxgpt.model import param_layout  # noqa: E402
from jaxgpt.optim import learning_rate_schedule, make_optimizer  # noqa: E402
from jaxgpt.train.step import init_state, make_train_step  # noqa: E402

BATCH = 8


def compile_seconds(cfg: GPTConfig, scan_layers: bool = False) -> float:
    train = TrainConfig(steps=100, warmup_steps=10)
    model = GPT(cfg, ComputeConfig(scan_layers=scan_layers))
    optimizer = make_optimizer(train, param_layout(model))
    step = jax.jit(make_train_step(model, optimizer, learning_rate_schedule(train)))
    state = jax.eval_shape(lambda: init_state(model, optimizer, jax.random.key(0)))
    batch = (jax.ShapeDtypeStruct((BATCH, cfg.block_size), jnp.int32),) * 2
    key = jax.eval_shape(lambda: jax.random.key(0))
    start = time.perf_counter()
    step.lower(state, batch, key).compile()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d_model", type=int, default=768)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", default="12,48")
    args = parser.parse_args()
    depths = [int(n) for n in args.layers.split(",")]
    base = GPTConfig(vocab_size=50257, block_size=1024, n_head=12, d_model=args.d_model)
    compile_seconds(base.replace(n_layer=1, d_model=64, n_head=4, vocab_size=64, block_size=8))  # JAX's own start
    seconds = {}
    for scan in (False, True):
        for n_layer in depths:
            cfg = base.replace(n_layer=n_layer)
            seconds[scan, n_layer] = statistics.median(compile_seconds(cfg, scan) for _ in range(args.repeat))
    rows = [(("scan" if scan else "loop"), *(f"{seconds[scan, n]:.1f}" for n in depths),
             f"{seconds[scan, depths[-1]] / seconds[scan, depths[0]]:.2f}×") for scan in (False, True)]
    rows.append(("loop / scan", *(f"{seconds[False, n] / seconds[True, n]:.2f}×" for n in depths), ""))
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"{jax.devices()[0].platform}: {model}; d_model {args.d_model}, batch {BATCH}×1024; "
          f"median of {args.repeat} compiles (s)")
    print_table(("blocks", *(f"{n} layers" for n in depths), f"{depths[-1]} / {depths[0]}"), rows)


if __name__ == "__main__":
    main()
