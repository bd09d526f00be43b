"""Shared test settings: float64 is available for NumPy references, JAX stays float32."""

import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(0)
