"""Calibration: how far to trust the model's next-token probabilities.

For each counted target with logits z (V,), the top-1 confidence is c = max softmax(z) and
the prediction is correct when that token is the target y.

    ECE   = Σ_b (n_b / N) |acc_b − conf_b|     over bins of c: equal-width [k/B, (k+1)/B),
                                               or equal-mass (B bins of equal counts, by c)
    Brier = (1/N) Σ (c − 1[correct])²          of the top-1 prediction
    T*    = argmin_T NLL(z / T)                temperature scaling

With β = 1/T, NLL(β) = mean(logsumexp(βz) − β z_y) is convex in β: NLL′(β) = mean(E_p[z] − z_y)
and NLL″(β) = mean(Var_p[z]) ≥ 0, p = softmax(βz). Newton's method on β, kept inside a
bracket where the derivative changes sign (bisection when a Newton step leaves it).
Everything here is float64 NumPy on the host, over logits gathered once.

T is fitted on one part of the targets and judged on the other (`calibration_report`): the first
half, in the text's order, fits T; ECE, NLL and Brier before and after are measured on the second
half, which the fit never saw. Measured on the targets it was fitted to, T would look better than
it is.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxgpt import data
from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT

LOGIT_BUDGET = 1 << 24  # logits kept at most (64 MiB of float32): targets = budget / vocabulary
_CHUNK = 4096  # targets per float64 pass
_FORWARDS: dict = {}


@dataclasses.dataclass(frozen=True)
class Predictions:
    """The logits (N, V) float32 of N counted targets (N,) of evaluation windows."""

    logits: np.ndarray
    targets: np.ndarray


def collect_predictions(cfg: GPTConfig, params, tokens, *, batch_size: int, stride: int | None = None,
                        max_targets: int | None = None) -> Predictions:
    """The model's logits at every counted target of `data.eval_batch`'s windows, in order,
    up to `max_targets` (default: LOGIT_BUDGET / vocab_size)."""
    if cfg not in _FORWARDS:
        _FORWARDS[cfg] = jax.jit(lambda p, x: GPT(cfg).apply({"params": p}, x))
    forward = _FORWARDS[cfg]
    limit = max_targets or max(1, LOGIT_BUDGET // cfg.vocab_size)
    logits, targets, kept = [], [], 0
    for x, y, mask in data.eval_batches(tokens, batch_size=batch_size, block_size=cfg.block_size, stride=stride):
        z = np.asarray(forward(params, x), np.float32)[mask]
        logits.append(z[: limit - kept])
        targets.append(y[mask][: limit - kept])
        kept += len(logits[-1])
        if kept >= limit:
            break
    return Predictions(np.concatenate(logits), np.concatenate(targets).astype(np.int64))


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def top1(predictions: Predictions, temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(confidence c (N,), correct (N,) bool) of the top-1 prediction of softmax(z / T)."""
    confidence, correct = [], []
    for start in range(0, len(predictions.targets), _CHUNK):
        z = predictions.logits[start:start + _CHUNK].astype(np.float64) / temperature
        confidence.append(np.exp(_log_softmax(z).max(axis=-1)))
        correct.append(z.argmax(axis=-1) == predictions.targets[start:start + _CHUNK])
    return np.concatenate(confidence), np.concatenate(correct)


def reliability(confidence: np.ndarray, correct: np.ndarray, bins: int = 15, scheme: str = "width"
                ) -> list[tuple[float, float, int]]:
    """Per non-empty bin: (mean confidence, accuracy, count); scheme 'width' or 'mass'."""
    if scheme == "width":
        index = np.minimum((confidence * bins).astype(int), bins - 1)
        groups = [np.flatnonzero(index == b) for b in range(bins)]
    elif scheme == "mass":
        groups = np.array_split(np.argsort(confidence, kind="stable"), bins)
    else:
        raise ValueError(f"scheme={scheme!r}: must be 'width' or 'mass'")
    return [(float(confidence[g].mean()), float(correct[g].mean()), len(g)) for g in groups if len(g)]


def ece(confidence: np.ndarray, correct: np.ndarray, bins: int = 15, scheme: str = "width") -> float:
    """Expected calibration error Σ_b (n_b/N) |acc_b − conf_b|."""
    n = len(confidence)
    return sum(count / n * abs(acc - conf) for conf, acc, count in reliability(confidence, correct, bins, scheme))


def brier(confidence: np.ndarray, correct: np.ndarray) -> float:
    """Brier score of the top-1 prediction: mean (c − 1[correct])²."""
    return float(np.mean((confidence - correct) ** 2))


def _nll_and_derivatives(predictions: Predictions, beta: float) -> tuple[float, float, float]:
    """NLL(β), NLL′(β), NLL″(β) for logits scaled by β = 1/T."""
    total = first = second = 0.0
    for start in range(0, len(predictions.targets), _CHUNK):
        z = predictions.logits[start:start + _CHUNK].astype(np.float64)
        y = predictions.targets[start:start + _CHUNK]
        log_p = _log_softmax(beta * z)
        p = np.exp(log_p)
        z_y = np.take_along_axis(z, y[:, None], axis=1)[:, 0]
        mean_z = (p * z).sum(axis=1)
        total += float(-np.take_along_axis(log_p, y[:, None], axis=1).sum())
        first += float((mean_z - z_y).sum())
        second += float(((p * z * z).sum(axis=1) - mean_z**2).sum())
    n = len(predictions.targets)
    return total / n, first / n, second / n


def nll(predictions: Predictions, temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of the targets under softmax(z / T), in nats."""
    return _nll_and_derivatives(predictions, 1.0 / temperature)[0]


def fit_temperature(predictions: Predictions, tolerance: float = 1e-8, max_steps: int = 100) -> float:
    """T* minimising NLL(z / T) (see the module docstring)."""
    low, high = 1e-3, 1.0
    while _nll_and_derivatives(predictions, high)[1] < 0 and high < 1e3:  # NLL still falls: widen the bracket
        low, high = high, high * 2
    beta = min(max(1.0, low), high)
    for _ in range(max_steps):
        _, slope, curvature = _nll_and_derivatives(predictions, beta)
        if slope > 0:
            high = beta
        else:
            low = beta
        step = beta - slope / curvature if curvature > 0 else math.nan
        beta = step if low < step < high else (low + high) / 2
        if high - low < tolerance or abs(slope) < tolerance:
            break
    return 1.0 / beta


def split(predictions: Predictions) -> tuple[Predictions, Predictions]:
    """(the first half of the targets, the rest), in order: the part that fits T, the part that judges it."""
    half = len(predictions.targets) // 2
    return (Predictions(predictions.logits[:half], predictions.targets[:half]),
            Predictions(predictions.logits[half:], predictions.targets[half:]))


def calibration_report(predictions: Predictions, bins: int = 15) -> dict:
    """T fitted on the first half of the targets; NLL, perplexity, ECE (equal-width and
    equal-mass), Brier and accuracy before and after temperature scaling on the second half."""
    if len(predictions.targets) < 2:
        raise ValueError(f"calibration needs at least 2 targets (one to fit the temperature, one to judge it), "
                         f"got {len(predictions.targets)}: evaluate more text")
    fit, held_out = split(predictions)
    temperature = fit_temperature(fit)
    report = {"temperature": temperature, "targets": int(len(predictions.targets)), "bins": bins,
              "fit_targets": int(len(fit.targets)), "measured_targets": int(len(held_out.targets))}
    for name, t in (("before", 1.0), ("after", temperature)):
        confidence, correct = top1(held_out, t)
        loss = nll(held_out, t)
        report[name] = {"nll": loss, "ppl": math.exp(min(loss, 50.0)), "accuracy": float(correct.mean()),
                        "ece_width": ece(confidence, correct, bins, "width"),
                        "ece_mass": ece(confidence, correct, bins, "mass"), "brier": brier(confidence, correct),
                        "reliability": reliability(confidence, correct, bins, "width")}
    return report


def format_report(report: dict) -> str:
    """The report as a small table, one row before and one after temperature scaling."""
    lines = [f"calibration over {report['targets']:,} targets ({report['bins']} bins): T fitted on the first "
             f"{report['fit_targets']:,}, measured on the other {report['measured_targets']:,}",
             f"{'':18} {'NLL':>8} {'PPL':>9} {'accuracy':>9} {'ECE width':>10} {'ECE mass':>9} {'Brier':>7}"]
    for name, t in (("before", 1.0), ("after", report["temperature"])):
        r = report[name]
        lines.append(f"{f'{name} (T={t:.3f})':18} {r['nll']:8.4f} {r['ppl']:9.3f} {r['accuracy']:9.4f} "
                     f"{r['ece_width']:10.4f} {r['ece_mass']:9.4f} {r['brier']:7.4f}")
    return "\n".join(lines)
