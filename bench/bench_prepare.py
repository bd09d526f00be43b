"""Preparation at scale: peak memory against corpus size, throughput against workers, and a
kill -9 in the middle of a preparation resumed to the same bytes; or, with --large, a corpus of
large documents prepared with a BPE tokenizer trained in the preparation, 1 worker against 2.

    python bench/bench_prepare.py [--scale 1.0] [--workdir DIR] [--keep]
    python bench/bench_prepare.py --large [--size_mb 200] [--document_mb 5] [--runs 3]
    python bench/bench_prepare.py --small_files [--size_mb 300] [--runs 3]

The corpus (≥ 1 GB at --scale 1) is generated: the standard library's .py files copied over
and over, each copy changed deterministically (some identifiers renamed, a header naming the
copy), plus tinyshakespeare when it is in the shared/ folder beside the repo. Its thirds are
directories, so 0.25, 0.5 and 1 × scale GB corpora are a directory, a glob of two and the
whole. Every preparation runs in its own process (as `python -m jaxgpt.data` would)
with byte-level BPE 8192, trained once on a sample and then given as a file, so the rows
measure reading, encoding and writing, not BPE training (whose time is printed apart).

Memory: the peak resident memory of the preparing process (its VmHWM on Linux, else its
ru_maxrss, which Linux carries over from the parent across exec), the largest of its encoding
workers (RUSAGE_CHILDREN: on Linux at least the preparing process's size when they started)
and, when psutil is installed, the peak of the whole process tree's sum sampled every 50 ms.
Throughput: MB of text per second with 1 and 2 workers, and their ratio (measured side by side
on this machine). Resume: the 1 × scale corpus prepared with 2 workers and killed (SIGKILL)
halfway through its uninterrupted time, then prepared again: the shards must equal the
uninterrupted ones byte for byte.

--large: documents of --document_mb MB (--size_mb MB in all) of made-up words drawn by Zipf's
law from a 400,000-word vocabulary, the same every time (seeded). Each run prepares it with
data.tokenizer=bpe, vocab_size 8192 (the default sample, 200 MB, so the tokenizer learns from the
whole train split), once with 1 worker and once with 2, alternating, each in a new process. The
table gives the median wall time of the runs (the process's whole life) and CPU time (the process's
and its workers', which other processes on the machine sway less), 2 workers against 1, and
the peak resident memory of the whole process tree (parent and workers summed, sampled every
50 ms); the tokenizers and the shards must be the same bytes. Each run also says how much CPU other processes
took meanwhile (in cores, from the machine's busy time less the run's own): on a shared machine,
runs where it is not near 0 do not measure the preparation alone.

--small_files: the same runs and table as --large, on a corpus of --size_mb MB of many small
files (the stdlib copies above, ~10 KB each) instead of large documents: the sample is then
many documents, whose distinct pieces the workers count.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from table import print_table  # noqa: E402  (bench/table.py: this script's folder is on sys.path)

from jaxgpt import tokenizers  # noqa: E402

try:
    import psutil
except ImportError:  # the tree's sum is then left out
    psutil = None

SHAKESPEARE = Path(__file__).resolve().parents[1] / ".." / "shared/data/tinyshakespeare.txt"
PARTS = (("part-a", 0.25), ("part-b", 0.25), ("part-c", 0.5))  # fractions of the full corpus
RENAMED = ("self", "value", "result", "name", "data", "path", "args", "item", "key", "node")
VOCAB_SIZE = 8192

CHILD = """
import json, os, resource, sys, time
from jaxgpt import data
start = time.perf_counter()
corpus = data.prepare(json.loads(sys.argv[1]))
took = time.perf_counter() - start
splits = corpus.meta["splits"].values()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # on Linux, at least the parent's peak at exec
if os.path.exists("/proc/self/status"):  # this process's own peak
    peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": took, "bytes": sum(s["bytes"] for s in splits), "tokens": sum(s["tokens"] for s in splits),
                  "self_rss": peak,
                  "worker_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                  "directory": str(corpus.directory)}))
"""
SAMPLE_SECONDS = 0.05  # how often the process tree's memory is sampled


def one_copy(text: str, copy: int) -> str:
    """A deterministic variation of a source file for copy number `copy`."""
    rng = random.Random(copy)
    for word in rng.sample(RENAMED, 3):
        text = re.sub(rf"\b{word}\b", f"{word}_{rng.randrange(1000)}", text)
    return f"# copy {copy}\n{text}"


def generate(root: Path, total_bytes: int) -> None:
    """Fill root/part-* with varied text: PARTS' fractions of `total_bytes`."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts = [f.read_text("utf-8", "replace") for f in files if "test" not in f.parts and f.stat().st_size < 500_000]
    if SHAKESPEARE.is_file():
        texts.append(SHAKESPEARE.read_text("utf-8"))
    copy = 0
    for name, fraction in PARTS:
        part, written = root / name, 0
        while written < fraction * total_bytes:
            directory = part / f"copy-{copy:05d}"
            directory.mkdir(parents=True)
            for i, text in enumerate(texts):
                content = one_copy(text, copy).encode()
                (directory / f"{i:05d}.txt").write_bytes(content)
                written += len(content)
                if written >= fraction * total_bytes:
                    break
            copy += 1


def prepare(cfg: dict, kill_after: float | None = None) -> dict | None:
    """Prepare `cfg` in a new process; its measurements (None when it was killed after
    `kill_after` seconds), with the process tree's peak sampled by psutil."""
    busy, ours = busy_seconds(), children_seconds()
    process = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg)], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    start, tree_peak = time.perf_counter(), 0
    while process.poll() is None:
        if kill_after is not None and time.perf_counter() - start > kill_after:
            process.send_signal(signal.SIGKILL)
            process.wait()
            return None
        tree_peak = max(tree_peak, tree_rss(process.pid))
        time.sleep(SAMPLE_SECONDS)
    output = process.stdout.read().decode()
    if process.returncode:
        raise SystemExit(f"preparing {cfg['source']} failed (exit {process.returncode})")
    wall = time.perf_counter() - start  # with the process's start, which `seconds` leaves out
    cpu = children_seconds() - ours  # the preparation's and its workers'
    others = (busy_seconds() - busy) - cpu  # the CPU that other processes took meanwhile
    return {**json.loads(output.strip().splitlines()[-1]), "tree_rss": tree_peak, "wall": wall,
            "others_cores": others / wall, "cpu": cpu}


def busy_seconds() -> float:
    """The CPU seconds every core of the machine has spent busy (NaN without psutil)."""
    if psutil is None:
        return math.nan
    times = psutil.cpu_times()
    spent_elsewhere = sum(getattr(times, name, 0.0) for name in ("idle", "iowait", "guest", "guest_nice"))
    return sum(times) - spent_elsewhere  # guest time is counted in user time already


def children_seconds() -> float:
    """The CPU seconds of this process's finished children (a preparation and its workers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tree_rss(pid: int) -> int:
    if psutil is None:
        return 0
    try:
        parent = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)])
    except psutil.Error:
        return 0


def shard_bytes(directory: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(directory).glob("*.bin"))} | \
        {"meta.json": Path(directory, "meta.json").read_bytes()}


def shards_sha256(directory: str) -> str:
    """SHA-256 of the token shards, one after the other, and of meta.json."""
    digest = hashlib.sha256()
    for path in [*sorted(Path(directory).glob("*.bin")), Path(directory, "meta.json")]:
        with open(path, "rb") as file:
            while chunk := file.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def mb(value: float) -> str:
    return f"{value / 1e6:,.0f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="corpus size in GB (1 = 1 GB; try 0.01)")
    parser.add_argument("--workdir", type=Path, default=None, help="for the corpus and caches (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the workdir")
    parser.add_argument("--sample-mb", type=float, default=5.0, help="text the BPE tokenizer is trained on")
    parser.add_argument("--large", action="store_true", help="large documents, BPE trained in the preparation")
    parser.add_argument("--small_files", action="store_true",
                        help="as --large, on a corpus of many small files (--size_mb MB of stdlib copies)")
    parser.add_argument("--size_mb", type=float, default=None, help="--large (200) / --small_files (300): the size")
    parser.add_argument("--document_mb", type=float, default=5.0, help="--large: each document's size")
    parser.add_argument("--runs", type=int, default=3,
                        help="--large / --small_files: runs of each worker count (the median)")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_prepare-"))
    try:
        if args.large or args.small_files:
            size_mb = args.size_mb or (300.0 if args.small_files else 200.0)
            large_case(workdir, size_mb, args.document_mb, args.runs, small_files=args.small_files)
        else:
            run(workdir, args.scale, args.sample_mb)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def run(workdir: Path, scale: float, sample_mb: float) -> None:
    corpus = workdir / "corpus"
    start = time.perf_counter()
    generate(corpus, int(scale * 1e9))
    print(f"generated {scale:g} GB of text in {corpus} in {time.perf_counter() - start:.0f} s")
    tokenizer_file = train_tokenizer(corpus, workdir, sample_mb)
    base = {"tokenizer": str(tokenizer_file), "val_fraction": 0.01, "shard_tokens": max(100_000, int(scale * 2e7)),
            "encode_batch_bytes": max(1 << 14, int(min(scale, 1.0) * (1 << 22)))}  # the default at scale 1
    sizes = ((0.25, str(corpus / "part-a")), (0.5, str(corpus / "part-[ab]")), (1.0, str(corpus)))

    def measure(label: str, source: str, workers: int) -> dict:
        cache = workdir / f"cache-{label}"
        result = prepare({**base, "source": source, "cache_dir": str(cache), "workers": workers})
        shutil.rmtree(cache)
        return result

    rows, full = [], {}
    for fraction, source in sizes:
        full[fraction] = result = measure(f"{fraction}", source, 2)
        rows.append((f"{fraction * scale:g} GB, 2 workers", mb(result["bytes"]), mb(result["self_rss"]),
                     mb(result["worker_rss"]), mb(result["tree_rss"]) if psutil else "-",
                     f"{result['bytes'] / result['seconds'] / 1e6:.1f}"))
    single = measure("1w", str(corpus), 1)
    rows.append((f"{scale:g} GB, 1 worker", mb(single["bytes"]), mb(single["self_rss"]), mb(single["worker_rss"]),
                 mb(single["tree_rss"]) if psutil else "-", f"{single['bytes'] / single['seconds'] / 1e6:.1f}"))
    print_table(("corpus", "text MB", "peak MB (main)", "peak MB (worker)", "peak MB (tree)", "MB/s"), rows)
    two = full[1.0]
    ratio = (two["bytes"] / two["seconds"]) / (single["bytes"] / single["seconds"])
    print(f"\n2 workers / 1 worker: {ratio:.2f}× the throughput\n")
    resume_row(workdir, {**base, "source": str(corpus), "workers": 2})


def train_tokenizer(corpus: Path, workdir: Path, sample_mb: float) -> Path:
    """Byte-level BPE 8192 trained on the first `sample_mb` MB of the corpus, saved."""
    texts, size = [], 0
    for file in sorted(corpus.rglob("*.txt")):
        texts.append(file.read_text("utf-8"))
        size += len(texts[-1])
        if size > sample_mb * 1e6:
            break
    start = time.perf_counter()
    tokenizer = tokenizers.train_tokenizer("bpe", texts, VOCAB_SIZE)
    print(f"trained BPE {VOCAB_SIZE} on {size / 1e6:.1f} MB in {time.perf_counter() - start:.0f} s\n")
    path = workdir / "bpe.json"
    tokenizer.save(path)
    return path


def resume_row(workdir: Path, cfg: dict) -> None:
    """Kill a preparation halfway, resume it, compare with an uninterrupted one."""
    straight = prepare({**cfg, "cache_dir": str(workdir / "cache-straight")})
    killed_cfg = {**cfg, "cache_dir": str(workdir / "cache-killed")}
    assert prepare(killed_cfg, kill_after=straight["wall"] / 2) is None
    resumed = prepare(killed_cfg)
    identical = shard_bytes(resumed["directory"]) == shard_bytes(straight["directory"])
    print_table(("resume", "uninterrupted s", "resumed s (after a kill at half)", "byte-identical"),
                [("kill -9 at half, then resume", f"{straight['seconds']:.1f}", f"{resumed['seconds']:.1f}",
                  "yes" if identical else "NO")])
    if not identical:
        raise SystemExit("the resumed preparation differs from the uninterrupted one")


def large_case(workdir: Path, size_mb: float, document_mb: float, runs: int, small_files: bool = False) -> None:
    """Prepare a corpus of large documents (or of many small files) with BPE trained in the preparation: 1 and 2
    workers, alternating."""
    print(f"CPU: {cpu_model()}")
    corpus = workdir / ("small" if small_files else "large")
    start = time.perf_counter()
    if small_files:
        generate(corpus, int(size_mb * 1e6))
        files = sum(1 for _ in corpus.rglob("*.txt"))
        print(f"generated {files:,} files ({size_mb:g} MB) in {time.perf_counter() - start:.0f} s\n")
    else:
        count = write_large_documents(corpus, size_mb * 1e6, document_mb * 1e6)
        print(f"generated {count} documents of ~{document_mb:g} MB in {time.perf_counter() - start:.0f} s\n")
    cfg = {"source": str(corpus), "tokenizer": "bpe", "vocab_size": VOCAB_SIZE, "val_fraction": 0.01}
    results: dict[int, list[dict]] = {1: [], 2: []}
    for run in range(runs):
        for workers in (1, 2):
            cache = workdir / f"cache-large-{workers}"
            result = prepare({**cfg, "workers": workers, "cache_dir": str(cache)})
            result["tokenizer"] = hashlib.sha256(Path(result["directory"], "tokenizer.json").read_bytes()).hexdigest()
            result["shards"] = shards_sha256(result["directory"])
            results[workers].append(result)
            shutil.rmtree(cache)
            print(f"run {run + 1}, {workers} worker(s): {result['wall']:.1f} s ({result['cpu']:.1f} s of CPU), "
                  f"tree peak {mb(result['tree_rss'])} MB "
                  f"(main {mb(result['self_rss'])}, largest worker {mb(result['worker_rss'])}), "
                  f"other processes {result['others_cores']:.2f} cores")
    wall = {workers: statistics.median(r["wall"] for r in rows) for workers, rows in results.items()}
    peak = {workers: statistics.median(r["tree_rss"] for r in rows) for workers, rows in results.items()}
    same = len({r["tokenizer"] for rows in results.values() for r in rows}) == 1
    same_shards = len({r["shards"] for rows in results.values() for r in rows}) == 1
    print()
    print_table(("workers", f"wall s (median of {runs})", "CPU s (median)", "MB/s of text", "peak MB (tree, median)",
                 "peak MB (main)", "peak MB (worker)", "same tokenizer", "same shards"),
                [(str(workers), f"{wall[workers]:.1f}", f"{statistics.median(r['cpu'] for r in results[workers]):.1f}",
                  f"{results[workers][0]['bytes'] / wall[workers] / 1e6:.1f}",
                  mb(peak[workers]) if psutil else "-", mb(statistics.median(r["self_rss"] for r in results[workers])),
                  mb(statistics.median(r["worker_rss"] for r in results[workers])) if workers > 1 else "-",
                  "yes" if same else "NO", "yes" if same_shards else "NO") for workers in (1, 2)])
    highest = max(r["tree_rss"] for rows in results.values() for r in rows)
    print(f"\n2 workers / 1 worker: {wall[1] / wall[2]:.2f}× faster end to end (goal ≥ 1.8×); "
          f"peak of the process tree {mb(highest)} MB at most (goal ≤ 1,000 MB)")
    busiest = max(r["others_cores"] for rows in results.values() for r in rows)
    if busiest > 0.1:
        print(f"note: other processes took up to {busiest:.2f} of the cores during these runs: the times are not "
              "those of a quiet machine")
    if not same_shards:
        raise SystemExit("the shards written with 1 and 2 workers differ")
    if not same:
        raise SystemExit("the tokenizers trained with 1 and 2 workers differ")


def write_large_documents(root: Path, total_bytes: float, document_bytes: float) -> int:
    """Write documents of about `document_bytes` (`total_bytes` in all) of made-up words, Zipf-distributed."""
    rng = np.random.default_rng(0)
    words = made_up_words(rng, 400_000)
    rank = np.arange(len(words))
    cdf = np.cumsum(1 / (rank + 2.7))
    cdf /= cdf[-1]
    separators = np.array([" ", ", ", ". ", ".\n", "\n\n"], dtype=object)
    separator_cdf = np.array([0.85, 0.91, 0.96, 0.99, 1.0])
    root.mkdir(parents=True, exist_ok=True)
    count = max(1, round(total_bytes / document_bytes))
    for d in range(count):
        draw = np.random.default_rng([1, d])
        n = int(document_bytes / 8.8)  # a word and its separator take 8.8 bytes on average
        text = np.empty(2 * n, dtype=object)
        text[0::2] = words[np.minimum(np.searchsorted(cdf, draw.random(n)), len(words) - 1)]
        text[1::2] = separators[np.searchsorted(separator_cdf, draw.random(n))]
        (root / f"doc-{d:04d}.txt").write_text("".join(text.tolist()), encoding="utf-8")
    return count


def made_up_words(rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` words of 1–4 syllables and an ending, as an object array."""
    syllables = np.array([c + v for c in [*"bcdfghjklmnprstvwz", "th", "st", "ch", "sh", "tr"]
                          for v in [*"aeiou", "ea", "ou", "ai"]])
    endings = np.array(["", "", "", "s", "ed", "ing", "ly", "n"])
    lengths, picks = rng.integers(1, 5, count), rng.integers(0, len(syllables), (count, 4))
    ends = endings[rng.integers(0, len(endings), count)]
    return np.array(["".join(syllables[picks[i, :lengths[i]]]) + ends[i] for i in range(count)], dtype=object)


def cpu_model() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no lscpu)"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "unknown")


if __name__ == "__main__":
    main()
