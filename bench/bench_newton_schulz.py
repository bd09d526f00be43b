"""Muon's Newton–Schulz iterations in float32 against bfloat16, on this machine's CPU.

    python bench/bench_newton_schulz.py [--banks 16x128x128,8x128x504] [--steps 5] [--calls 30] [--rounds 3]

A bank is N matrices of (m, n), m ≤ n, orthogonalised together (jaxgpt.optim.muon.newton_schulz); the
default is `configs/speedrun_cpu.py`'s two banks. One jitted call runs every bank's `steps`
iterations; each round times `calls` calls of each dtype, alternated, and the table gives the
median per dtype and their ratio (bfloat16 / float32), with each round's medians.
"""

from __future__ import annotations

# isort: off
import jaxgpt  # noqa: F401  (first: keeps an accelerator's plugin this machine cannot use out of JAX)
# isort: on
import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.optim import NS_COEFFS
from jaxgpt.optim.muon import newton_schulz


def program(banks, steps: int, dtype):
    """A jitted call of every bank's iterations in `dtype`, and its inputs."""
    rng = np.random.default_rng(0)
    stacks = [jnp.asarray(rng.standard_normal(shape), dtype) for shape in banks]
    coeffs = jnp.tile(jnp.asarray([NS_COEFFS], dtype), (steps, 1))
    run = jax.jit(lambda xs: [newton_schulz(x, coeffs, 1e-7) for x in xs])
    jax.block_until_ready(run(stacks))
    return run, stacks


def median_ms(run, stacks, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(run(stacks))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--banks", default="16x128x128,8x128x504")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    banks = [tuple(int(n) for n in bank.split("x")) for bank in args.banks.split(",")]
    programs = {name: program(banks, args.steps, dtype) for name, dtype in
                (("float32", jnp.float32), ("bfloat16", jnp.bfloat16))}
    rounds = {name: [] for name in programs}
    for _ in range(args.rounds):
        for name, (run, stacks) in programs.items():
            rounds[name].append(median_ms(run, stacks, args.calls))
    flops = sum(n * args.steps * (4 * m * m * k + 2 * m ** 3) for n, m, k in banks)
    print(f"banks {args.banks}, {args.steps} steps: {flops / 1e9:.2f} GFLOP a call\n")
    print("| dtype | median ms | GFLOP/s | rounds (ms) |\n|---|---|---|---|")
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    for name, values in rounds.items():
        print(f"| {name} | {medians[name]:.2f} | {flops / medians[name] / 1e6:.0f} | "
              f"{', '.join(f'{v:.2f}' for v in values)} |")
    print(f"\nbfloat16 / float32: {medians['bfloat16'] / medians['float32']:.2f}×")


if __name__ == "__main__":
    main()
