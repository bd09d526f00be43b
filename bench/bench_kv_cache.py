"""KV-cache memory of multi-head, grouped-query and multi-query attention on GPT-2 small's shape.

    python bench/bench_kv_cache.py

The bytes are those of the arrays `init_cache` makes (read from their abstract shapes, nothing
is allocated), per cached token and for one full context of block_size tokens: keys and values
of every layer, 2·n_layer·n_kv_head·head_dim numbers per token. GQA and MQA shrink them by
n_head/n_kv_head; the parameters shrink only by the smaller K and V projections.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from table import print_table  # noqa: E402

from jaxgpt import GPTConfig, init_cache, param_count  # noqa: E402

GPT2_124M = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, d_model=768)
KINDS = (("MHA", 12), ("GQA", 4), ("GQA", 2), ("MQA", 1))


def cache_bytes(cfg: GPTConfig, dtype) -> int:
    """Bytes of the keys and values of a one-row cache of block_size slots."""
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, dtype=dtype))
    return sum(a.size * a.dtype.itemsize for a in cache.keys + cache.values)


def main():
    rows = []
    for kind, n_kv_head in KINDS:
        cfg = GPT2_124M.replace(n_kv_head=n_kv_head)
        per_token = {name: cache_bytes(cfg, dtype) // cfg.block_size
                     for name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16))}
        assert per_token["float32"] == 2 * cfg.n_layer * n_kv_head * cfg.head_dim * 4
        rows.append((f"{kind} (n_kv_head={n_kv_head})", f"{per_token['float32'] / 1024:.1f}",
                     f"{per_token['bfloat16'] / 1024:.1f}", f"{per_token['float32'] * cfg.block_size / 2**20:.1f}",
                     f"{cfg.n_head // n_kv_head}×", f"{param_count(cfg) / 1e6:.2f}"))
    print("GPT-2 small shape (12 layers, 12 heads of 64, block 1024)")
    print_table(("attention", "KiB/token f32", "KiB/token bf16", "MiB/context f32", "smaller by", "params (M)"), rows)


if __name__ == "__main__":
    main()
