"""Analyses of a trained run from the command line:

    python -m jaxgpt.analysis circuits RUN_DIR [--top_k K] [--out DIR]

circuits: per head, the ranks of W_QK and W_OV and the share of W_OV's energy in its top K
directions; the strongest Q-, K- and V-compositions between heads; for vocabularies of at
most 4096 tokens, the tokens each head's OV circuit copies most. Writes circuits.json,
circuits_composition.png and circuits_spectra.png into the run directory (or --out).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from jaxgpt import viz
from jaxgpt.analysis import circuits
from jaxgpt.checkpoint import CheckpointError
from jaxgpt.errors import tidy_cli_output
from jaxgpt.files import unwritable, writable_directory, write_json
from jaxgpt.train.run import load_run


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jaxgpt.analysis", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    circuit = commands.add_parser("circuits", help="per-head QK/OV circuits and their composition")
    circuit.add_argument("run_dir", help="a training run's directory")
    circuit.add_argument("--top_k", type=int, default=1, help="directions counted in the OV energy share (default 1)")
    circuit.add_argument("--out", help="the directory for the JSON and pictures (default: the run directory)")
    return parser.parse_args(argv)


def circuits_report(params, cfg, tokenizer, top_k: int) -> dict:
    spectra = circuits.spectra(params, cfg)
    scores = circuits.composition(params, cfg)
    heads = [{"layer": layer, "head": head,
              "qk_rank": int(circuits.rank(spectra["qk"][layer, head])),
              "ov_rank": int(circuits.rank(spectra["ov"][layer, head])),
              f"ov_top{top_k}_energy": float(circuits.top_k_fraction(spectra["ov"][layer, head], top_k))}
             for layer in range(cfg.n_layer) for head in range(cfg.n_head)]
    strongest = {}
    for kind, matrix in scores.items():
        if np.isfinite(matrix).any():
            a, b = np.unravel_index(np.nanargmax(matrix), matrix.shape)
            strongest[kind] = {"from": divmod(int(a), cfg.n_head), "to": divmod(int(b), cfg.n_head),
                               "score": float(matrix[a, b])}
    report = {"heads": heads, "strongest_composition": strongest,
              "composition": {k: np.where(np.isfinite(v), v, None).tolist() for k, v in scores.items()}}
    if cfg.vocab_size <= circuits.MAX_TOKEN_VOCAB and tokenizer is not None:
        copies = circuits.top_copies(circuits.token_circuits(params, cfg, 0, 0)["ov"], k=3)
        shown = range(min(cfg.vocab_size, tokenizer.vocab_size))
        report["layer0_head0_copies"] = {tokenizer.decode([i], keep_special=True): [
            tokenizer.decode([int(j)], keep_special=True) for j in copies[i]] for i in shown}
    return report, spectra, scores


INSTEAD = "pass --out DIR to write circuits.json and its pictures elsewhere"


def main(argv=None) -> int:
    args = parse_args(argv)
    tidy_cli_output()
    try:
        if args.top_k < 1:
            raise ValueError(f"--top_k must be a positive integer, got {args.top_k}")
        params, cfg, tokenizer = load_run(args.run_dir)
        out = writable_directory(args.out or args.run_dir, INSTEAD)  # found before the analysis, not after it
        report, spectra, scores = circuits_report(params, cfg, tokenizer, args.top_k)
        write_report(out, Path(args.run_dir).name, report, spectra, scores, cfg.n_head)
    except (ValueError, CheckpointError) as err:
        print(f"jaxgpt.analysis: error: {err}", file=sys.stderr)
        return 2
    print_report(report, args.top_k)
    print(f"wrote {out / 'circuits.json'}, circuits_composition.png, circuits_spectra.png")
    return 0


def write_report(out: Path, name: str, report: dict, spectra: dict, scores: dict, n_head: int) -> None:
    """circuits.json and its two pictures in `out`; a ValueError in one line when they cannot be written."""
    try:
        write_json(out / "circuits.json", report)
        viz.plot_composition(scores, n_head, out / "circuits_composition.png", title=name)
        viz.plot_spectra(spectra, out / "circuits_spectra.png", title=name)
    except OSError as error:
        raise unwritable(out, error, INSTEAD) from None


def print_report(report: dict, top_k: int) -> None:
    print(f"{'layer':>5} {'head':>4} {'rank QK':>7} {'rank OV':>7} {f'OV top-{top_k}':>9}")
    for head in report["heads"]:
        print(f"{head['layer']:5d} {head['head']:4d} {head['qk_rank']:7d} {head['ov_rank']:7d} "
              f"{head[f'ov_top{top_k}_energy']:9.1%}")
    for kind, best in report["strongest_composition"].items():
        print(f"strongest {kind.upper()}-composition: layer {best['from'][0]} head {best['from'][1]} → layer "
              f"{best['to'][0]} head {best['to'][1]}: {best['score']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
