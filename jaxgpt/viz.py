"""Pictures of a run, as PNG files: the loss curves."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(run_dir, out=None) -> Path:
    """Train and validation loss against step (and tokens seen, on the top axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    out = Path(out) if out else Path(run_dir) / "loss.png"
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    train = [(r["step"], r["train_loss"]) for r in records if r.get("train_loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", linewidth=1.2, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    tokens_per_step = next((r["tokens_seen"] / r["step"] for r in records if r.get("tokens_seen") and r["step"]), None)
    if tokens_per_step:
        top = ax.secondary_xaxis("top", functions=(lambda s: s * tokens_per_step, lambda t: t / tokens_per_step))
        top.set_xlabel("tokens seen")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
