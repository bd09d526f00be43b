"""Analysis of a trained model: how far to trust its probabilities (calibration.py) and what its
attention heads compute as bilinear forms (circuits.py); `python -m jaxgpt.analysis`."""
