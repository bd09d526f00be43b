"""The flash kernel (Pallas's TPU flash attention), run here in Pallas's TPU interpret mode:
the context and its gradients against a float64 NumPy evaluation, packed rows' segments
included, and a whole GPT (grouped-query heads, ALiBi's bias) against the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

from jaxgpt.attention import Where, kernels
from jaxgpt.registries import compute_on

pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
T = 128  # one block of the kernel's default block sizes


def packed_where(batch: int) -> Where:
    """Two examples in each row (50 and 78 tokens), their positions each from 0."""
    positions = jnp.asarray(np.tile(np.r_[np.arange(50), np.arange(78)], (batch, 1)))
    segments = jnp.asarray(np.tile(np.r_[np.ones(50), np.full(78, 2)], (batch, 1)).astype(np.int32))
    return Where(positions, positions, segments, segments)


def context(kernel, q, k, v, where):
    return kernel(q, k, v, where, lambda w: None, lambda weights, whole: weights)


def test_flash_context_and_gradients_equal_the_float64_formula():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, T, 2, 16)) for _ in range(3))
    where = packed_where(1)
    mask = np.asarray(where.mask())
    cotangent = rng.standard_normal(q.shape)

    def loss(q, k, v):
        return (context(kernels.flash, q, k, v, where) * cotangent).sum()

    with pltpu.force_tpu_interpret_mode():
        out = context(kernels.flash, *(jnp.asarray(a, jnp.float32) for a in (q, k, v)), where)
        grads = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)))
    np.testing.assert_allclose(out, ref.attention(q, k, v, mask), atol=2e-5)

    def reference_loss(x, which):  # the float64 formula's gradient by central differences along the cotangent
        args = [q, k, v]
        args[which] = x
        return (ref.attention(*args, mask) * cotangent).sum()

    for which, grad in enumerate(grads):
        direction = rng.standard_normal(q.shape)
        eps = 1e-5
        x = (q, k, v)[which]
        numeric = (reference_loss(x + eps * direction, which) - reference_loss(x - eps * direction, which)) / (2 * eps)
        assert abs(float((np.asarray(grad, np.float64) * direction).sum()) - numeric) < 1e-3 * max(1.0, abs(numeric))


def test_a_gpt_with_the_flash_kernel_equals_the_float64_reference():
    from jaxgpt.config import ComputeConfig, GPTConfig
    from jaxgpt.model import GPT

    cfg = GPTConfig(vocab_size=32, n_layer=1, n_head=4, n_kv_head=2, d_model=32, block_size=T, positions="alibi")
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 32, (1, T)), jnp.int32)
    params = GPT(cfg).init(jax.random.key(0), tokens)["params"]
    with pltpu.force_tpu_interpret_mode():
        logits = GPT(cfg, ComputeConfig(kernel="flash")).apply({"params": params}, tokens)
    np.testing.assert_allclose(logits, ref.gpt_forward(cfg, jax.device_get(params), np.asarray(tokens)), atol=1e-4)


def test_auto_is_the_kernel_of_the_platform_compiled_for():
    from jaxgpt.config import ComputeConfig

    half, full = ComputeConfig(kernel="auto", dtype="bfloat16"), ComputeConfig(kernel="auto")
    assert [compute_on(half, p).kernel for p in ("tpu", "gpu", "cpu")] == ["flash", "cudnn", "explicit"]
    assert compute_on(full, "gpu").kernel == "xla"  # cuDNN's attention computes in 16 bits only
    assert compute_on(ComputeConfig(kernel="xla"), "tpu").kernel == "xla"  # a kernel chosen by name stays
