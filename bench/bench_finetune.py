"""Fine-tuning on records, on this machine: the demo's exact match against steps and wall
time, and the train step's speed with packing against padding-only on the same records.

    python bench/bench_finetune.py                  # both parts, ~5 minutes on 2 CPU cores
    python bench/bench_finetune.py --part speed     # only packing against padding (~1 minute)

Part 1 trains configs/finetune_records.py (look-ups in a generated table) in segments,
resuming each (the schedule is the whole run's), and after each segment greedy-decodes every
held-out record (jaxgpt.score.completions): exact match and token F1 against the reference.
Part 2 times the jitted train step (after one compile, on one device) on the demo's records
laid out as packed rows and as one example per row, and counts the positions that hold an
example.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from table import print_table

ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def demo_config(work: Path, steps: int):
    from jaxgpt.config import load_config

    config = load_config(ROOT / "configs" / "finetune_records.py")
    config.run_dir = str(work / "run")
    config.data.cache_dir = str(work / "cache")
    config.train.steps = steps
    config.train.eval_every = steps
    config.train.ckpt_every = steps
    config.sample.max_new_tokens = 0
    return config


def exact_match_against_steps(work: Path, segments: list[int]) -> list[list[str]]:
    from jaxgpt import data
    from jaxgpt.score import completions
    from jaxgpt.train.run import train
    from jaxgpt.train.rundir import load_run

    total = segments[-1]
    rows, trained = [], 0.0
    for steps in segments:
        config = demo_config(work, steps)
        config.train.decay_steps = total  # each segment resumes the same run
        start = time.perf_counter()
        result = train(config)
        trained += time.perf_counter() - start
        params, cfg, tokenizer = load_run(config.run_dir, step=steps)
        corpus = data.prepare(config.data, tokenizer=tokenizer)
        summary, _ = completions.evaluate_completions(params, cfg, tokenizer, corpus.examples["val"], batch_size=100)
        rows.append([str(steps), f"{trained:.0f}", f"{result['val_loss']:.3f}", f"{summary['exact_match']:.1%}",
                     f"{summary['token_f1']:.1%}", str(summary["records"])])
        print(f"step {steps}: exact match {summary['exact_match']:.1%} after {trained:.0f} s", flush=True)
    return rows


def step_speed(work: Path, repeats: int = 5, steps: int = 20) -> list[list[str]]:
    import jax

    from jaxgpt import data
    from jaxgpt.config import TrainConfig
    from jaxgpt.model import param_layout
    from jaxgpt.optim import learning_rate_schedule, make_optimizer
    from jaxgpt.train.run import model_config
    from jaxgpt.train.step import init_state, make_train_step

    config = demo_config(work, 1000)
    corpus = data.prepare(config.data)
    cfg, train_cfg = model_config(config, corpus.tokenizer.vocab_size), TrainConfig.from_mapping(config.train)
    optimizer = make_optimizer(train_cfg, param_layout(cfg))
    step = jax.jit(make_train_step(cfg, optimizer, learning_rate_schedule(train_cfg)), donate_argnums=0)
    examples, rows = corpus.examples["train"], []
    speeds = {}
    for mode in ("pad", "pack"):
        layout = data.plan(examples, cfg.block_size, mode)
        batches = [data.packed_batch(examples, layout, seed=0, step=s, batch_size=train_cfg.batch_size)
                   for s in range(steps)]
        state = init_state(cfg, optimizer, jax.random.key(0))
        state, _ = step(state, batches[0], jax.random.key(0))  # compile
        jax.block_until_ready(state)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for batch in batches:
                state, metrics = step(state, batch, jax.random.key(0))
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times) / steps
        used = sum(int((b[4] > 0).sum()) for b in batches) / steps  # positions holding an example
        examples_per_row = len(layout.members) / layout.rows
        speeds[mode] = used / seconds
        rows.append([mode, f"{layout.padding:.1%}", f"{examples_per_row:.2f}", f"{seconds * 1e3:.1f}",
                     f"{train_cfg.batch_size * examples_per_row / seconds:,.0f}", f"{used / seconds:,.0f}"])
    for row, mode in zip(rows, ("pad", "pack"), strict=True):
        row.append(f"{speeds[mode] / speeds['pad']:.2f}")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("all", "demo", "speed"), default="all")
    parser.add_argument("--segments", default="250,500,750,1000")
    args = parser.parse_args()
    from jaxgpt import sharding

    with tempfile.TemporaryDirectory() as scratch:
        sharding.start_jax(demo_config(Path(scratch), 1000))  # the devices train.py would use
    import jax

    print(f"CPU: {cpu_name()}; {jax.device_count()} JAX CPU device(s)")
    with tempfile.TemporaryDirectory() as work:
        if args.part in ("all", "speed"):
            print("\nthe train step on the demo's records: packed rows against one example per row (peer), "
                  "median of 5 × 20 steps")
            print_table(["layout", "padding", "examples/row", "ms/step", "examples/s", "example tokens/s",
                         "vs pad"], step_speed(Path(work)))
        if args.part in ("all", "demo"):
            segments = [int(s) for s in args.segments.split(",")]
            rows = exact_match_against_steps(Path(work), segments)
            print("\nconfigs/finetune_records.py: held-out exact match against steps (greedy, stop at <|eos|>)")
            print_table(["step", "train s", "val loss", "exact match", "token F1", "held out"], rows)


if __name__ == "__main__":
    main()
