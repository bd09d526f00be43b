"""Training speed and memory on this machine, printed as a table.

    python bench/bench_train.py                 # both shapes, ~2 minutes
    python bench/bench_train.py --recipe        # also the full CPU recipe: val loss at step 2000
    python bench/bench_train.py --loop 3        # train.py's steady tokens/s against the step-only rate
    python bench/bench_train.py --prefetch 3    # the step-only rate with the loader against one batch reused
    python bench/bench_train.py --matmul 5      # the CPU's matmul backward (compute.matmul=auto) against XLA's
    python bench/bench_train.py --optimizers 5  # the CPU speedrun's step: Muon (banks; optax's) against AdamW

Each shape runs in its own process (so peak RSS is its own): the jitted train step of
jaxgpt.train.step, as train.py runs it, on real Tiny Shakespeare batches from jaxgpt.data with
the prefetching loader, after one compile: the step-only rate, which train.py's steady
tokens/s should match. MFU = flops_per_token × tokens/s ÷ the fp32 matmul peak measured in
the same process. For a comparison with nanoGPT, whole runs side by side on this machine,
see bench/bench_vs_nanogpt.py.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"

SHAPES = {
    # name: (config file, rows per micro-batch, micro-batches per step, steps to time, targets)
    "cpu_recipe": ("shakespeare_char_cpu", 12, 1, 100, {"tokens_per_sec": 25_000}),
    # batch 64 as 4 accumulated micro-batches of 16: the same update, a quarter of the memory
    "baby_gpt": ("shakespeare_char", 16, 4, 3, {"mfu": 0.75, "rss_gib": 3.5}),
    # configs/speedrun_cpu.py's step with each optimizer (--optimizers)
    "speedrun_muon": ("speedrun_cpu", 16, 1, 100, {}),
    "speedrun_adamw": ("speedrun_cpu", 16, 1, 100, {}),
    "speedrun_optax_muon": ("speedrun_cpu", 16, 1, 100, {}),
}
OPTIMIZER = {"speedrun_adamw": "adamw"}  # the shapes that train with another optimizer than their config's


def load_config(name: str):
    from jaxgpt.config import load_config as load

    return load(ROOT / "configs" / f"{name}.py")


def measure(shape: str, prefetch: bool = True, compute=None) -> dict:
    """Run in a child process: compile, then time the train step on real batches (made ahead
    by the prefetching loader, as train.py does), or with prefetch=False on one batch again.
    compute: the model's ComputeConfig (None: the default one)."""
    import jax

    from jaxgpt import data, sharding
    from jaxgpt.config import TrainConfig
    from jaxgpt.metrics import IN_FLIGHT, measure_matmul_peak
    from jaxgpt.model import GPT, flops_per_token, param_layout
    from jaxgpt.optim import learning_rate_schedule, make_optimizer
    from jaxgpt.train.run import model_config
    from jaxgpt.train.step import make_train_step, seeded, sharded_init

    config_name, micro_batch, accum, steps, _ = SHAPES[shape]
    batch_size = micro_batch * accum
    config = load_config(config_name)
    config.train.optimizer = OPTIMIZER.get(shape, config.train.optimizer)
    if shape == "speedrun_optax_muon":
        use_optax_muon()
    sharding.use_cpu_cores(config.mesh, [micro_batch])  # as train.py does: one device per core
    config.data.source = str(DATA)
    corpus = data.prepare(config.data)
    cfg = model_config(config, corpus.tokenizer.vocab_size)
    tc = TrainConfig.from_mapping(config.train)
    mesh = sharding.make_mesh(config.mesh)
    optimizer = make_optimizer(tc, param_layout(cfg))
    model = cfg if compute is None else GPT(cfg, compute)
    state, shardings = sharded_init(model, optimizer, tc.seed, mesh)
    batch_sharding = sharding.batch_sharding(mesh)
    step_fn = jax.jit(seeded(make_train_step(model, optimizer, learning_rate_schedule(tc), accum)),
                      in_shardings=(shardings, (batch_sharding, batch_sharding), None),
                      out_shardings=(shardings, None), donate_argnums=0)

    def make_batch(step, rows):
        return data.train_batch(corpus.train, seed=0, step=step, batch_size=batch_size, block_size=cfg.block_size,
                                rows=rows)

    with data.DeviceBatches(make_batch, start_step=0, end_step=steps + 2 if prefetch else 1, batch_size=batch_size,
                            sharding=batch_sharding) as batches:
        _, first = next(batches)
        start = time.perf_counter()
        compiled = step_fn.lower(state, first, tc.seed).compile()
        compile_s = time.perf_counter() - start
        state, metrics = compiled(state, first, tc.seed)  # warm-up
        jax.block_until_ready(metrics)
        # prefetch=False: the first batch again and again, and no loader thread running
        source = batches if prefetch else ((step, first) for step in range(1, steps + 2))
        start = time.perf_counter()
        in_flight = []
        for _, batch in source:
            state, metrics = compiled(state, batch, tc.seed)
            in_flight.append(metrics)
            if len(in_flight) > IN_FLIGHT:  # as train.py's loop: a few steps ahead, not all of them
                jax.block_until_ready(in_flight.pop(0))
        jax.block_until_ready(metrics)
        elapsed = time.perf_counter() - start
    timed = steps + 1
    tokens_per_sec = timed * batch_size * cfg.block_size / elapsed
    peak = measure_matmul_peak()
    return {
        "shape": shape, "batch": f"{accum}×{micro_batch}" if accum > 1 else str(batch_size),
        "ms_per_step": 1000 * elapsed / timed,
        "tokens_per_sec": tokens_per_sec, "mfu": flops_per_token(cfg, cfg.block_size) * tokens_per_sec / peak,
        "peak_gflops": peak / 1e9, "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "compile_s": compile_s, "devices": jax.device_count(),
    }


def use_optax_muon() -> None:
    """train.optimizer="muon" built as before its banks: optax.contrib.muon on the declarations'
    matrices, one Newton–Schulz chain per parameter (the peer of jaxgpt.optim.muon's banks)."""
    import optax

    from jaxgpt import optim

    def optax_muon(train, schedule, declared):
        matrices = optax.contrib.muon(
            schedule, ns_steps=train.muon_ns_steps, beta=train.muon_momentum, nesterov=train.muon_nesterov,
            weight_decay=train.weight_decay, muon_weight_dimension_numbers=optim.muon_dimension_numbers(declared))
        labels = optim.per_param(lambda leaf: "muon" if leaf.group == "matrix" else "adamw", declared)
        return optax.partition({"muon": matrices, "adamw": optim.adamw(train, schedule, declared)}, labels)

    optim.OPTIMIZERS["muon"] = optax_muon


def compare_optimizers(pairs: int, child) -> None:
    """The CPU speedrun's step (configs/speedrun_cpu.py, 16 rows) with AdamW, Muon over banks and
    optax.contrib.muon, in turn `pairs` times: the medians of the step times and their ratios."""
    import statistics

    names = ("speedrun_adamw", "speedrun_muon", "speedrun_optax_muon")
    times = {name: [] for name in names}
    for _ in range(pairs):
        for name in names:
            times[name].append(child(name)["ms_per_step"])
        print("ms/step: " + ", ".join(f"{name} {times[name][-1]:.2f}" for name in names))
    ratios = {name: statistics.median(b / a for a, b in zip(times["speedrun_adamw"], times[name], strict=True))
              for name in names}
    print(f"{'optimizer':<22} {'ms/step (median)':>16} {'× AdamW (median of pairs)':>26}")
    for name in names:
        print(f"{name:<22} {statistics.median(times[name]):>16.2f} {ratios[name]:>26.3f}")
    print(f"Muon over banks / AdamW ≤ 1.15: {'ok' if ratios['speedrun_muon'] <= 1.15 else 'MISSED'}")


def recipe() -> dict:
    """The CPU recipe end to end through train(): validation loss at step 2000."""
    import tempfile

    from absl import logging

    from jaxgpt import sharding
    from jaxgpt.train.run import train

    logging.set_verbosity(logging.ERROR)
    config = load_config("shakespeare_char_cpu")
    config.data.source = str(DATA)
    config.run_dir = tempfile.mkdtemp(prefix="jaxgpt-recipe-")
    sharding.start_jax(config)
    start = time.perf_counter()
    result = train(config)
    return {"val_loss": result["val_loss"], "minutes": (time.perf_counter() - start) / 60, "run_dir": config.run_dir}


def loop(steps: int = 300) -> dict:
    """The CPU recipe through train() (the whole loop: prefetch, logging, the NaN guard),
    evaluating and saving only at the end: the median tokens/s of its log intervals after
    the first (which holds the compile)."""
    import statistics
    import tempfile

    from absl import logging

    from jaxgpt import sharding
    from jaxgpt.metrics import read_metrics
    from jaxgpt.train.run import train

    logging.set_verbosity(logging.ERROR)
    config = load_config("shakespeare_char_cpu")
    config.data.source = str(DATA)
    config.run_dir = tempfile.mkdtemp(prefix="jaxgpt-loop-")
    config.train.update(steps=steps, eval_every=steps, ckpt_every=steps, eval_max_batches=1)
    config.sample.max_new_tokens = 0
    sharding.start_jax(config)
    train(config)
    records = read_metrics(config.run_dir)
    return {"tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in records[1:])}


def alternate(pairs: int, child, first: str, second: str, key: str) -> float:
    """The children `first` and `second` run alternately `pairs` times: the median of
    second[key] / first[key], each pair printed."""
    import statistics

    ratios = []
    for _ in range(pairs):
        a, b = child(first)[key], child(second)[key]
        ratios.append(b / a)
        print(f"{key}: {first} {a:,.1f}, {second} {b:,.1f}")
    return statistics.median(ratios)


def compare_loop(pairs: int, child) -> None:
    """train.py's loop against the step-only rate of the same config, alternating."""
    ratio = alternate(pairs, child, "cpu_recipe", "loop", "tokens_per_sec")
    print(f"train.py's loop / step-only: {ratio:.3f} (median of {pairs}; target ≥ 0.95: "
          f"{'ok' if ratio >= 0.95 else 'MISSED'})")


def xla_gradient() -> dict:
    """The CPU recipe's step-only rate with the weight matmuls differentiated by XLA itself
    (compute.matmul='xla'), in place of the 2-D matmuls with the written-out backward that a CPU
    uses by default (jaxgpt.platforms.forms.cpu_matmul): what that workaround is worth here."""
    from jaxgpt import ComputeConfig

    return measure("cpu_recipe", compute=ComputeConfig(matmul="xla"))


def compare_matmul(pairs: int, child) -> None:
    """The CPU's matmul backward (forms.cpu_matmul) against XLA's own gradient, alternating."""
    ratio = alternate(pairs, child, "xla_gradient", "cpu_recipe", "ms_per_step")
    print(f"written-out backward / XLA's gradient: {ratio:.3f} of the step time (median of {pairs})")


def compare_prefetch(pairs: int, child) -> None:
    """The step-only rate with batches made ahead by the loader's thread (as train.py) against
    one device-resident batch reused with no loader running, alternating: what prefetching
    costs the steps on this machine's cores."""
    ratio = alternate(pairs, child, "one_batch", "cpu_recipe", "tokens_per_sec")
    print(f"prefetched / reused: {ratio:.3f} (median of {pairs})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=sorted(SHAPES) + ["recipe", "loop", "one_batch", "xla_gradient"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--optimizers", type=int, default=0, metavar="PAIRS",
                        help="also time the CPU speedrun's step with AdamW, Muon's banks and optax's Muon, PAIRS times")
    parser.add_argument("--recipe", action="store_true", help="also train the CPU recipe for 2000 steps")
    parser.add_argument("--shapes", nargs="*", default=sorted(SHAPES))
    parser.add_argument("--loop", type=int, default=0, metavar="PAIRS",
                        help="also time train.py's loop against the step-only rate, PAIRS times each")
    parser.add_argument("--prefetch", type=int, default=0, metavar="PAIRS",
                        help="also time the step-only rate with the prefetching loader against one batch reused")
    parser.add_argument("--matmul", type=int, default=0, metavar="PAIRS",
                        help="also time the CPU recipe's step with XLA's own matmul gradient against the CPU's form")
    args = parser.parse_args()
    if args.child:
        children = {"recipe": recipe, "loop": loop, "one_batch": lambda: measure("cpu_recipe", prefetch=False),
                    "xla_gradient": xla_gradient}
        print(json.dumps(children[args.child]() if args.child in children else measure(args.child)))
        return

    def child(name):
        out = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    rows = [child(name) for name in args.shapes]
    print(f"{'shape':<11} {'dev':>3} {'batch':>5} {'tokens/s':>9} {'ms/step':>8} {'MFU':>6} {'peak':>6} {'RSS GiB':>8} "
          f"{'compile s':>9}  targets")
    for r in rows:
        *_, targets = SHAPES[r["shape"]]
        verdicts = []
        for key, target in targets.items():
            ok = r[key] <= target if key == "rss_gib" else r[key] >= target
            verdicts.append(f"{key} {'≤' if key == 'rss_gib' else '≥'} {target:g}: {'ok' if ok else 'MISSED'}")
        verdicts.append(f"compile < 15 s: {'ok' if r['compile_s'] < 15 else 'MISSED'}")
        print(f"{r['shape']:<11} {r['devices']:>3} {r['batch']:>5} {r['tokens_per_sec']:>9,.0f} "
              f"{r['ms_per_step']:>8.1f} "
              f"{r['mfu']:>6.1%} {r['peak_gflops']:>4.0f}GF {r['rss_gib']:>8.2f} {r['compile_s']:>9.1f}  "
              f"{'; '.join(verdicts)}")
    if args.loop:
        compare_loop(args.loop, child)
    if args.prefetch:
        compare_prefetch(args.prefetch, child)
    if args.matmul:
        compare_matmul(args.matmul, child)
    if args.optimizers:
        compare_optimizers(args.optimizers, child)
    if args.recipe:
        r = child("recipe")
        print(f"CPU recipe, 2000 steps: val loss {r['val_loss']:.4f} (nanoGPT: 1.886; target ≤ 1.89: "
              f"{'ok' if r['val_loss'] <= 1.89 else 'MISSED'}), {r['minutes']:.1f} min, run in {r['run_dir']}")


if __name__ == "__main__":
    main()
