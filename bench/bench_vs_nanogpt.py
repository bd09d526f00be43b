"""jaxgpt's train.py against nanoGPT's, as whole processes on this machine, side by side.

    python bench/bench_vs_nanogpt.py --nanogpt PATH [--python PATH] [--steps 600] [--pairs 3]

PATH is a checkout of https://github.com/karpathy/nanoGPT (nothing of it is copied here);
--python a Python with PyTorch (CPU) and numpy for it, by default this one (the `parity`
extra installs torch). Both train on the same Tiny Shakespeare file for the same number of
steps with the recipe of nanoGPT's README for a CPU:

    nanoGPT   train.py config/train_shakespeare_char.py --device=cpu --compile=False
              --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4
              --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0
    jaxgpt    train.py --config=configs/shakespeare_char_cpu.py (the same sizes and optimizer)

for --steps steps of that 2000-step schedule (max_iters = steps − 1: nanoGPT's iterations
are 0 … max_iters), evaluating and saving a checkpoint only at the end: nanoGPT with
eval_interval at its last step (it also evaluates before its first step, as it always
does), jaxgpt with eval_every and ckpt_every = steps and as many evaluation rows as
nanoGPT's 20 batches on each split. No sample is written. The runs alternate (A B A B …)
after one untimed pair, which leaves what a user's second run finds: the files in the OS
cache, nanoGPT's prepared data, jaxgpt's token cache, its compiled programs and its
measured matmul peak.

Printed: the median wall time of each whole process, their ratio, and the step-only rates:
nanoGPT's from the per-iteration times it prints, jaxgpt's from metrics.jsonl (tokens/s
between log records, evaluation and checkpoints left out; the first record, which holds the
compile, left out).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
BATCH, BLOCK = 12, 64
NANOGPT_RECIPE = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", f"--block_size={BLOCK}",
                  f"--batch_size={BATCH}", "--n_layer=4", "--n_head=4", "--n_embd=128", "--lr_decay_iters=2000",
                  "--dropout=0.0"]
ITERATION = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", re.MULTILINE)
FINAL_EVAL = re.compile(r"^step \d+: train loss [\d.]+, val loss ([\d.]+)", re.MULTILINE)


def prepare_nanogpt_data(nanogpt: Path, python: str, text: Path) -> None:
    """nanoGPT's own data/shakespeare_char/prepare.py on `text`: it downloads input.txt only
    when the file is missing, so the file is put there first."""
    folder = nanogpt / "data" / "shakespeare_char"
    target = folder / "input.txt"
    if not (target.exists() and target.read_bytes() == text.read_bytes()):
        shutil.copyfile(text, target)
    out = subprocess.run([python, "prepare.py"], cwd=folder, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"nanoGPT's prepare.py failed (it needs numpy and requests in {python}):\n{out.stderr[-2000:]}")


def nanogpt_command(python: str, steps: int, out_dir: Path) -> list[str]:
    """`steps` updates: iterations 0 … steps − 1, the last evaluation (and checkpoint) before
    the last of them."""
    return [python, "train.py", "config/train_shakespeare_char.py", *NANOGPT_RECIPE, f"--max_iters={steps - 1}",
            f"--eval_interval={steps - 1}", f"--out_dir={out_dir}"]


def jaxgpt_command(steps: int, text: Path, run_dir: Path) -> list[str]:
    eval_rows = 2 * 20 * BATCH  # nanoGPT: 20 batches of the train split and 20 of the validation split
    config = {"data.source": text, "train.steps": steps, "train.decay_steps": 2000, "train.eval_every": steps,
              "train.ckpt_every": steps, "train.eval_max_batches": eval_rows // 48, "train.eval_batch_size": 48,
              "sample.max_new_tokens": 0, "run_dir": run_dir}
    return [sys.executable, "train.py", "--config=configs/shakespeare_char_cpu.py",
            *[f"--config.{key}={value}" for key, value in config.items()]]


def timed(command: list[str], cwd: Path) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode:
        sys.exit(f"{' '.join(map(str, command))} failed:\n{out.stderr[-3000:]}")
    return seconds, out.stdout + out.stderr


def nanogpt_result(seconds: float, output: str) -> dict:
    """Step-only: the median of the per-iteration times nanoGPT prints (iteration 0 and the
    one that evaluates are slow ones, which a median leaves out)."""
    times = [float(ms) / 1000 for _, ms in ITERATION.findall(output)]
    val = FINAL_EVAL.findall(output)
    return {"seconds": seconds, "steps": len(times), "step_tokens_per_sec": BATCH * BLOCK / statistics.median(times),
            "val_loss": float(val[-1]) if val else None}


def jaxgpt_result(seconds: float, run_dir: Path) -> dict:
    """Step-only: the median tokens/s of the log intervals after the first."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_sec"] for r in records[1:]] or [records[0]["tokens_per_sec"]]
    return {"seconds": seconds, "steps": records[-1]["step"], "step_tokens_per_sec": statistics.median(rates),
            "val_loss": records[-1].get("val_loss"), "eval_seconds": records[-1].get("eval_seconds"),
            "checkpoint_seconds": records[-1].get("checkpoint_seconds")}


def run_pair(nanogpt: Path, python: str, steps: int, text: Path, work: Path, index: int) -> tuple[dict, dict]:
    nano = nanogpt_result(*timed(nanogpt_command(python, steps, work / f"nanogpt-{index}"), nanogpt))
    run_dir = work / f"jaxgpt-{index}"
    seconds, _ = timed(jaxgpt_command(steps, text, run_dir), ROOT)
    return nano, jaxgpt_result(seconds, run_dir)


def report(pairs: list[tuple[dict, dict]], steps: int) -> None:
    def median(which: int, key: str) -> float:
        return statistics.median(pair[which][key] for pair in pairs)

    print(f"{len(pairs)} pair(s) of whole runs, {steps} steps of {BATCH}×{BLOCK} tokens each")
    print(f"{'':8} {'wall s (each)':>28} {'median':>8} {'step-only tokens/s':>19} {'val loss':>9}")
    for which, name in enumerate(("nanoGPT", "jaxgpt")):
        each = " ".join(f"{pair[which]['seconds']:.1f}" for pair in pairs)
        val = pairs[-1][which]["val_loss"]
        print(f"{name:8} {each:>28} {median(which, 'seconds'):>8.1f} {median(which, 'step_tokens_per_sec'):>19,.0f} "
              f"{val if val is None else format(val, '.4f'):>9}")
    print(f"jaxgpt vs nanoGPT: whole run {median(0, 'seconds') / median(1, 'seconds'):.2f}× as fast, step-only "
          f"{median(1, 'step_tokens_per_sec') / median(0, 'step_tokens_per_sec'):.2f}× the tokens/s")
    print(f"jaxgpt's final evaluation {median(1, 'eval_seconds'):.2f} s and checkpoint "
          f"{median(1, 'checkpoint_seconds'):.2f} s (in its whole-run time, not in its tokens/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--python", default=sys.executable, help="a Python with torch and numpy for nanoGPT")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--pairs", type=int, default=3, help="timed nanoGPT, jaxgpt pairs (after one untimed)")
    parser.add_argument("--data", type=Path, default=DATA, help="the Tiny Shakespeare text both read")
    args = parser.parse_args()
    nanogpt, text = args.nanogpt.resolve(), args.data.resolve()
    if not (nanogpt / "train.py").is_file() or not (nanogpt / "config" / "train_shakespeare_char.py").is_file():
        sys.exit(f"--nanogpt {nanogpt}: not a nanoGPT checkout (no train.py, config/train_shakespeare_char.py)")
    if not text.is_file():
        sys.exit(f"--data {text}: no such file (the Tiny Shakespeare text)")
    if args.steps < 2 or args.pairs < 1:
        sys.exit("--steps must be at least 2 and --pairs at least 1")
    prepare_nanogpt_data(nanogpt, args.python, text)
    work = Path(tempfile.mkdtemp(prefix="bench-vs-nanogpt-"))
    try:
        run_pair(nanogpt, args.python, args.steps, text, work, 0)  # untimed: caches filled, as for a second run
        pairs = [run_pair(nanogpt, args.python, args.steps, text, work, i) for i in range(1, args.pairs + 1)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(pairs, args.steps)


if __name__ == "__main__":
    main()
