"""How long a 1-step run takes, as a whole process: with JAX's persistent compilation cache
cold and warm, and the programs it compiles; nanoGPT's own 1-step run beside it.

    python bench/bench_startup.py [--nanogpt PATH --python PATH] [--repeat 3]

jaxgpt: `train.py --config=configs/shakespeare_char_cpu.py` on the Tiny Shakespeare file
for 1 step, as a user runs it (an evaluation over the whole validation split, a checkpoint,
then a 500-token sample), and once more without the sample (nanoGPT's train.py writes none).
Cold: a fresh compilation cache directory, with JAX_LOG_COMPILES to count the programs
compiled; warm: the same directory again, --repeat times. An untimed run first fills what a
second run on a machine finds anyway (the token cache, the measured matmul peak, the files
in the OS cache), so that cold measures the compiling.

nanoGPT (with --nanogpt, a checkout of karpathy/nanoGPT, and --python, a Python with
PyTorch for it): its train.py for the same recipe with max_iters=0, i.e. its evaluation
before the first step (20 batches of each split) and one step (it saves no checkpoint before
step 1), --repeat times.

With --other_python PATH (the Python of another install of jaxgpt, e.g. one without the tpu
or gpu extra): the warm runs alternate between this Python and that one, and the table compares
them, with the lines of library noise each printed on standard error (libtpu's start-up
complaints, CUDA's driver stub's "Could not find cuda drivers", absl's E0000 lines, warnings,
tracebacks).
"""

from __future__ import annotations

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
from table import print_table

TARGETS = {"cold": 10.0, "warm": 6.0}  # seconds, the 1-step run with its sample
COMPILED = re.compile(r"Finished XLA compilation of (jit\([^)]*\))")


def jaxgpt_run(text: Path, run_dir: Path, cache: Path, sample: bool, log_compiles: bool = False,
               python: str = sys.executable):
    """(wall seconds, the names of the programs compiled when log_compiles)."""
    command = [python, "train.py", "--config=configs/shakespeare_char_cpu.py", f"--config.data.source={text}",
               "--config.train.steps=1", f"--config.run_dir={run_dir}", f"--config.compilation_cache={cache}"]
    if not sample:
        command.append("--config.sample.max_new_tokens=0")
    env = {**os.environ, **({"JAX_LOG_COMPILES": "1"} if log_compiles else {})}
    shutil.rmtree(run_dir, ignore_errors=True)
    start = time.perf_counter()
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if out.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{out.stderr[-3000:]}")
    if not log_compiles:
        STDERR.setdefault(python, []).extend(line for line in out.stderr.splitlines() if NOISE.search(line))
    return seconds, COMPILED.findall(out.stderr)


STDERR: dict[str, list[str]] = {}  # each Python's runs' lines of standard error that are a library's noise
NOISE = re.compile(r"(?i)tpu|cuda|^[EWF]\d{4} |WARNING|Traceback")  # libtpu's, CUDA's, absl's and Python's


def compared(text: Path, run_dir: Path, cache: Path, other: str, repeat: int) -> list[list[str]]:
    """Rows of warm runs alternating between this Python and `other`."""
    ours, theirs = [], []
    jaxgpt_run(text, run_dir, cache, sample=False, python=other)  # its own untimed first run
    STDERR.clear()  # the noise of the alternated runs alone
    for _ in range(repeat):
        ours.append(jaxgpt_run(text, run_dir, cache, sample=False)[0])
        theirs.append(jaxgpt_run(text, run_dir, cache, sample=False, python=other)[0])
    noise = {python: len(STDERR.get(python, [])) for python in (sys.executable, other)}
    return [[f"warm, no sample, this Python {sys.executable} (median)", f"{statistics.median(ours):.2f}",
             f"{noise[sys.executable]} lines of library noise on stderr in all its runs"],
            [f"warm, no sample, other Python {other} (median)", f"{statistics.median(theirs):.2f}",
             f"{noise[other]} lines of library noise; this/other time "
             f"{statistics.median(ours) / statistics.median(theirs):.3f}"]]


def nanogpt_run(nanogpt: Path, python: str, out_dir: Path) -> float:
    command = [python, "train.py", "config/train_shakespeare_char.py", *NANOGPT_RECIPE, "--max_iters=0",
               "--eval_interval=1", f"--out_dir={out_dir}"]
    start = time.perf_counter()
    out = subprocess.run(command, cwd=nanogpt, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{out.stderr[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, help="a checkout of karpathy/nanoGPT, to time its 1-step run beside")
    parser.add_argument("--python", default=sys.executable, help="a Python with torch and numpy for nanoGPT")
    parser.add_argument("--repeat", type=int, default=3, help="warm runs of each kind (medians)")
    parser.add_argument("--data", type=Path, default=DATA, help="the Tiny Shakespeare text")
    parser.add_argument("--other_python", help="the Python of another jaxgpt install, its warm runs alternated")
    args = parser.parse_args()
    text = args.data.resolve()
    if not text.is_file():
        sys.exit(f"--data {text}: no such file (the Tiny Shakespeare text)")
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    try:
        run_dir, cache = work / "run", work / "xla"
        jaxgpt_run(text, run_dir, work / "xla-untimed", sample=True)  # token cache, matmul peak, OS cache
        cold, programs = jaxgpt_run(text, run_dir, cache, sample=True, log_compiles=True)
        warm = [jaxgpt_run(text, run_dir, cache, sample=True)[0] for _ in range(args.repeat)]
        bare = [jaxgpt_run(text, run_dir, cache, sample=False)[0] for _ in range(args.repeat)]
        other = compared(text, run_dir, cache, args.other_python, args.repeat) if args.other_python else []
        nano = None
        if args.nanogpt:
            nanogpt = args.nanogpt.resolve()
            prepare_nanogpt_data(nanogpt, args.python, text)
            nanogpt_run(nanogpt, args.python, work / "nanogpt")  # untimed, as jaxgpt's first
            nano = [nanogpt_run(nanogpt, args.python, work / "nanogpt") for _ in range(args.repeat)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        ["jaxgpt, cold compilation cache, with its sample", f"{cold:.2f}",
         f"≤ {TARGETS['cold']:g} s: {'ok' if cold <= TARGETS['cold'] else 'MISSED'}"],
        ["jaxgpt, warm, with its sample (median)", f"{statistics.median(warm):.2f}",
         f"≤ {TARGETS['warm']:g} s: {'ok' if statistics.median(warm) <= TARGETS['warm'] else 'MISSED'}"],
        ["jaxgpt, warm, no sample (median)", f"{statistics.median(bare):.2f}", ""],
    ]
    rows += other
    if nano:
        rows.append(["nanoGPT, max_iters=0 (median)", f"{statistics.median(nano):.2f}",
                     f"jaxgpt without its sample: {statistics.median(nano) / statistics.median(bare):.2f}× its speed"])
    print_table(["1-step run, whole process", "wall s", "target / ratio"], rows)
    print(f"programs compiled in the cold run ({len(programs)}): {', '.join(programs)}")


if __name__ == "__main__":
    main()
