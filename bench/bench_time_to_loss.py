"""Wall-clock time to a validation loss: nanoGPT's CPU recipe against configs/speedrun_cpu.py.

    python bench/bench_time_to_loss.py --nanogpt PATH [--python PATH] [--seeds 3] [--adamw]
    python bench/bench_time_to_loss.py --nanogpt PATH --configs speedrun_cpu,speedrun_cpu_plus

PATH is a checkout of https://github.com/karpathy/nanoGPT (nothing of it is copied here).
Both train character-level models on Tiny Shakespeare on this machine, as whole processes:

    nanoGPT   train.py config/train_shakespeare_char.py bench/nanogpt_protocol.py with the CPU
              recipe of bench_vs_nanogpt.py (4×4×128, block 64, batch 12, AdamW, 2000 steps)
    jaxgpt    train.py --config=configs/speedrun_cpu.py (Muon, QK-norm, ReLU², soft-capped
              logits, zero-initialised projections, untied embeddings, warmup–stable–decay),
              and each other config --configs names (speedrun_cpu_plus: the later techniques)

The runs alternate (nanoGPT seed s, each jaxgpt config seed s, …) after one untimed round that fills the
caches a user's second run finds (nanoGPT's prepared data; jaxgpt's token cache and compiled
programs).

The evaluation protocol, the same for both: the validation split is the last 10% of the
text's characters (jaxgpt's split of a single document: the last round(0.1·n)). Its first
WINDOWS windows of BLOCK + 1 characters, window w starting at character w·BLOCK, are scored
in batches of 48: the mean cross-entropy of all WINDOWS·BLOCK next-character predictions,
each window read from its start. jaxgpt computes it with its own evaluation
(eval_batch_size 48, eval_max_batches WINDOWS/48, stride = block); nanoGPT with the function
bench/nanogpt_protocol.py puts in place of its estimate_loss. nanoGPT evaluates every 100
steps, jaxgpt every --eval_every.

The target is the median final loss of nanoGPT's runs. For each run: the time from process
start (the bench's Popen) to the first evaluation at or below it, less the time that process
spent evaluating and writing checkpoints before then (each prints those durations), the step
of that evaluation, and the final loss. Medians over the seeds, and their ratio. With
--adamw, the speedrun config is also run with train.optimizer=adamw (its own rate for the
matrices, --adamw_lr, and a longer schedule, --adamw_steps) for the steps ratio of Muon against
AdamW on the same model.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_vs_nanogpt import DATA, NANOGPT_RECIPE, ROOT, prepare_nanogpt_data

BLOCK, WINDOWS, NANOGPT_STEPS, NANOGPT_EVERY = 64, 768, 2000, 100
HOOK = ROOT / "bench" / "nanogpt_protocol.py"
JAXGPT_EVAL = re.compile(r"step (\d+): train loss [\d.]+, val loss ([\d.]+).*?evaluation ([\d.]+) s, "
                         r"checkpoint ([\d.]+) s")
NANOGPT_EVAL = re.compile(r"protocol: step (\d+), val loss ([\d.]+), evaluation ([\d.]+) s")
NANOGPT_SAVE = re.compile(r"protocol: checkpoint ([\d.]+) s")


def val_text(text: Path, work: Path) -> Path:
    """The validation split as jaxgpt cuts a single document: its last round(0.1·n) characters."""
    chars = text.read_text(encoding="utf-8")
    path = work / "val.txt"
    path.write_text(chars[len(chars) - round(0.1 * len(chars)):], encoding="utf-8")
    return path


def follow(command: list[str], cwd: Path, env: dict, log: Path) -> list[tuple[int, float, float]]:
    """Run `command`, reading its output (standard output and error, where jaxgpt writes its
    evaluation lines) as it comes: (step, val loss, seconds) of each evaluation, the seconds
    from the start less the evaluations' and checkpoints' own so far."""
    start = time.perf_counter()
    with open(log, "w") as kept:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        evaluations, excluded = [], 0.0
        for line in process.stdout:  # universal newlines: a progress bar's \r ends a line too
            now = time.perf_counter() - start
            kept.write(line)
            if m := JAXGPT_EVAL.search(line):  # printed after its evaluation and checkpoint
                excluded += float(m[3]) + float(m[4])
                evaluations.append((int(m[1]), float(m[2]), now - excluded))
            elif m := NANOGPT_EVAL.search(line):  # printed after its evaluation; a checkpoint may follow
                excluded += float(m[3])
                evaluations.append((int(m[1]), float(m[2]), now - excluded))
            elif m := NANOGPT_SAVE.search(line):
                excluded += float(m[1])
    if process.wait() or not evaluations:
        sys.exit(f"{' '.join(map(str, command))} failed or never evaluated:\n{log.read_text()[-3000:]}")
    return evaluations


def nanogpt_run(nanogpt: Path, python: str, seed: int, val: Path, work: Path, steps: int = NANOGPT_STEPS) -> list:
    command = [python, "train.py", "config/train_shakespeare_char.py", str(HOOK), *NANOGPT_RECIPE,
               f"--max_iters={steps}", f"--eval_interval={NANOGPT_EVERY}", f"--out_dir={work / 'nanogpt'}"]
    env = {**os.environ, "TTL_SEED": str(seed), "TTL_VAL": str(val), "TTL_BLOCK": str(BLOCK),
           "TTL_WINDOWS": str(WINDOWS), "PYTHONUNBUFFERED": "1"}
    return follow(command, nanogpt, env, work / "nanogpt.log")


def jaxgpt_run(seed: int, text: Path, work: Path, eval_every: int, overrides: list[str],
               config_name: str = "speedrun_cpu") -> list:
    run_dir = work / "jaxgpt"
    shutil.rmtree(run_dir, ignore_errors=True)
    config = {"data.source": text, "train.seed": seed, "train.eval_every": eval_every, "train.eval_batch_size": 48,
              "train.eval_max_batches": WINDOWS // 48, "data.eval_stride": BLOCK, "sample.max_new_tokens": 0,
              "run_dir": run_dir, "resume": "never"}
    command = [sys.executable, "train.py", f"--config=configs/{config_name}.py",
               *[f"--config.{key}={value}" for key, value in config.items()], *overrides]
    return follow(command, ROOT, {**os.environ, "PYTHONUNBUFFERED": "1"}, work / "jaxgpt.log")


def reached(evaluations: list, target: float) -> tuple[float, int] | None:
    """(seconds, step) of the first evaluation at or below the target; None when none is."""
    return next(((seconds, step) for step, loss, seconds in evaluations if loss <= target), None)


def row(name: str, runs: list[list], target: float) -> dict:
    hits = [reached(r, target) for r in runs]
    times = [h[0] if h else float("inf") for h in hits]
    steps = [h[1] if h else float("inf") for h in hits]
    finals = [r[-1][1] for r in runs]
    each = " ".join(f"{t:.1f}" if t < float("inf") else "—" for t in times)
    print(f"{name:28} {each:>20} {statistics.median(times):>9.1f} {statistics.median(steps):>7} "
          f"{statistics.median(finals):>10.4f}")
    return {"seconds": statistics.median(times), "steps": statistics.median(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--python", default=sys.executable, help="a Python with torch and numpy for nanoGPT")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval_every", type=int, default=25, help="jaxgpt's evaluation interval, in steps")
    parser.add_argument("--adamw", action="store_true", help="also the speedrun model on AdamW (steps ratio)")
    parser.add_argument("--adamw_lr", type=float, default=3e-3, help="AdamW's rate for the matrices (tuned: README)")
    parser.add_argument("--adamw_steps", type=int, default=720, help="AdamW's schedule (it needs more steps)")
    parser.add_argument("--data", type=Path, default=DATA, help="the Tiny Shakespeare text both read")
    parser.add_argument("--nanogpt_steps", type=int, default=NANOGPT_STEPS, help="fewer: a quick check of the bench")
    parser.add_argument("--configs", default="speedrun_cpu", help="jaxgpt's configs in configs/, comma-separated")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of the configs for every jaxgpt run (--config.KEY=VALUE)")
    args = parser.parse_args()
    args.jaxgpt = [f"--config.{setting}" for setting in args.set]
    nanogpt, text = args.nanogpt.resolve(), args.data.resolve()
    if not (nanogpt / "train.py").is_file():
        sys.exit(f"--nanogpt {nanogpt}: not a nanoGPT checkout (no train.py)")
    if not text.is_file():
        sys.exit(f"--data {text}: no such file (the Tiny Shakespeare text)")
    prepare_nanogpt_data(nanogpt, args.python, text)
    work = Path(tempfile.mkdtemp(prefix="bench-time-to-loss-"))
    adamw = [*args.jaxgpt, "--config.train.optimizer=adamw", f"--config.train.lr={args.adamw_lr}",
             f"--config.train.steps={args.adamw_steps}", f"--config.train.ckpt_every={args.adamw_steps}"]
    nano = lambda seed: nanogpt_run(nanogpt, args.python, seed, val, work, args.nanogpt_steps)  # noqa: E731
    jax = lambda seed, more, name="speedrun_cpu": jaxgpt_run(seed, text, work, args.eval_every, more, name)  # noqa: E731
    names = args.configs.split(",")
    runs = {"nanoGPT": [], **{f"jaxgpt {name}": [] for name in names}, "jaxgpt speedrun_cpu, AdamW": []}
    try:
        val = val_text(text, work)
        nano(0), [jax(0, args.jaxgpt, name) for name in names]  # untimed: the caches a second run finds
        for seed in range(args.seeds):
            runs["nanoGPT"].append(nano(seed))
            for name in names:
                runs[f"jaxgpt {name}"].append(jax(seed, args.jaxgpt, name))
            if args.adamw:
                runs["jaxgpt speedrun_cpu, AdamW"].append(jax(seed, adamw))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(runs)


def report(runs: dict[str, list]) -> None:
    target = statistics.median(r[-1][1] for r in runs["nanoGPT"])
    print(f"target: val loss {target:.4f} (the median final loss of nanoGPT's {len(runs['nanoGPT'])} runs); "
          f"{WINDOWS} windows of {BLOCK} targets of the validation split")
    print(f"{'':28} {'seconds to target (each)':>20} {'median s':>9} {'steps':>7} {'final loss':>10}")
    rows = {name: row(name, each, target) for name, each in runs.items() if each}
    nano = rows["nanoGPT"]
    for name, timed in rows.items():
        if name != "nanoGPT":
            print(f"{name} reaches nanoGPT's loss {nano['seconds'] / timed['seconds']:.2f}× as fast "
                  f"(medians; process start to the evaluation, evaluations and checkpoints left out)")
    if "jaxgpt speedrun_cpu, AdamW" in rows and "jaxgpt speedrun_cpu" in rows:
        print(f"steps to the target, Muon / AdamW on the same model: "
              f"{rows['jaxgpt speedrun_cpu']['steps'] / rows['jaxgpt speedrun_cpu, AdamW']['steps']:.2f}")
    print(f"CPU: {cpu_name()}")


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


if __name__ == "__main__":
    main()
