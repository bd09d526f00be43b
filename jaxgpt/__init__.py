"""jaxgpt: a GPT language model in JAX/Flax whose code reads like its mathematics."""

from jaxgpt.caches import KVCache, LinearCache, init_cache
from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT, flops_per_token, param_count

__all__ = ["GPT", "GPTConfig", "KVCache", "LinearCache", "init_cache", "param_count", "flops_per_token"]
__version__ = "0.1.0"
