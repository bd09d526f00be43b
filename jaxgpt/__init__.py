"""jaxgpt: a GPT language model in JAX/Flax whose code reads like its mathematics.

The names below are imported when first used, so that `import jaxgpt.tokenizers` (e.g. in a
data-preparation worker) does not start JAX."""

import importlib

_EXPORTS = {
    "GPTConfig": "jaxgpt.model_config",
    "KVCache": "jaxgpt.caches", "LinearCache": "jaxgpt.caches", "init_cache": "jaxgpt.caches",
    "GPT": "jaxgpt.model", "flops_per_token": "jaxgpt.model", "param_count": "jaxgpt.model",
}
__all__ = ["GPT", "GPTConfig", "KVCache", "LinearCache", "init_cache", "param_count", "flops_per_token"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxgpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])
