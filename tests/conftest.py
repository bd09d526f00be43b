"""Shared test settings.

XLA's compiled programs are cached on disk for the session, so the many small training runs
of the suite compile each distinct program once (subprocesses inherit the cache through
JAX_COMPILATION_CACHE_DIR)."""

import os
import tempfile

import jax
import numpy as np
import pytest

_CACHE = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jaxgpt-xla-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
