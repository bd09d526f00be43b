"""Sampling cost per token with linear attention's recurrent state against softmax attention's KV cache.

    python bench/bench_linear_attention.py [--batch 8] [--repeat 5]

One model shape (4 layers, d 256, 4 heads of 64, rope, vocab 256, block_size 2048 so that no
sequence here is cropped), once with attention='softmax' (the KV cache) and once with
attention='linear' (the recurrent state S, z). For a sequence at n = 64, 256 and 1024 tokens:
the prompt of n tokens is prefilled (not timed), then one compiled loop feeds m = 32 tokens
one at a time through the model with the cache, as the sampler's steps do; its median time
over --repeat runs (after a compiling one) / m is the cost of a new token at positions
n … n + m. The softmax step reads a cache of n + m slots; the linear step a state of the same
size at every n. Also printed: the bytes each holds for one row.
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

from jaxgpt import GPT, GPTConfig, init_cache  # noqa: E402

SHAPE = GPTConfig(vocab_size=256, block_size=2048, n_layer=4, n_head=4, d_model=256, positions="rope", bias=False)
LENGTHS = (64, 256, 1024)
NEW = 32


def median_time(function, repeat: int) -> float:
    function()  # compiles
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(function())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@jax.jit(static_argnames=("cfg", "steps"))
def decode(params, cache, token, *, cfg: GPTConfig, steps: int):
    """`steps` greedy tokens, each fed alone through the model with the cache."""
    def step(_, carry):
        token, cache = carry
        logits, cache = GPT(cfg).apply({"params": params}, token, cache)
        return jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(jnp.int32), cache

    return jax.lax.fori_loop(0, steps, step, (token, cache))


def per_token_ms(cfg: GPTConfig, params, n: int, batch: int, repeat: int) -> float:
    prompts = jax.random.randint(jax.random.key(n), (batch, n), 0, cfg.vocab_size)
    logits, cache = jax.jit(lambda p, x, c: GPT(cfg).apply({"params": p}, x, c))(
        params, prompts, init_cache(cfg, batch, n + NEW))
    token = jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(jnp.int32)
    return 1e3 * median_time(lambda: decode(params, cache, token, cfg=cfg, steps=NEW), repeat) / NEW


def state_bytes(cfg: GPTConfig, n: int) -> int:
    """Bytes of one row's cache when the sequence is n + NEW tokens long."""
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, n + NEW))
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache) if a.ndim > 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    configs = {"softmax (KV cache)": SHAPE, "linear (state S, z)": SHAPE.replace(attention="linear")}
    params = GPT(SHAPE).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]  # same params for both
    costs = {name: [per_token_ms(cfg, params, n, args.batch, args.repeat) for n in LENGTHS]
             for name, cfg in configs.items()}
    rows = []
    for name, cfg in configs.items():
        rows.append((f"{name} ms/token", *(f"{ms:.3f}" for ms in costs[name])))
        rows.append((f"{name} KiB/row", *(f"{state_bytes(cfg, n) / 1024:.0f}" for n in LENGTHS)))
    softmax, linear = costs.values()
    ratios = (f"{s / lin:.2f}×" for s, lin in zip(softmax, linear, strict=True))
    rows.append(("softmax / linear time", *ratios))
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"{jax.devices()[0].platform}: {model}; batch {args.batch}, {NEW} new tokens, median of {args.repeat}")
    print("4 layers, d 256, 4 heads of 64, rope; a new token's cost when the sequence is n tokens long")
    print_table(("", *(f"n = {n}" for n in LENGTHS)), rows)


if __name__ == "__main__":
    main()
