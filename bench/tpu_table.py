"""The README's table of GPT-2 shapes compiled for TPU slices: for each (model, topology,
mesh) row, the largest batch that fits and the remat setting with the best roofline bound,
each point compiled by `python -m jaxgpt.compile` (needs the tpu extra; no TPU).

    python bench/tpu_table.py [--rows 124m-v5e-dp,...] [--loss_chunk 0] [--out DIR]

A point is rows per device r and compute.remat: r doubles from the row's first value while
the train step fits the chip's HBM without remat, then goes on doubling with remat while it
fits; between the largest r that fits and the double that does not, r is then bisected to a
quarter of r (remat as the last fit). Of the largest fitting point of each remat setting, the row reports the one
with the higher MFU bound. --loss_chunk N: compute.loss_chunk (default 4096, the GPT-2 presets'; 0: the
whole logits). Every figure is an upper bound from XLA's counts (jaxgpt.compile's table says how).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # GPT-2's shapes; the vocabulary padded to a multiple of 64
    "124m": dict(n_layer=12, n_head=12, d_model=768),
    "350m": dict(n_layer=24, n_head=16, d_model=1024),
    "774m": dict(n_layer=36, n_head=20, d_model=1280),
    "1.5b": dict(n_layer=48, n_head=25, d_model=1600),
}
# name: (shape, topology, devices, fsdp, first rows per device: where the search starts, a point that fits
# with the chunked loss, so that the doubling search takes few compiles)
ROWS = {
    "124m-v5e-dp": ("124m", "v5e:2x4", 8, 1, 32),
    "124m-v5e-fsdp": ("124m", "v5e:2x4", 8, 8, 64),
    "124m-v4-dp": ("124m", "v4:2x2x1", 4, 1, 64),
    "124m-v4-fsdp": ("124m", "v4:2x2x1", 4, 4, 64),
    "350m-v5e1": ("350m", "v5e:1x1", 1, 1, 8),
    "774m-v5e4": ("774m", "v5e:2x2", 4, 4, 8),
    "1.5b-v5e4": ("1.5b", "v5e:2x2", 4, 4, 4),
}


LOSS_CHUNK = [4096]  # compute.loss_chunk of every point (--loss_chunk)


def compile_point(shape: str, topology: str, devices: int, fsdp: int, rows: int, remat: bool, out: Path) -> dict | None:
    """jaxgpt.compile's JSON for one point, or None when the train step does not fit."""
    model, chunk = SHAPES[shape], LOSS_CHUNK[0]
    path = out / f"{shape}-{topology}-fsdp{fsdp}-r{rows}-remat{int(remat)}{f'-c{chunk}' if chunk else ''}.json"
    if not path.exists():
        argv = [sys.executable, "-m", "jaxgpt.compile", "--config=configs/gpt2_124m.py", f"--topology={topology}",
                f"--json={path}", *(f"--config.model.{k}={v}" for k, v in model.items()),
                f"--config.mesh.data={devices // fsdp}", f"--config.mesh.fsdp={fsdp}",
                f"--config.train.batch_size={rows * devices}", "--config.train.grad_accum=1",
                f"--config.compute.remat={remat}", "--config.compute.kernel=flash",
                f"--config.compute.loss_chunk={chunk}"]
        started = time.perf_counter()
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        print(f"  {path.name}: exit {done.returncode} in {time.perf_counter() - started:.0f} s "
              f"{done.stderr.strip().splitlines()[-1][:160] if done.returncode else ''}", flush=True)
        if done.returncode:
            return None
    report = json.loads(path.read_text())
    train = report["programs"]["train step"]
    return train if train.get("fits") else None


def best_of_row(name: str, out: Path) -> dict:
    shape, topology, devices, fsdp, first = ROWS[name]
    found, rows = {}, first
    while (train := compile_point(shape, topology, devices, fsdp, rows, False, out)) is not None:
        found[False] = (rows, train)
        rows *= 2
    # remat from the first batch that did not fit without it, doubled while it fits
    while (train := compile_point(shape, topology, devices, fsdp, rows, True, out)) is not None:
        found[True] = (rows, train)
        rows *= 2
    rows = first // 2
    while not found and rows >= 1:  # the first point did not fit at all: fewer rows, with remat
        if (train := compile_point(shape, topology, devices, fsdp, rows, True, out)) is not None:
            found[True] = (rows, train)
        rows //= 2
    if not found:
        raise SystemExit(f"{name}: not even one row per device fits, with remat")
    remat = max(found)  # the last setting that fitted: bisect between its largest rows and their double,
    low, high = found[remat][0], 2 * found[remat][0]  # to a quarter of the rows found
    while high - low > max(1, low // 4):
        middle = (low + high) // 2
        if (train := compile_point(shape, topology, devices, fsdp, middle, remat, out)) is not None:
            found[remat], low = (middle, train), middle
        else:
            high = middle
    best = max(found.items(), key=lambda item: item[1][1]["mfu_bound"])
    remat, (rows, train) = best
    return {"row": name, "model": shape, "topology": topology, "mesh": f"data={devices // fsdp}, fsdp={fsdp}",
            "rows_per_device": rows, "remat": remat, "largest": {str(k): v[0] for k, v in found.items()},
            "peak_gib": train["total"] / 2**30, "mfu_bound": train["mfu_bound"],
            "tokens_per_second_bound": train["tokens_per_second_bound"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--loss_chunk", type=int, default=LOSS_CHUNK[0])
    parser.add_argument("--out", default=str(ROOT / "runs" / "tpu_table"))
    args = parser.parse_args()
    LOSS_CHUNK[0] = args.loss_chunk
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.rows.split(","):
        results.append(best_of_row(name, out))
        print(json.dumps(results[-1]), flush=True)
    print("\n| model | topology | mesh | rows/device (largest: no remat / remat) | remat | peak GiB/device "
          "| tokens/s ≤ | MFU ≤ |\n|---|---|---|---|---|---|---|---|")
    for r in results:
        largest = " / ".join(str(r["largest"].get(k, "-")) for k in ("False", "True"))
        print(f"| {r['model']} | {r['topology']} | {r['mesh']} | {r['rows_per_device']} ({largest}) | "
              f"{r['remat']} | {r['peak_gib']:.2f} | {r['tokens_per_second_bound']:,.0f} | {r['mfu_bound']:.1%} |")


if __name__ == "__main__":
    main()
