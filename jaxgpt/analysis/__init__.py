"""Analysis of a trained model: how far to trust its probabilities (calibration.py)."""
