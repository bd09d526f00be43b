"""Data pipeline speed: preprocessing throughput and batch assembly per training step.

    python bench/bench_data.py [--shakespeare PATH] [--repeat 3] [--steps 100]

Preprocessing: `data.prepare` from a cold cache (read, split, train the tokenizer,
encode, write), on the stdlib corpus and on tinyshakespeare (default: the shared/ folder
beside the repo), as MB of source text per second, and the time to reuse the cache.

Batch assembly, for each training config: the time to make one global batch on the
device, `train_batch` from the cached stdlib tokens then
`jax.make_array_from_process_local_data`, done in the training loop's thread (no
overlap at all); and, for the CPU recipe, the time the loop actually waits for its batch
when `DeviceBatches` prefetches while a real ~25 ms jitted step runs. Each is compared
with the config's step time; the target is under 5 %.

Step times: the CPU recipe and the baby GPT as given for this CPU; GPT-2 124M on this
CPU extrapolated from the baby GPT by 6·N·tokens FLOPs, and on an A100 (bf16, 40 % of
its 312 TFLOP/s peak), the fastest step the pipeline must keep up with.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402
from table import best_time, print_table  # noqa: E402  (bench/table.py: this script's folder is on sys.path)

from jaxgpt import data  # noqa: E402

DEFAULT_SHAKESPEARE = (Path(__file__).resolve().parents[1] / ".." /
                       "shared/data/tinyshakespeare.txt")
TARGET_FRACTION = 0.05

BABY_GPT_PARAMS = 10.7e6  # 6 layers × 384 wide, 65 characters
BABY_GPT_STEP_S = 1.75  # 1.5–2 s on this CPU
GPT2_PARAMS = 124e6
A100_FLOPS = 0.4 * 312e12

# (name, batch, block, step seconds, where the step time comes from)
CONFIGS = [
    ("CPU recipe", 12, 64, 0.025, "given, this CPU"),
    ("baby GPT", 64, 256, BABY_GPT_STEP_S, "given, this CPU"),
    ("GPT-2 124M", 16, 1024, BABY_GPT_STEP_S * GPT2_PARAMS / BABY_GPT_PARAMS,
     "this CPU, by FLOPs"),
    ("GPT-2 124M", 16, 1024, 6 * GPT2_PARAMS * 16 * 1024 / A100_FLOPS, "A100 bf16, 40% MFU"),
]


def cold_build(cfg, root):
    """Prepare the corpus into a new, empty cache directory; return its meta."""
    with tempfile.TemporaryDirectory(dir=root) as cache:
        return data.prepare({**cfg, "cache_dir": cache}).meta


def preprocessing(sources, repeat, root):
    """Cold-cache build and warm reuse of each (label, data config), with caches under
    `root`; returns the corpora by label."""
    rows, corpora = [], {}
    for label, cfg in sources:
        build_s, meta = best_time(functools.partial(cold_build, cfg, root), repeat)
        warm = {**cfg, "cache_dir": str(root / "warm")}
        corpora[label] = data.prepare(warm)
        reuse_s, _ = best_time(functools.partial(data.prepare, warm), repeat)
        splits = meta["splits"]
        n_bytes = sum(split["bytes"] for split in splits.values())
        n_tokens = sum(split["tokens"] for split in splits.values())
        rows.append((label, f"{n_bytes / 1e6:.2f}", f"{n_tokens / 1e6:.2f}",
                     str(meta["tokenizer"]["vocab_size"]), f"{build_s:.2f}",
                     f"{n_bytes / build_s / 1e6:.1f}", f"{reuse_s * 1e3:.1f}"))
    print_table(("corpus, tokenizer", "MB", "M tokens", "vocab", "build s", "MB/s",
                 "reuse ms"), rows)
    return corpora


def assembly_seconds(tokens, sharding, batch, block, steps):
    """Mean time to make one global batch on the device, in the caller's thread."""
    def one(step):
        x, y = data.train_batch(tokens, seed=0, step=step, batch_size=batch, block_size=block)
        arrays = [jax.make_array_from_process_local_data(sharding, a, a.shape) for a in (x, y)]
        jax.block_until_ready(arrays)

    one(0)  # first-call costs (sharding caches) are not per-step costs
    start = time.perf_counter()
    for step in range(1, steps + 1):
        one(step)
    return (time.perf_counter() - start) / steps


def calibrated_step(seconds):
    """A jitted function of a batch that takes about `seconds` on this machine."""
    w = jnp.ones((256, 256), jnp.float32) / 256

    def make(repeats):
        @jax.jit
        def step(x):
            def body(_, h):
                return jnp.tanh(h @ w)
            return jax.lax.fori_loop(0, repeats, body, w + x.sum() * 1e-9).sum()
        return step

    probe = make(64)
    x = jnp.zeros((1,), jnp.int32)
    probe(x).block_until_ready()
    took, _ = best_time(lambda: probe(x).block_until_ready(), 5)
    step = make(max(1, round(64 * seconds / took)))
    step(x).block_until_ready()
    return step


def prefetch_wait(tokens, sharding, batch, block, step_s, steps):
    """(waits for the next batch, mean step time) in a loop that runs a real step."""
    step_fn = calibrated_step(step_s)

    def make(step, rows):
        return data.train_batch(tokens, seed=0, step=step, batch_size=batch, block_size=block,
                                rows=rows)

    waits = []
    with data.DeviceBatches(make, start_step=0, end_step=steps + 1, batch_size=batch,
                            sharding=sharding) as batches:
        next(batches)  # the first batch is made before any step can overlap it
        start = time.perf_counter()
        for _ in range(steps):
            before = time.perf_counter()
            _, (x, _) = next(batches)
            waits.append(time.perf_counter() - before)
            step_fn(x).block_until_ready()
        total = time.perf_counter() - start
    return np.array(waits), total / steps


def batch_assembly(tokens, steps):
    """Print the assembly table and the prefetch measurement; return the target checks."""
    sharding = NamedSharding(jax.make_mesh((jax.device_count(),), ("data",)),
                             PartitionSpec("data"))
    rows, checks = [], []
    for name, batch, block, step_s, source in CONFIGS:
        seconds = assembly_seconds(tokens, sharding, batch, block, steps)
        fraction = seconds / step_s
        rows.append((f"{name} {batch}×{block}", f"{step_s * 1e3:,.0f} ({source})",
                     f"{seconds * 1e3:.3f}", f"{100 * fraction:.3f}"))
        checks.append((f"{name} ({source}): assembly < 5% of a step",
                       fraction < TARGET_FRACTION))
    print_table(("config", "step ms", "assembly ms", "% of step"), rows)

    name, batch, block, step_s, _ = CONFIGS[0]
    waits, step = prefetch_wait(tokens, sharding, batch, block, step_s, steps)
    print(f"\n{name} with DeviceBatches prefetching during a real jitted step of "
          f"{step * 1e3:.1f} ms: waits {np.median(waits) * 1e3:.3f} ms per step (median; mean "
          f"{waits.mean() * 1e3:.3f} ms = {100 * waits.mean() / step:.3f}% of the step)")
    checks.append((f"{name} with prefetch: mean wait < 5% of a step",
                   waits.mean() / step < TARGET_FRACTION))
    return checks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shakespeare", type=Path, default=DEFAULT_SHAKESPEARE)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    if not args.shakespeare.is_file():
        parser.error(f"no corpus at {args.shakespeare}; pass --shakespeare PATH")
    print(f"{jax.device_count()} {jax.devices()[0].platform} device(s); best of {args.repeat}\n")

    shakespeare = str(args.shakespeare)
    with tempfile.TemporaryDirectory() as root:
        corpora = preprocessing([
            ("stdlib, char", {"source": "stdlib", "tokenizer": "char"}),
            ("stdlib, bpe 4096", {"source": "stdlib", "tokenizer": "bpe", "vocab_size": 4096}),
            ("tinyshakespeare, char", {"source": shakespeare, "tokenizer": "char"}),
            ("tinyshakespeare, bpe 1024", {"source": shakespeare, "tokenizer": "bpe",
                                           "vocab_size": 1024}),
        ], args.repeat, Path(root))
        print()
        # The cached stdlib tokens, memory-mapped as in training.
        checks = batch_assembly(corpora["stdlib, char"].train, args.steps)
    print()
    for label, ok in checks:
        print(f"{'ok  ' if ok else 'MISS'}  {label}")


if __name__ == "__main__":
    main()
