"""Pictures of a run and of what its model computes, as PNG files.

    loss.png         train and validation loss against step and against tokens seen
    attention.png    the attention weights A = softmax(QKᵀ/√d_k + M) over a prompt, one
                     heatmap per head of one layer: row t is what query position t attends to
    next_token.png   p(x_{n+1} | x_1 … x_n) after a prompt: the k most likely next tokens

From the command line (each picture goes into the run directory unless --out says where):

    python -m jaxgpt.viz loss RUN_DIR [--out FILE]
    python -m jaxgpt.viz attention RUN_DIR --prompt TEXT [--layer L] [--out FILE]
    python -m jaxgpt.viz next RUN_DIR --prompt TEXT [--k K] [--out FILE]

The model sees at most block_size tokens, so a longer prompt is cropped to its last
block_size tokens, as sampling does. Figures are matplotlib `Figure` objects rather than
pyplot ones, so importing this module never changes a notebook's backend. Every picture is
900 px wide (100 dpi): small enough to commit, wide enough to read.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import jax
import numpy as np
from absl import logging as absl_logging
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

from jaxgpt.attention import FORMS
from jaxgpt.blocks import block_name, layers_as
from jaxgpt.checkpoint import CheckpointError
from jaxgpt.config import GPTConfig
from jaxgpt.decode.text import encode_prompt
from jaxgpt.errors import tidy_cli_output
from jaxgpt.files import unwritable, writable_directory
from jaxgpt.metrics import current_records, read_metrics
from jaxgpt.model import GPT
from jaxgpt.train.run import load_run

DPI = 100
WIDTH = 9.0  # inches: 900 px at DPI
MAX_TICK_LABELS = 40  # more token labels than this on an axis and only every n-th is written


# --- loss curves -------------------------------------------------------------------------------


def loss_curves(records: list[dict]) -> dict[str, list[tuple[int, int, float]]]:
    """{'train': [(step, tokens seen, loss), …], 'validation': […]} in step order."""
    records = current_records(records)
    return {
        name: [(r["step"], r["tokens_seen"], r[key]) for r in records if r.get(key) is not None]
        for name, key in (("train", "train_loss"), ("validation", "val_loss"))
    }


def plot_loss(run_dir, out=None) -> Path:
    """Train and validation loss against step (left) and against tokens seen (right)."""
    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / "loss.png"
    curves = loss_curves(read_metrics(run_dir))
    fig = Figure(figsize=(WIDTH, 3.6), dpi=DPI, layout="constrained")
    by_step, by_tokens = fig.subplots(1, 2, sharey=True)
    styles = {"train": dict(linewidth=1.2), "validation": dict(marker="o", markersize=3, linewidth=1.2)}
    for name, points in curves.items():
        if points:
            steps, tokens, losses = zip(*points, strict=True)
            by_step.plot(steps, losses, label=name, **styles[name])
            by_tokens.plot(tokens, losses, label=name, **styles[name])
    by_step.set_xlabel("step")
    by_step.set_ylabel("cross-entropy (nats/token)")
    by_tokens.set_xlabel("tokens seen")
    by_tokens.xaxis.set_major_formatter(EngFormatter())
    for ax in (by_step, by_tokens):
        ax.grid(alpha=0.3)
    if any(curves.values()):
        by_step.legend()
    fig.suptitle(f"{run_dir.name}: loss", fontsize=11)
    return save(fig, out)


def plot_curves(curves: dict[str, list[tuple[int, float]]], out, title: str = "") -> Path:
    """Validation loss against step, one line per run (a sweep's cells)."""
    fig = Figure(figsize=(WIDTH, 4.0), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    for name, points in curves.items():
        if points:
            steps, losses = zip(*points, strict=True)
            ax.plot(steps, losses, marker="o", markersize=2.5, linewidth=1.1, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("validation cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=7, ncol=2 if len(curves) > 8 else 1)
    ax.set_title(f"{title}: validation loss" if title else "validation loss", fontsize=10, parse_math=False)
    return save(fig, out)


# --- what the model computes -----------------------------------------------------------------


def cropped_context(cfg: GPTConfig, token_ids) -> np.ndarray:
    """The tokens the model sees: the last block_size of token_ids, as a (1, T) array."""
    ids = np.asarray(token_ids, np.int32).reshape(-1)[-cfg.block_size:]
    if ids.size == 0:
        raise ValueError("no tokens: give a prompt of at least one token")
    return ids[None, :]


@functools.partial(jax.jit, static_argnums=1)
def explicit_forward(params, cfg: GPTConfig, tokens):
    """The model on tokens (1, T) with its attention in the explicit form, which sows the
    weights it computes (the fused 'xla'/'cudnn' kernels compute the same function without
    ever materialising them): (logits (1, T, V), {'h_l': attention weights (1, H, T, T)})."""
    if not FORMS[cfg.attention].has_weights:
        raise ValueError(f"attention={cfg.attention!r} has no attention weights to draw (no softmax over the keys): "
                         "draw a model with softmax attention")
    # GPT(cfg) runs the explicit kernel with the blocks per layer
    logits, state = GPT(cfg).apply({"params": layers_as(params, False)}, tokens, mutable=["intermediates"])
    weights = {name: layer["attn"]["attention_weights"][0] for name, layer in state["intermediates"].items()}
    return logits, weights


def attention_maps(params, cfg: GPTConfig, token_ids, layer: int) -> np.ndarray:
    """The attention weights (H, T, T) of every head of `layer` over the tokens (cropped to
    the last block_size), as the model computes them: row t holds
    A[t, s] = softmax_s(q_t·k_s/√d_k + M[t, s]). layer counts from 0; negative values count
    from the last layer."""
    if not -cfg.n_layer <= layer < cfg.n_layer:
        raise ValueError(f"layer {layer} is out of range: the model has layers 0…{cfg.n_layer - 1}")
    _, weights = explicit_forward(params, cfg, cropped_context(cfg, token_ids))
    return np.asarray(weights[block_name(layer % cfg.n_layer)][0], np.float32)


def next_token_distribution(params, cfg: GPTConfig, token_ids, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely next tokens after token_ids and their probabilities under
    p = softmax(logits at the last position), most likely first: (ids (k,), probs (k,))."""
    if k < 1:
        raise ValueError(f"k must be a positive integer (how many tokens to show), got {k}")
    logits, _ = explicit_forward(params, cfg, cropped_context(cfg, token_ids))
    z = np.asarray(logits[0, -1], np.float64)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    ids = np.argsort(-probs, kind="stable")[:k]
    return ids, probs[ids]


# --- drawing them ----------------------------------------------------------------------------


def token_labels(tokenizer, token_ids) -> list[str]:
    """Each token as its text in quotes, so spaces and newlines show: ' the', '\\n'."""
    return [repr(tokenizer.decode([int(i)], keep_special=True)) for i in token_ids]


def plot_attention(weights, labels: list[str], out, title: str = "") -> Path:
    """Heatmaps of attention weights (H, T, T), one per head, tokens on both axes: the row
    is the query position, the column the key position it attends to."""
    weights = np.asarray(weights)
    n_head, T = weights.shape[0], weights.shape[-1]
    columns = math.ceil(math.sqrt(n_head))
    rows = math.ceil(n_head / columns)
    panel = (WIDTH - 1.2) / columns  # square heatmaps side by side; the colour bar takes the rest
    fig = Figure(figsize=(WIDTH, rows * panel + 1.0), dpi=DPI, layout="compressed")  # no gaps between images
    axes = fig.subplots(rows, columns, squeeze=False, sharex=True, sharey=True)
    every = math.ceil(T / MAX_TICK_LABELS)
    ticks = np.arange(0, T, every)
    fontsize = max(4, min(8, 360 / (columns * len(ticks))))
    for h, ax in enumerate(axes.flat):
        if h >= n_head:
            ax.set_axis_off()
            continue
        image = ax.imshow(weights[h], cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xticks(ticks, [labels[t] for t in ticks], rotation=90, fontsize=fontsize, parse_math=False)
        ax.set_yticks(ticks, [labels[t] for t in ticks], fontsize=fontsize, parse_math=False)
    for ax in axes[-1]:
        ax.set_xlabel("key (attended to)", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("query (attending)", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle(title, fontsize=11, parse_math=False)
    return save(fig, out)


def plot_next_token(labels: list[str], probs, out, title: str = "") -> Path:
    """Horizontal bars of the next-token probabilities, the most likely on top."""
    probs = np.asarray(probs)
    fig = Figure(figsize=(WIDTH, 1.2 + 0.3 * len(probs)), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    positions = np.arange(len(probs))
    ax.barh(positions, probs, color="tab:blue")
    ax.set_yticks(positions, labels, parse_math=False)
    ax.invert_yaxis()
    for y, p in zip(positions, probs, strict=True):
        ax.text(p, y, f" {p:.1%}", va="center", fontsize=8)
    ax.set_xlim(0, min(1.0, 1.15 * float(probs.max())))
    ax.set_xlabel("probability of the next token")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title, fontsize=10, parse_math=False)
    return save(fig, out)


def plot_reliability(report: dict, out, title: str = "") -> Path:
    """Reliability diagram of a calibration report (jaxgpt.analysis.calibration): accuracy against
    mean confidence per equal-width bin, before and after temperature scaling, with the bins'
    counts below; the diagonal is perfect calibration."""
    fig = Figure(figsize=(WIDTH, 4.2), dpi=DPI, layout="constrained")
    curves, counts = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    curves.plot([0, 1], [0, 1], color="0.6", linewidth=1, linestyle="--", label="perfectly calibrated")
    for name, t in (("before", 1.0), ("after", report["temperature"])):
        conf, acc, n = zip(*report[name]["reliability"], strict=True)
        label = f"{name}: T={t:.3f}, ECE={report[name]['ece_width']:.4f}"
        curves.plot(conf, acc, marker="o", markersize=3, linewidth=1.2, label=label)
        counts.bar(conf, n, width=0.9 / report["bins"], alpha=0.5, label=name)
    curves.set_ylabel("accuracy of the top-1 token")
    curves.legend(fontsize=8)
    counts.set_xlabel("confidence (probability of the top-1 token)")
    counts.set_ylabel("targets")
    for ax in (curves, counts):
        ax.grid(alpha=0.3)
    curves.set_title(f"{title}: reliability" if title else "reliability", fontsize=10, parse_math=False)
    return save(fig, out)


def plot_composition(scores: dict, n_head: int, out, title: str = "") -> Path:
    """Heatmaps of Q-, K- and V-composition scores between heads (rows: the earlier head, columns:
    the later one, both numbered layer·n_head + head), with lines between layers."""
    fig = Figure(figsize=(WIDTH, WIDTH / 3 + 0.6), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, len(scores))
    for ax, (kind, matrix) in zip(axes, scores.items(), strict=True):
        image = ax.imshow(np.ma.masked_invalid(matrix), vmin=0, vmax=np.nanmax(matrix) if np.isfinite(matrix).any()
                          else 1, cmap="viridis")
        for boundary in range(n_head, matrix.shape[0], n_head):
            ax.axhline(boundary - 0.5, color="white", linewidth=0.5)
            ax.axvline(boundary - 0.5, color="white", linewidth=0.5)
        ax.set_title(f"{kind.upper()}-composition", fontsize=10)
        ax.set_xlabel("later head")
        ax.set_ylabel("earlier head")
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(f"{title}: composition scores" if title else "composition scores", fontsize=11, parse_math=False)
    return save(fig, out)


def plot_spectra(spectra: dict, out, title: str = "") -> Path:
    """The singular values of every head's W_QK and W_OV, one line per head, by layer colour."""
    fig = Figure(figsize=(WIDTH, 3.4), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, (name, values) in zip(axes, spectra.items(), strict=True):
        n_layer = values.shape[0]
        for layer in range(n_layer):
            for head, head_values in enumerate(values[layer]):
                ax.semilogy(np.arange(1, len(head_values) + 1), np.maximum(head_values, 1e-12),
                            color=f"C{layer % 10}", linewidth=0.8, alpha=0.8, label=None if head else f"layer {layer}")
        ax.set_title(f"W_{name.upper()} singular values", fontsize=10)
        ax.set_xlabel("index")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=11, parse_math=False)
    return save(fig, out)


def draw_attention(params, cfg: GPTConfig, tokenizer, token_ids, out, layer: int = 0, name: str = "") -> Path:
    """The attention picture of a prompt's tokens (what `sample.py --attention_png` draws)."""
    maps = attention_maps(params, cfg, token_ids, layer)
    labels = token_labels(tokenizer, cropped_context(cfg, token_ids)[0])
    title = f"{name + ': ' if name else ''}layer {layer % cfg.n_layer} attention weights A = softmax(QKᵀ/√d_k + M)"
    return plot_attention(maps, labels, out, title)


def draw_next_token(params, cfg: GPTConfig, tokenizer, token_ids, out, k: int = 10, name: str = "") -> Path:
    """The next-token picture of a prompt's tokens: the k most likely tokens and their probabilities."""
    ids, probs = next_token_distribution(params, cfg, token_ids, k)
    prompt = tokenizer.decode([int(i) for i in cropped_context(cfg, token_ids)[0]], keep_special=True)
    shown = repr(prompt if len(prompt) <= 60 else "…" + prompt[-60:])
    title = f"{name + ': ' if name else ''}next token after {shown}"
    return plot_next_token(token_labels(tokenizer, ids), probs, out, title)


def save(fig: Figure, out) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return out


# --- command line ------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jaxgpt.viz", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    loss = commands.add_parser("loss", help="loss curves of a run (RUN_DIR/loss.png)")
    attention = commands.add_parser("attention", help="attention heatmaps of a prompt (RUN_DIR/attention.png)")
    attention.add_argument("--layer", type=int, default=0, help="which layer, from 0 (default 0; -1 the last)")
    next_token = commands.add_parser("next", help="next-token distribution after a prompt (RUN_DIR/next_token.png)")
    next_token.add_argument("--k", type=int, default=10, help="how many of the most likely tokens (default 10)")
    for command in (loss, attention, next_token):
        command.add_argument("run_dir", help="a training run's directory")
        command.add_argument("--out", help="the PNG file to write (default: in the run directory)")
    for command in (attention, next_token):
        command.add_argument("--prompt", required=True, help="the text the model reads")
    return parser.parse_args(argv)


def run(args) -> Path:
    """Draw the picture the arguments ask for; ValueError or CheckpointError for bad input."""
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist: pass the directory a training run wrote")
    out = Path(args.out) if args.out else run_dir / DEFAULT_FILES[args.command]
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory: name the PNG file to write, e.g. --out {out / out.name}.png")
    writable_directory(out.parent, "pass --out FILE to draw it elsewhere")  # before the work, not after it
    try:
        return _draw(args, run_dir, out)
    except OSError as error:
        raise unwritable(out.parent, error, "pass --out FILE to draw it elsewhere") from None


DEFAULT_FILES = {"loss": "loss.png", "attention": "attention.png", "next": "next_token.png"}


def _draw(args, run_dir: Path, out: Path) -> Path:
    if args.command == "loss":
        if not read_metrics(run_dir):
            raise ValueError(f"{run_dir} has no metrics.jsonl records yet: nothing to plot")
        return plot_loss(run_dir, out)
    params, cfg, tokenizer = load_run(run_dir)
    ids = encode_prompt(tokenizer, args.prompt)
    if args.command == "attention":
        return draw_attention(params, cfg, tokenizer, ids, out, args.layer, run_dir.name)
    return draw_next_token(params, cfg, tokenizer, ids, out, args.k, run_dir.name)


def main(argv=None) -> int:
    args = parse_args(argv)
    tidy_cli_output()
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's notes on opening checkpoints read-only
    try:
        out = run(args)
    except (ValueError, CheckpointError) as err:
        print(f"jaxgpt.viz: error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
