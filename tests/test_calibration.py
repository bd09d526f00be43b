"""Calibration: ECE against closed forms, the fitted temperature against a known one, NLL against
a float64 loop (eval.py --calibration and sample.py --calibrated: tests/test_eval.py)."""

import math

import numpy as np
import pytest

from jaxgpt.analysis import calibration
from jaxgpt.analysis.calibration import Predictions


def test_ece_of_a_calibrated_predictor_is_near_zero():
    rng = np.random.default_rng(0)
    confidence = rng.uniform(0.05, 1.0, size=200_000)
    correct = rng.uniform(size=confidence.size) < confidence  # right exactly as often as it claims
    assert calibration.ece(confidence, correct, 15, "width") < 0.006
    assert calibration.ece(confidence, correct, 15, "mass") < 0.006


def test_ece_and_brier_of_a_known_miscalibrated_predictor_equal_their_closed_forms():
    # half the targets at confidence 0.8 with 50% right, half at 0.3 with 40% right
    confidence = np.array([0.8] * 10 + [0.3] * 10)
    correct = np.array([1] * 5 + [0] * 5 + [1] * 4 + [0] * 6, bool)
    assert calibration.ece(confidence, correct, 10, "width") == pytest.approx(0.5 * 0.3 + 0.5 * 0.1)
    assert calibration.ece(confidence, correct, 2, "mass") == pytest.approx(0.5 * 0.3 + 0.5 * 0.1)
    brier = (5 * 0.2**2 + 5 * 0.8**2 + 4 * 0.7**2 + 6 * 0.3**2) / 20
    assert calibration.brier(confidence, correct) == pytest.approx(brier)
    assert calibration.ece(np.full(5, 0.9), np.array([1, 1, 1, 0, 0], bool)) == pytest.approx(0.3)


def synthetic(temperature: float, n: int = 20_000, vocab: int = 20, seed: int = 0) -> Predictions:
    """Targets drawn from softmax(z); the 'model' reports z·temperature, too sharp by that factor."""
    rng = np.random.default_rng(seed)
    z = rng.normal(scale=2.0, size=(n, vocab))
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    targets = (p.cumsum(axis=1) < rng.uniform(size=(n, 1))).sum(axis=1)
    return Predictions((z * temperature).astype(np.float32), targets)


@pytest.mark.parametrize("true_t", [0.6, 1.0, 1.7, 3.0])
def test_the_fitted_temperature_recovers_a_known_one_within_its_standard_error(true_t):
    """Targets drawn from softmax(z), logits reported as z·t: the maximum-likelihood β = 1/T is
    asymptotically normal around 1/t with variance 1/(n·NLL″(1/t)) (the Fisher information of
    the n targets), so T = 1/β lies within 4 standard errors, t²/√(n·NLL″), of t (a chance of
    about 6e-5 of failing for a random seed; the seed here is fixed)."""
    predictions = synthetic(true_t)
    beta = 1 / true_t
    standard_error = true_t**2 / math.sqrt(len(predictions.targets) * calibration._nll_and_derivatives(
        predictions, beta)[2])
    assert abs(calibration.fit_temperature(predictions) - true_t) < 4 * standard_error


@pytest.mark.parametrize("true_t", [0.6, 1.0, 1.7, 3.0])
def test_the_report_fits_on_one_half_and_measures_on_the_other(true_t):
    predictions = synthetic(true_t)
    report = calibration.calibration_report(predictions)
    fit, held_out = Predictions(predictions.logits[:10_000], predictions.targets[:10_000]), \
        Predictions(predictions.logits[10_000:], predictions.targets[10_000:])
    assert (report["fit_targets"], report["measured_targets"]) == (10_000, 10_000)
    assert report["temperature"] == calibration.fit_temperature(fit)  # the measured half takes no part in the fit
    for name, t in (("before", 1.0), ("after", report["temperature"])):
        confidence, correct = calibration.top1(held_out, t)
        assert report[name]["ece_width"] == calibration.ece(confidence, correct, 15, "width")
        assert report[name]["nll"] == calibration.nll(held_out, t)
    if true_t != 1.0:  # a model off by a known factor is better calibrated on text the fit never saw
        assert report["after"]["ece_width"] < report["before"]["ece_width"]
        assert report["after"]["nll"] < report["before"]["nll"]


def test_a_report_needs_a_target_to_fit_and_one_to_measure():
    with pytest.raises(ValueError, match="at least 2 targets"):
        calibration.calibration_report(synthetic(1.0, n=1))


def test_nll_equals_a_float64_loop():
    predictions = synthetic(1.5, n=50, vocab=7, seed=1)
    for t in (0.5, 1.0, 2.0):
        expected = 0.0
        for z, y in zip(predictions.logits.astype(np.float64), predictions.targets, strict=True):
            expected -= z[y] / t - math.log(sum(math.exp(v / t) for v in z))
        assert calibration.nll(predictions, t) == pytest.approx(expected / 50, rel=1e-12)
