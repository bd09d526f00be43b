"""The lm-evaluation-harness on the same model and task: --model jaxgpt on a run against the
harness's own transformers backend (--model hf) on the run's GPT-2 export, side by side.

    python bench/bench_harness.py [--items 500] [--rounds 5] [--batch_size 16] [--n_layer 6] [--d_model 384]
                                  [--block_size 256] [--vocab_size 4096] [--text PATH]

A model of the given shape (random init; a byte-level BPE of --vocab_size tokens trained on the
first 300 kB of --text, tinyshakespeare by default, with GPT-2's one special token) is written
as a jaxgpt run and exported as GPT-2. A local multiple-choice task of --items items is made from
the text: a context of 30–120 words, and four choices of 6–14 words, the true continuation and
three taken from elsewhere. Each backend is built once (timed: "load"); then --rounds rounds,
each evaluating the task with jaxgpt and then hf (A B A B, the same batch size). The first round
(compiles, first calls) is reported apart; the table has the medians of the others: wall time,
loglikelihood requests per second, and the ratio. Last, where jaxgpt's time goes: encoding the
requests with its tokenizer against the HF tokenizer, and the scoring alone.

    python bench/bench_harness.py --cold [--items 40] [--rounds 3] [--phases]

Cold: each backend's command line in a fresh process, as a user runs it, start-up and compiles
included: `python -m jaxgpt.harness --model jaxgpt …` on the run, then `lm_eval --model hf …` on
its export (the same task, --batch_size, the harness's built-in tasks indexed as always), --rounds
times, alternating. Every jaxgpt run gets a new, empty JAX compilation cache (it is cold, the
first run on a machine); after it, "jaxgpt, warm cache" runs again with the cache it left (a
second run). The table has the medians and the ratio against hf. With --phases, one more run of
each backend under a timer of the harness's steps (start-up, indexing the tasks, building the
model, building the tasks, answering the requests) and of jaxgpt's thread (loading the run,
compiling), to say where the time goes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the task is local; the Hub is not asked
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
PHASE_CHILD, PHASES_LINE = "--phase-child", "bench_harness phases: "


def phase_child(backend: str, argv: list[str]) -> None:
    """The backend's command line (argv) with the harness's steps timed, and for jaxgpt the
    preload thread's: a line of JSON [label, start s, end s] on stderr, then its exit status."""
    begin, marks = time.perf_counter(), []

    def timed(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            start = time.perf_counter() - begin
            try:
                return original(*args, **kwargs)
            finally:
                marks.append((label, start, time.perf_counter() - begin))

        setattr(owner, name, wrapper)

    import lm_eval.api.registry as registry
    import lm_eval.evaluator as evaluator
    from lm_eval.tasks.manager import TaskManager

    timed(TaskManager, "__init__", "index the tasks")
    timed(TaskManager, "load", "build the tasks")
    timed(evaluator, "evaluate", "answer the requests")
    get_model = registry.get_model

    def timed_get_model(name):
        model = get_model(name)
        timed(model, "create_from_arg_obj", "build the model")
        return model

    registry.get_model = timed_get_model
    status = run_child(backend, argv, timed)
    marks.append(("whole process (from its first line)", 0.0, time.perf_counter() - begin))
    print(PHASES_LINE + json.dumps(marks), file=sys.stderr)
    sys.exit(status)


def run_child(backend: str, argv: list[str], timed) -> int:
    if backend == "hf":
        from lm_eval.__main__ import cli_evaluate

        sys.argv = ["lm-eval", *argv]
        cli_evaluate()
        return 0
    from jaxgpt.harness import preload
    from jaxgpt.harness.__main__ import main

    timed(preload, "load", "jaxgpt thread: load the run")
    start = preload.start

    def start_timed(*args, **kwargs):
        from jaxgpt.score import likelihood

        timed(likelihood, "prepare", "jaxgpt thread: compile")
        return start(*args, **kwargs)

    preload.start = start_timed
    return main(argv)


if __name__ == "__main__" and sys.argv[1:2] == [PHASE_CHILD]:
    phase_child(sys.argv[2], sys.argv[3:])  # before JAX is imported here: the child imports what the backend does

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from table import print_table  # noqa: E402

from jaxgpt import GPT, GPTConfig, export, tokenizers  # noqa: E402
from jaxgpt.checkpoint import Checkpoints  # noqa: E402

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
TASK = "bench_choices"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=500, help="multiple-choice items (4 requests each)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of A B; the first is reported apart")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--n_layer", type=int, default=6)
    parser.add_argument("--d_model", type=int, default=384)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--text", default=str(SHAKESPEARE), help="the text the tokenizer and the items come from")
    parser.add_argument("--cold", action="store_true",
                        help="each backend's command line in a fresh process, jaxgpt's compilation cache empty")
    parser.add_argument("--phases", action="store_true", help="with --cold: one more run of each, its steps timed")
    return parser.parse_args(argv)


def make_run(args, text: str, root: Path) -> tuple[Path, Path]:
    tokenizer = tokenizers.train_gpt2_bpe(text[:300_000], args.vocab_size, root)
    cfg = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=max(1, args.d_model // 64), d_model=args.d_model)
    params = GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    run = root / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": cfg.to_dict()}))
    tokenizer.save(run / "tokenizer.json")
    checkpoints = Checkpoints(run)
    checkpoints.save(1, {"step": jnp.int32(1), "params": params, "opt_state": ()})
    checkpoints.close()
    assert export.main(["--run_dir", str(run), "--out", str(root / "hf")]) == 0
    return run, root / "hf"


def make_task(text: str, items: int, root: Path) -> None:
    """The items (JSONL) and their task's YAML in root."""
    words, rng = text.split(), np.random.default_rng(0)
    lines = []
    for _ in range(items):
        start, length, answer = int(rng.integers(0, len(words) - 200)), int(rng.integers(30, 121)), \
            int(rng.integers(6, 15))
        context = " ".join(words[start:start + length])
        others = [int(rng.integers(0, len(words) - 20)) for _ in range(3)]
        choices = [" ".join(words[s:s + answer]) for s in (start + length, *others)]
        label = int(rng.integers(0, 4))
        choices[0], choices[label] = choices[label], choices[0]
        lines.append(json.dumps({"context": context, "choices": choices, "label": label}))
    (root / "items.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'items.jsonl'}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: \"{{context}}\"\ndoc_to_choice: choices\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n", encoding="utf-8")


def evaluate(lm, manager, batch_size: int) -> tuple[float, dict]:
    import lm_eval

    start = time.perf_counter()
    result = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=manager, batch_size=batch_size,
                                     bootstrap_iters=0, log_samples=False)
    return time.perf_counter() - start, result["results"][TASK]


def cpu_name() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "unknown")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.cold:
        return cold_main(args)
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    import jaxgpt.harness

    text = Path(args.text).read_text(encoding="utf-8")
    root = Path(tempfile.mkdtemp(prefix="bench-harness-"))
    run, hf_dir = make_run(args, text, root)
    make_task(text, args.items, root)
    manager = TaskManager(include_path=str(root), include_defaults=False)
    loads, models = {}, {}
    for name, build in (("jaxgpt", lambda: jaxgpt.harness.JaxGPT(run_dir=str(run), batch_size=args.batch_size)),
                        ("hf", lambda: HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu",
                                            batch_size=args.batch_size))):
        start = time.perf_counter()
        models[name] = build()
        loads[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {"jaxgpt": [], "hf": []}
    metrics = {}
    for _ in range(args.rounds):
        for name in ("jaxgpt", "hf"):
            seconds, metrics[name] = evaluate(models[name], manager, args.batch_size)
            times[name].append(seconds)
    report(args, times, loads, metrics, models, root)


def report(args, times, loads, metrics, models, root: Path) -> None:
    requests = 4 * args.items
    later = {name: values[1:] or values for name, values in times.items()}
    median = {name: statistics.median(values) for name, values in later.items()}
    print(f"lm-evaluation-harness, {args.items} items × 4 choices = {requests} loglikelihood requests; model "
          f"{args.n_layer}×{args.d_model}, block {args.block_size}, BPE {args.vocab_size}; batch {args.batch_size}; "
          f"{args.rounds} rounds (A B), medians of rounds 2…; jax {jax.__version__} on {jax.devices()[0].platform}; "
          f"CPU: {cpu_name()}")
    rows = [[name, f"{loads[name]:.2f}", f"{times[name][0]:.2f}", f"{median[name]:.2f}",
             f"{requests / median[name]:.0f}", f"{median['hf'] / median[name]:.2f}×",
             f"{metrics[name]['acc,none']:.3f}"] for name in ("jaxgpt", "hf")]
    print_table(["backend", "load s", "round 1 s", "wall s (median)", "requests/s", "speed vs hf", "acc"], rows)
    where_time_goes(models, root)


def where_time_goes(models, root: Path) -> None:
    """Encoding every request string with each tokenizer; jaxgpt's scoring alone."""
    from jaxgpt.score import likelihood

    items = [json.loads(line) for line in (root / "items.jsonl").read_text(encoding="utf-8").splitlines()]
    strings = [item["context"] + " " + choice for item in items for choice in item["choices"]]
    jaxgpt_lm, hf_lm = models["jaxgpt"], models["hf"]
    start = time.perf_counter()
    encoded = [jaxgpt_lm.tok_encode(s) for s in strings]
    ours = time.perf_counter() - start
    start = time.perf_counter()
    for s in strings:
        hf_lm.tok_encode(s)
    theirs = time.perf_counter() - start
    pairs = [(ids[:-4], ids[-4:]) for ids in encoded]
    start = time.perf_counter()
    likelihood.score_continuations(jaxgpt_lm.model, jaxgpt_lm.params, pairs, batch_size=jaxgpt_lm.batch_size)
    scoring = time.perf_counter() - start
    print(f"where jaxgpt's time goes: encoding the {len(strings)} request strings {ours:.2f} s (the HF tokenizer: "
          f"{theirs:.2f} s; the harness encodes each context twice more); scoring them alone {scoring:.2f} s")


# --- cold: each backend's command line in a fresh process ------------------------------------------


def cold_main(args) -> None:
    text = Path(args.text).read_text(encoding="utf-8")
    root = Path(tempfile.mkdtemp(prefix="bench-harness-cold-"))
    run, hf_dir = make_run(args, text, root)
    make_task(text, args.items, root)
    commands = cold_commands(args, run, hf_dir, root)
    for name in ("jaxgpt", "hf"):  # untimed: what a second process finds anyway (files in the OS's cache)
        run_command(commands[name], jaxgpt_cache(root, "untimed"))
    times: dict[str, list[float]] = {"jaxgpt": [], "hf": [], "jaxgpt, warm cache": []}
    accs: dict[str, set] = {name: set() for name in times}
    for number in range(args.rounds):
        cache = jaxgpt_cache(root, f"round{number}")
        for name, command in (("jaxgpt", commands["jaxgpt"]), ("hf", commands["hf"]),
                              ("jaxgpt, warm cache", commands["jaxgpt"])):
            seconds, acc = run_command(command, cache)
            times[name].append(seconds)
            accs[name].add(acc)
    cold_report(args, times, accs)
    if args.phases:
        phases_report(args, commands, root)
    shutil.rmtree(root, ignore_errors=True)


def cold_commands(args, run: Path, hf_dir: Path, root: Path) -> dict[str, list[str]]:
    common = ["--tasks", TASK, "--include_path", str(root), "--batch_size", str(args.batch_size)]
    lm_eval_cli = Path(sys.executable).with_name("lm_eval")
    hf = [str(lm_eval_cli)] if lm_eval_cli.exists() else [sys.executable, "-m", "lm_eval"]
    return {"jaxgpt": [sys.executable, "-m", "jaxgpt.harness", "--model", "jaxgpt", "--model_args", f"run_dir={run}",
                       *common],
            "hf": [*hf, "--model", "hf", "--model_args", f"pretrained={hf_dir},dtype=float32", "--device", "cpu",
                   *common]}


def jaxgpt_cache(root: Path, name: str) -> Path:
    """A compilation cache directory of its own, empty."""
    path = root / "xla" / name
    shutil.rmtree(path, ignore_errors=True)
    return path


def run_command(command: list[str], cache: Path) -> tuple[float, str]:
    """(wall seconds, the task's acc as the harness prints it) of a command line, run in a fresh process."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if out.returncode:
        sys.exit(f"{' '.join(command)} failed (status {out.returncode}):\n{out.stderr[-3000:]}")
    return seconds, table_acc(out.stdout)


def table_acc(stdout: str) -> str:
    """The acc of the task's row in the harness's results table (|task|version|filter|n-shot|acc|↑|value|…)."""
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if TASK in cells and "acc" in cells:
            return cells[cells.index("acc") + 2]
    return "?"


def cold_report(args, times: dict[str, list[float]], accs: dict[str, set]) -> None:
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"lm-evaluation-harness command lines, cold: {args.items} items × 4 choices = {4 * args.items} "
          f"loglikelihood requests; model {args.n_layer}×{args.d_model}, block {args.block_size}, BPE "
          f"{args.vocab_size}; --batch_size {args.batch_size}; {args.rounds} rounds (jaxgpt, hf, jaxgpt again), a new "
          f"compilation cache each round; jax {jax.__version__}; CPU: {cpu_name()} ({os.cpu_count()} cores)")
    rows = [[name, " ".join(f"{t:.1f}" for t in times[name]), f"{median[name]:.2f}",
             f"{median['hf'] / median[name]:.2f}×", ", ".join(sorted(accs[name]))] for name in times]
    print_table(["backend", "rounds s", "wall s (median)", "speed vs hf", "acc"], rows)


def phases_report(args, commands: dict[str, list[str]], root: Path) -> None:
    """One more run of each backend with its steps timed (bench_harness.py --phase-child)."""
    found = {}
    for name in ("jaxgpt", "hf"):
        command = [sys.executable, str(Path(__file__).resolve()), PHASE_CHILD, name,
                   *commands[name][commands[name].index("--model"):]]
        env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(jaxgpt_cache(root, "phases"))}
        out = subprocess.run(command, capture_output=True, text=True, env=env)
        lines = [line for line in out.stderr.splitlines() if line.startswith(PHASES_LINE)]
        if out.returncode or not lines:
            sys.exit(f"{' '.join(command)} failed (status {out.returncode}):\n{out.stderr[-3000:]}")
        found[name] = json.loads(lines[-1][len(PHASES_LINE):])
    print("\nwhere the time goes (one more cold run of each, its steps timed: start → end s from its first line)")
    labels = list(dict.fromkeys(label for marks in found.values() for label, _, _ in marks))
    rows = [[label, *(" ; ".join(f"{a:.1f} → {b:.1f} ({b - a:.1f})" for lab, a, b in found[name] if lab == label)
                      or "-" for name in ("jaxgpt", "hf"))] for label in labels]
    print_table(["step", "jaxgpt", "hf"], rows)


if __name__ == "__main__":
    main()
