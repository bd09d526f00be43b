"""The platform forms (jaxgpt.platforms.forms): each computes its equation's function, against a
float64 NumPy evaluation or XLA's own in float64, each is in the program of the platform it is
chosen for, and a compute config that names one computes the model's function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from test_model import random_params, tiny

from jaxgpt import GPT, ComputeConfig, ops
from jaxgpt.platforms import forms
from jaxgpt.registries import open_compute

PLATFORMS = ["cpu", "cuda", "rocm", "tpu"]

# --- RoPE -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", [*forms.ROPES, forms.AUTO])
@pytest.mark.parametrize("shape", [(1, 5, 2, 4), (2, 6, 3, 8)])
def test_every_rope_form_is_the_rotation(rng, shape, form):
    x = rng.standard_normal(shape)
    positions = rng.integers(0, 100, size=shape[:2])
    got = forms.rope(jnp.asarray(x, jnp.float32), jnp.asarray(positions), form=form)
    np.testing.assert_allclose(np.asarray(got), ref.rope(x, positions), rtol=1e-4, atol=1e-4)


def test_rope_by_lanes_equals_rope_by_pairs_in_bfloat16_and_in_its_gradient(rng):
    """The TPU's and GPU's form swaps each pair by a permutation matmul: exact in bfloat16, and its gradient
    is the pairs' (ops.rope, the CPU's form)."""
    x = jnp.asarray(rng.standard_normal((2, 7, 3, 16)), jnp.bfloat16)
    positions = jnp.asarray(rng.integers(0, 1000, size=(2, 7)))
    np.testing.assert_array_equal(np.asarray(forms.rope_lanes(x, positions), np.float32),
                                  np.asarray(ops.rope(x, positions), np.float32))
    weights = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    grads = [jax.grad(lambda x, f=f: (f(x, positions) * weights).sum())(x.astype(jnp.float32))
             for f in (forms.rope_lanes, ops.rope)]
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(grads[1]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_rope_auto_is_by_pairs_only_in_a_program_lowered_for_a_cpu(platform):
    """The lanes' permutation matmul is in every program but a CPU's (lowered here on a CPU host)."""
    rotate = jax.jit(lambda x, p: forms.rope(x, p))
    program = rotate.trace(jnp.ones((1, 4, 2, 8)), jnp.arange(4)[None]).lower(lowering_platforms=(platform,))
    assert ("dot_general" in program.as_text()) == (platform != "cpu")


# --- the weight matrices' product ----------------------------------------------------------------


@pytest.mark.parametrize("form", [*forms.MATMULS, forms.AUTO])
@pytest.mark.parametrize("shape", [(7, 5), (2, 6, 8)])
def test_every_matmul_form_and_its_gradients(rng, shape, form):
    """y = xW; ∂(Σ y⊙g)/∂x = g Wᵀ and /∂W = Σ_positions xᵀ g, against float64 NumPy."""
    x, w = rng.standard_normal(shape), rng.standard_normal((shape[-1], 3))
    g = rng.standard_normal((*shape[:-1], 3))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    np.testing.assert_allclose(np.asarray(forms.linear(f32(x), f32(w), form)), x @ w, rtol=1e-5, atol=1e-5)
    dx, dw = jax.grad(lambda x, w: (forms.linear(x, w, form) * f32(g)).sum(), argnums=(0, 1))(f32(x), f32(w))
    np.testing.assert_allclose(np.asarray(dx), g @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), x.reshape(-1, shape[-1]).T @ g.reshape(-1, 3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_product_of_few_rows_is_a_gemm_of_eight_in_a_program_lowered_for_a_gpu(platform):
    """auto on a CUDA GPU pads a product of fewer than GEMM_ROWS rows (a token decoded at batch 1) to
    GEMM_ROWS rows; a CPU's and a TPU's programs multiply the row itself."""
    product = jax.jit(lambda x, w: forms.linear(x, w))
    program = product.trace(jnp.ones((1, 1, 16)), jnp.ones((16, 32))).lower(lowering_platforms=(platform,))
    rows = f"tensor<{forms.GEMM_ROWS}x16xf32>"
    assert (rows in program.as_text()) == (platform == "cuda")


# (lhs shape, rhs shape, dimension numbers): the plain contractions y = x W that a CPU
# computes with its own gradient, and others that go to jax.lax.dot_general everywhere
DOT_GENERAL_CASES = [
    ((2, 6, 8), (8, 3), (((2,), (0,)), ((), ())), True),
    ((2, 3, 4, 5), (4, 5, 6), (((2, 3), (0, 1)), ((), ())), True),
    ((5, 4), (4, 2, 3), (((1,), (0,)), ((), ())), True),
    ((6, 8), (3, 8), (((1,), (1,)), ((), ())), False),
    ((3, 4, 5), (5, 4, 2), (((2, 1), (0, 1)), ((), ())), False),
    ((2, 6, 8), (2, 8, 3), (((2,), (1,)), ((0,), (0,))), False),
]


@pytest.mark.parametrize(("lhs_shape", "rhs_shape", "dims", "plain"), DOT_GENERAL_CASES)
def test_dot_general_and_its_gradients_equal_lax_dot_general_in_float64(rng, lhs_shape, rhs_shape, dims, plain):
    with jax.enable_x64(True):
        lhs, rhs = jnp.asarray(rng.standard_normal(lhs_shape)), jnp.asarray(rng.standard_normal(rhs_shape))
        want = jax.lax.dot_general(lhs, rhs, dims)
        g = jnp.asarray(rng.standard_normal(want.shape))

        def loss(dot):
            return lambda lhs, rhs: (dot(lhs, rhs, dims) * g).sum()

        got = forms.dot_general(lhs, rhs, dims)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)
        grad = jax.jit(jax.grad(loss(forms.dot_general), argnums=(0, 1)))
        for got_grad, want_grad in zip(grad(lhs, rhs), jax.grad(loss(jax.lax.dot_general), argnums=(0, 1))(lhs, rhs),
                                       strict=True):
            np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad), rtol=1e-12, atol=1e-12)
        assert ("optimization_barrier" in grad.lower(lhs, rhs).as_text()) == plain  # the CPU's gradient, or XLA's


def test_dot_general_keeps_precision_and_the_preferred_element_type(rng):
    """bfloat16 operands with a float32 result, as lax.dot_general gives them; the gradients
    in the operands' dtype, within bfloat16 rounding of lax.dot_general's."""
    lhs = jnp.asarray(rng.standard_normal((3, 5, 16)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((16, 4)), jnp.bfloat16)
    dims = (((2,), (0,)), ((), ()))
    options = dict(precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    got, want = forms.dot_general(lhs, rhs, dims, **options), jax.lax.dot_general(lhs, rhs, dims, **options)
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)

    def grads(dot):
        return jax.grad(lambda lhs, rhs: dot(lhs, rhs, dims, **options).sum(), argnums=(0, 1))(lhs, rhs)

    for got_grad, want_grad in zip(grads(forms.dot_general), grads(jax.lax.dot_general), strict=True):
        assert got_grad.dtype == want_grad.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got_grad, np.float32), np.asarray(want_grad, np.float32), rtol=1e-2,
                                   atol=1e-2)


def test_flax_dense_general_computes_with_dot_general(rng):
    """nn.DenseGeneral(dot_general=forms.dot_general) over two input axes: the outputs and
    gradients of Flax's own."""
    import flax.linen as nn

    x = jnp.asarray(rng.standard_normal((2, 3, 4, 5)), jnp.float32)
    ours, flax_own = (nn.DenseGeneral((2, 3), axis=(-2, -1), dot_general=dot) for dot in (forms.dot_general, None))
    params = flax_own.init(jax.random.key(0), x)

    def loss(module):
        return lambda params, x: jnp.sin(module.apply(params, x)).sum()

    np.testing.assert_allclose(np.asarray(ours.apply(params, x)), np.asarray(flax_own.apply(params, x)), rtol=1e-6,
                               atol=1e-6)
    ours_grad = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))
    for got, want in zip(jax.tree.leaves(ours_grad(params, x)),
                         jax.tree.leaves(jax.grad(loss(flax_own), argnums=(0, 1))(params, x)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert "optimization_barrier" in ours_grad.lower(params, x).as_text()  # the CPU's own gradient ran


@pytest.mark.parametrize("platform", PLATFORMS)
def test_dot_general_has_its_cpu_gradient_only_in_a_program_lowered_for_a_cpu(platform):
    """The barrier of the CPU's gradient is in the CPU's program only (auto); a GPU's or TPU's,
    lowered here on a CPU host, is XLA's own dot_general and gradient. A form chosen by name is
    the same on every platform."""
    x, w = jnp.ones((2, 6, 8)), jnp.ones((8, 3))
    for form, barrier in ((forms.AUTO, platform == "cpu"), ("cpu", True), ("xla", False)):
        step = jax.jit(jax.value_and_grad(lambda x, w, f=form: jnp.tanh(forms.linear(x, w, f)).sum(), argnums=(0, 1)))
        program = step.trace(x, w).lower(lowering_platforms=(platform,)).as_text()
        assert "stablehlo.dot_general" in program
        assert ("optimization_barrier" in program) == barrier, form


# --- chosen by the compute config ----------------------------------------------------------------


def test_each_form_the_compute_config_names_computes_the_models_function():
    """compute.rope='lanes' gives the logits of 'pairs' (this CPU's auto), and compute.matmul='xla' the
    logits and gradients of the default (this CPU's form), within float32 rounding."""
    cfg = tiny(positions="rope")
    params, tokens = random_params(cfg), jnp.array([[3, 1, 4, 1, 5, 9, 2, 6]])

    def loss_and_grad(compute):
        loss = lambda p: jnp.square(GPT(cfg, compute).apply({"params": p}, tokens)).mean()  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    logits = {rope: jax.jit(GPT(cfg, ComputeConfig(rope=rope)).apply)({"params": params}, tokens)
              for rope in ("pairs", "lanes")}
    np.testing.assert_allclose(np.asarray(logits["lanes"]), np.asarray(logits["pairs"]), rtol=1e-5, atol=1e-5)
    (loss, grads), (xla_loss, xla_grads) = loss_and_grad(ComputeConfig()), loss_and_grad(ComputeConfig(matmul="xla"))
    np.testing.assert_allclose(float(xla_loss), float(loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(xla_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("key, valid", [("matmul", "xla, cpu, gpu, auto"), ("rope", "pairs, lanes, auto")])
def test_a_form_that_does_not_exist_is_refused_in_one_line(key, valid):
    """By the compute section's opening and by the model made with it (registries.check_compute); a value
    that is no name at all by the schema."""
    for refuse in (lambda: open_compute({key: "fast"}), lambda: GPT(tiny(), ComputeConfig(**{key: "fast"}))):
        with pytest.raises(ValueError) as error:
            refuse()
        assert str(error.value) == f"ComputeConfig.{key}='fast': must be one of {valid}"
    with pytest.raises(ValueError, match=rf"^ComputeConfig.{key}=2: must be a form's name, or 'auto'$"):
        ComputeConfig(**{key: 2})


def test_a_compute_section_written_before_the_forms_reads_as_auto():
    """A run directory saved before compute.matmul and compute.rope runs as it did: 'auto'."""
    old = {"kernel": "explicit", "remat": False, "dtype": "float32", "param_dtype": "float32", "scan_layers": False,
           "weights": "float", "loss_chunk": 0}
    compute = ComputeConfig.from_dict(old)
    assert (compute.matmul, compute.rope) == (forms.AUTO, forms.AUTO) and compute == ComputeConfig()
