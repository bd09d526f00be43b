"""Train-step time with compute.loss_chunk against the whole logits, on this machine's CPU.

    python bench/bench_loss_chunk.py [--pairs 7] [--steps 20] [--chunk 128]
    python bench/bench_loss_chunk.py --against DIR     # loss_chunk=0 here against the code in DIR

A shape is a preset's train step as train.py builds it (its mesh: one device per core; its rows,
grad_accum and dtype), on random tokens: `cpu_recipe` (configs/shakespeare_char_cpu.py, a
character vocabulary of 65) and `gpt2_vocab` (the same model with GPT-2's 50,304 tokens, where the
logits are most of the memory). Each child process compiles the step with loss_chunk 0 and with
--chunk, then times them alternately, `steps` steps each, `pairs` times, and prints the median
ratio chunked / whole of the time per step.

--against DIR runs the step with loss_chunk 0 in child processes alternately with this checkout's
code and DIR's (another checkout, e.g. the commit before loss_chunk: `git archive REV | tar -x -C DIR`):
the median ratio this / DIR of the time per step, that the default path costs what it did.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"cpu_recipe": None, "gpt2_vocab": 50304}  # name: the vocabulary, None: the preset's (65 characters)


def compiled_step(shape: str, chunk: int):
    """(the compiled train step of the shape with compute.loss_chunk = chunk, its state, a batch)."""
    import jax
    import numpy as np

    from jaxgpt import sharding
    from jaxgpt.config import TrainConfig, load_config
    from jaxgpt.model import GPT, param_layout
    from jaxgpt.model_config import ComputeConfig, GPTConfig
    from jaxgpt.optim import learning_rate_schedule, make_optimizer
    from jaxgpt.train.step import make_train_step, seeded, sharded_init

    config = load_config(ROOT / "configs" / "shakespeare_char_cpu.py")
    train = TrainConfig.from_mapping(config.train)
    sharding.use_cpu_cores(config.mesh, [train.batch_size])
    cfg = GPTConfig.from_dict({**dict(config.model), "vocab_size": SHAPES[shape] or 65})
    compute = dict(config.compute, **({"loss_chunk": chunk} if chunk else {}))
    model = GPT(cfg, ComputeConfig.from_dict(compute))
    mesh = sharding.make_mesh(config.mesh)
    optimizer = make_optimizer(train, param_layout(model))
    state, shardings = sharded_init(model, optimizer, train.seed, mesh)
    rows = train.step_rows
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, cfg.block_size + 1)).astype(np.int32)
    at = sharding.batch_sharding(mesh)
    batch = (jax.device_put(tokens[:, :-1], at), jax.device_put(tokens[:, 1:], at))
    step = jax.jit(seeded(make_train_step(model, optimizer, learning_rate_schedule(train), train.grad_accum)),
                   in_shardings=(shardings, (at, at), None), out_shardings=(shardings, None), donate_argnums=0)
    with jax.set_mesh(mesh):
        return step.lower(state, batch, 0).compile(), state, batch


def timed(program, state, batch, steps: int):
    """(seconds per step over `steps` steps, the state after them)."""
    import jax

    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = program(state, batch, 0)
    jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / steps, state


def child(shape: str, chunk: int, pairs: int, steps: int) -> dict:
    """Whole and chunked, compiled in this process and timed alternately."""
    programs = {c: compiled_step(shape, c) for c in (0, chunk)}
    states = {c: timed(*programs[c], 2)[1] for c in programs}  # warm-up
    ratios, seconds = [], {0: [], chunk: []}
    for _ in range(pairs):
        for c in programs:
            spent, states[c] = timed(programs[c][0], states[c], programs[c][2], steps)
            seconds[c].append(spent)
        ratios.append(seconds[chunk][-1] / seconds[0][-1])
    return {"shape": shape, "chunk": chunk, "whole_ms": 1e3 * statistics.median(seconds[0]),
            "chunked_ms": 1e3 * statistics.median(seconds[chunk]), "ratio": statistics.median(ratios)}


def whole_only(shape: str, steps: int) -> dict:
    """loss_chunk 0 with whichever jaxgpt this process imports (--against's children)."""
    program, state, batch = compiled_step(shape, 0)
    state = timed(program, state, batch, 2)[1]
    return {"ms": 1e3 * timed(program, state, batch, steps)[0]}


def run_child(args: list[str], code: Path = ROOT) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, cwd=code)
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--chunk", type=int, default=128, help="compute.loss_chunk: tokens a chunk on each device")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--against", type=Path, help="another checkout: its loss_chunk=0 step against this one's")
    parser.add_argument("--child", nargs=2, metavar=("SHAPE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        shape, mode = args.child
        result = whole_only(shape, args.steps) if mode == "whole" else child(shape, args.chunk, args.pairs, args.steps)
        print(json.dumps(result))
        return
    for shape in args.shapes:
        if args.against:
            ratios = []
            for _ in range(args.pairs):
                here, there = (run_child(["--child", shape, "whole", "--steps", str(args.steps)], code)
                               for code in (ROOT, args.against.resolve()))
                ratios.append(here["ms"] / there["ms"])
                print(f"{shape}: this checkout {here['ms']:.2f} ms/step, {args.against} {there['ms']:.2f}", flush=True)
            print(f"{shape}: loss_chunk=0 here / there: {statistics.median(ratios):.3f} (median of {args.pairs})")
            continue
        r = run_child(["--child", shape, "chunked", "--pairs", str(args.pairs), "--steps", str(args.steps),
                       "--chunk", str(args.chunk)])
        print(f"{shape}: whole {r['whole_ms']:.2f} ms/step, loss_chunk={r['chunk']} {r['chunked_ms']:.2f} ms/step, "
              f"chunked / whole {r['ratio']:.3f} (median of {args.pairs} alternating pairs of {args.steps} steps)")


if __name__ == "__main__":
    main()
