"""The platform forms of three equations: each the same function as its equation, computed another
way because one backend measured faster so (docs/ARCHITECTURE.md, "Backends").

    linear(x, w, form)                y = x W (ops.linear): 'xla' XLA's own product and gradient;
                                      'cpu' 2-D matmuls with a hand-written backward; 'gpu' few
                                      rows padded to a GEMM's (decoding); 'fp8' the
                                      operands and the gradient in FP8 with current scaling (fp8_matmul)
    int8_product(x, q, form)          Y = x qᵀ of int8 weights (jaxgpt.quantize.layers): 'xla' one
                                      product; 'cpu' a chunk of rows at a time
    rope(x, positions, base, form)    ops.rope: 'pairs' (ops.rope itself); 'lanes' over the whole last axis

The compute config chooses a form by name (compute.matmul: MATMULS; compute.rope: ROPES); 'fp8' is
no platform's own but an approximation, chosen per call site by compute.fp8
(ComputeConfig.for_matmul). AUTO is the form measured faster on each platform: on a CPU its own, on a
CUDA GPU the product of few rows as a GEMM ('gpu'), elsewhere XLA's (for RoPE: the lanes), chosen
when the program is lowered (jax.lax.platform_dependent): a program lowered for a GPU or TPU, even
on a CPU host, never holds a CPU form.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxgpt import ops

AUTO = "auto"  # the CPU's form on a CPU, the other elsewhere: chosen when the program is lowered

# --- the weight matrices' product ---------------------------------------------------------------


def cpu_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """jax.lax.dot_general, and for the plain contraction y = x W (lhs's last k axes against rhs's
    first k, no batch axes) `cpu_matmul` of the two flattened to matrices."""
    if not plain(lhs, dimension_numbers):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    x, w, shape = matrices(lhs, rhs, dimension_numbers)
    return cpu_matmul(x, w, precision, preferred_element_type).reshape(shape)


def plain(lhs, dimension_numbers) -> bool:
    """Whether a dot_general is y = x W: lhs's last k axes against rhs's first k, no batch axes."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    k = len(lhs_contract)
    return (not lhs_batch and not rhs_batch and tuple(lhs_contract) == tuple(range(lhs.ndim - k, lhs.ndim))
            and tuple(rhs_contract) == tuple(range(k)))


def matrices(lhs, rhs, dimension_numbers) -> tuple[jax.Array, jax.Array, tuple[int, ...]]:
    """(X (N, n), W (n, m), y's shape) of a plain contraction y = x W: x's rows and W's outputs
    flattened, so that y = (X W).reshape(y's shape)."""
    k = len(dimension_numbers[0][0])
    rows, inner = lhs.shape[:lhs.ndim - k], lhs.shape[lhs.ndim - k:]
    x = lhs.reshape(math.prod(rows), math.prod(inner))
    return x, rhs.reshape(x.shape[1], math.prod(rhs.shape[k:])), (*rows, *rhs.shape[k:])


def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """jax.lax.dot_general, and for the plain contraction y = x W `fp8_matmul` of the two flattened
    to matrices, in preferred_element_type (default: lhs's dtype)."""
    if not plain(lhs, dimension_numbers):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    x, w, shape = matrices(lhs, rhs, dimension_numbers)
    y = fp8_matmul(x, w).reshape(shape)
    return y if preferred_element_type is None else y.astype(preferred_element_type)


# A GPU's product of few rows: XLA turns a dot of one row (decoding at batch 1) into a multiply and a
# reduction over W, which on an H100 read GPT-2 small's weight matrices at 0.5–0.7 TB/s of its 3.35
# (bench/bench_decode_kernels.py, docs/SCALE.md "Generation on a GPU"); for GEMM_ROWS rows it keeps a GEMM:
# greedy sampling at batch 1 went from 1,477 to 1,956 tokens/s there. Repeating the row 8 times instead
# of padding it saves 24 launches a token (the pad's own kernel) but measured 4.6% slower there (1,861
# against 1,951, medians of 3): XLA then fused the residual add into LayerNorm's slower reduction.
GEMM_ROWS = 8


def gpu_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """jax.lax.dot_general, with the plain contraction y = x W of fewer than GEMM_ROWS rows computed
    on x's rows padded with zeros to GEMM_ROWS, the padding's rows of y then dropped: the same
    values, as a GEMM."""
    if not plain(lhs, dimension_numbers) or math.prod(lhs.shape[:lhs.ndim - len(dimension_numbers[0][0])]) >= GEMM_ROWS:
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    x, w, shape = matrices(lhs, rhs, dimension_numbers)
    padded = jnp.pad(x, ((0, GEMM_ROWS - x.shape[0]), (0, 0)))
    y = jax.lax.dot_general(padded, w, (((1,), (0,)), ((), ())), precision, preferred_element_type)
    return y[:x.shape[0]].reshape(shape)


# the forms of the float product: compute.matmul names 'xla', 'cpu' or 'gpu' (MATMULS, which the int8
# product has too); 'fp8' is what ComputeConfig.for_matmul gives the matmuls compute.fp8 names
DOT_GENERALS = {"xla": jax.lax.dot_general, "cpu": cpu_dot_general, "gpu": gpu_dot_general, "fp8": fp8_dot_general}
MATMULS = ("xla", "cpu", "gpu")


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, form: str = AUTO):
    """jax.lax.dot_general in compute.matmul's `form` (DOT_GENERALS, or AUTO: 'cpu' on a CPU, 'gpu' on
    a CUDA GPU, 'xla' elsewhere, chosen when the program is lowered). Only the plain contraction has a
    CPU, GPU or FP8 form."""
    options = dict(dimension_numbers=dimension_numbers, precision=precision,
                   preferred_element_type=preferred_element_type)
    chosen = {name: functools.partial(fn, **options) for name, fn in DOT_GENERALS.items()}
    if form != AUTO:
        return chosen[form](lhs, rhs)
    if not plain(lhs, dimension_numbers):
        return chosen["xla"](lhs, rhs)
    return jax.lax.platform_dependent(lhs, rhs, cpu=chosen["cpu"], cuda=chosen["gpu"], default=chosen["xla"])


def linear(x, w, form: str = AUTO):
    """y = x W (ops.linear) for x (..., n) and W (n, m), in compute.matmul's `form`: the model's
    float weight matmuls (model.Linear and the tied unembedding)."""
    return dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), form=form)


# CPU only: with this gradient the CPU recipe's train step (configs/shakespeare_char_cpu.py,
# 12×64 tokens on 2 devices) takes 0.52× the time it takes with XLA's own gradient of x @ w
# (median ratio of 9 interleaved pairs of 100 steps; 0.47× in another run of 7) on a 2-core
# Intel Xeon. No other backend has been measured, so the others use XLA's.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def cpu_matmul(x, w, precision, preferred_element_type):
    """Y = X W for X (N, n) and W (n, m)."""
    return jax.lax.dot(x, w, precision=precision, preferred_element_type=preferred_element_type)


def _cpu_matmul_forward(x, w, precision, preferred_element_type):
    return cpu_matmul(x, w, precision, preferred_element_type), (x, w)


def _cpu_matmul_backward(precision, preferred_element_type, residuals, dy):
    """∂L/∂X = dY Wᵀ and ∂L/∂W = Xᵀ dY, with dY materialised first: XLA on a CPU otherwise
    fuses the producer of dY (e.g. the GELU backward) into a transposed copy that runs
    several times slower than the matmuls themselves."""
    x, w = residuals
    dy = jax.lax.optimization_barrier(dy)
    dx = jnp.matmul(dy, w.T, precision=precision, preferred_element_type=x.dtype)
    dw = jnp.matmul(x.T, dy, precision=precision, preferred_element_type=w.dtype)
    return dx, dw


cpu_matmul.defvjp(_cpu_matmul_forward, _cpu_matmul_backward)

# --- the weight matrices' product in FP8 -----------------------------------------------------------

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2  # the operands' format, and the gradient's (a wider range)


def fp8_scale(a, dtype):
    """s = max|a| / F, float32, F the largest finite value of the FP8 `dtype` (e4m3: 448, e5m2:
    57344), so that a / s fills its range; 1 for an all-zero a (nothing to scale)."""
    amax = jnp.max(jnp.abs(a)).astype(jnp.float32)
    s = amax / float(jnp.finfo(dtype).max)
    return jnp.where(s > 0, s, jnp.float32(1))


def fp8_quantize(a, dtype):
    """(a_q, s): a_q = a / s rounded to the nearest value of the FP8 `dtype`, s = fp8_scale(a): a ≈ a_q·s."""
    s = fp8_scale(a, dtype)
    return (a.astype(jnp.float32) / s).astype(dtype), s


def fp8_product(a_q, s_a, b_q, s_b, dimension_numbers, dtype):
    """(a_q·s_a)(b_q·s_b) contracted as `dimension_numbers`, in `dtype`: the FP8 operands multiplied
    with float32 accumulation, then the product of the two scales (scalars, so it is the same
    product). The operands go to the dot as FP8 arrays, which XLA's GPU compiler makes one FP8 GEMM
    on Hopper and Ada (a Triton GEMM or cuBLASLt's, the scales applied in its epilogue); XLA 0.10.2
    compiles the dequantised form (a_q·s_a as a wider array, then the dot) into a Triton GEMM of the
    wider arrays instead. Elsewhere XLA widens the operands: the same values, computed in float32."""
    y = jax.lax.dot_general(a_q, b_q, dimension_numbers, preferred_element_type=jnp.float32)
    return (y * (s_a * s_b)).astype(dtype)


def fp8_matmul(x, w):
    """Y = (X_q s_X)(W_q s_W) ≈ X W for X (N, n), W (n, m), in X's dtype, with current per-tensor
    scaling (fp8_quantize): X_q = round_e4m3(X / s_X), s_X = max|X| / 448, W_q likewise; nothing is
    kept between steps. Backward, the incoming dY is quantised to e5m2 with its own scale,
    dY_q = round_e5m2(dY / s_dY), s_dY = max|dY| / 57344, and
        ∂L/∂X = (dY_q s_dY)(W_q s_W)ᵀ   (e5m2 × e4m3),   ∂L/∂W = (X_q s_X)ᵀ(dY_q s_dY)   (e4m3 × e5m2),
    each with float32 accumulation, in X's and W's dtypes (a GPU's FP8 GEMM takes e4m3 × e5m2, never
    e5m2 × e5m2)."""
    return _fp8_matmul(x, w, (jnp.dtype(x.dtype), jnp.dtype(w.dtype)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_matmul(x, w, dtypes):
    return _fp8_matmul_forward(x, w, dtypes)[0]


def _fp8_matmul_forward(x, w, dtypes):
    """Y, and what the backward keeps: the quantised X and W (a byte an element) and their scales."""
    (x_q, s_x), (w_q, s_w) = fp8_quantize(x, E4M3), fp8_quantize(w, E4M3)
    return fp8_product(x_q, s_x, w_q, s_w, (((1,), (0,)), ((), ())), dtypes[0]), (x_q, s_x, w_q, s_w)


def _fp8_matmul_backward(dtypes, residuals, dy):
    x_q, s_x, w_q, s_w = residuals
    dy_q, s_dy = fp8_quantize(dy, E5M2)
    dx = fp8_product(dy_q, s_dy, w_q, s_w, (((1,), (1,)), ((), ())), dtypes[0])  # dY Wᵀ
    dw = fp8_product(x_q, s_x, dy_q, s_dy, (((0,), (0,)), ((), ())), dtypes[1])  # Xᵀ dY
    return dx, dw


_fp8_matmul.defvjp(_fp8_matmul_forward, _fp8_matmul_backward)

# --- the int8 weights' product ----------------------------------------------------------------

# The int8 elements of one chunk of rows that one fused product reads on a CPU (4 MiB): GPT-2
# small's decoding step took 14.9 ms with it, 16.1 ms with 1 MiB chunks and 27.4 ms in float32
# (2-core Intel Xeon, differences of 32- and 160-token greedy runs).
INT8_CHUNK_ELEMENTS = 1 << 22


def int8_product_xla(x, q):
    """Y = x qᵀ, 'Nn,mn->Nm', for x (N, n) and int8 q (m, n), in float32: one product (int8 values
    are exact in any float dtype)."""
    return jax.lax.dot_general(x, q.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def int8_product_cpu(x, q):
    """Y = x qᵀ as int8_product_xla, a chunk of INT8_CHUNK_ELEMENTS of q's rows at a time.

    On a CPU, XLA converts a whole int8 operand of a dot to float32 before the dot, so each
    decoding step would write and read a float32 copy of every matrix. Here a loop takes the
    rows a chunk at a time, and for one row of x XLA fuses the chunk's conversion into a
    matrix-vector product that reads the int8 bytes themselves. The loop keeps x a
    parameter of that product: unrolled, XLA would fuse x's producers (the norm before a
    projection) into each product and compute them again for every output element."""
    x, (m, n) = x.astype(jnp.float32), q.shape
    step = max(1, min(INT8_CHUNK_ELEMENTS // n, -(-m // 2)))  # two chunks at least: a loop, not one product

    def chunk_product(i, y):
        start = jnp.minimum(i * step, m - step)  # the last chunk ends at the last row
        chunk = jax.lax.dynamic_slice_in_dim(q, start, step)
        rows = (x[0] @ chunk.astype(jnp.float32).T)[None] if x.shape[0] == 1 else int8_product_xla(x, chunk)
        return jax.lax.dynamic_update_slice_in_dim(y, rows, start, axis=1)

    return jax.lax.fori_loop(0, -(-m // step), chunk_product, jnp.zeros((x.shape[0], m), jnp.float32))


INT8_PRODUCTS = {"xla": int8_product_xla, "cpu": int8_product_cpu, "gpu": int8_product_xla}  # MATMULS' forms


def int8_product(x, q, form: str = AUTO):
    """Y = x qᵀ, 'Nn,mn->Nm', for x (N, n) and int8 q (m, n), accumulated in float32, in
    compute.matmul's `form` (AUTO: 'cpu' on a CPU, 'xla' elsewhere, chosen when lowered)."""
    if form != AUTO:
        return INT8_PRODUCTS[form](x, q)
    return jax.lax.platform_dependent(x, q, cpu=INT8_PRODUCTS["cpu"], default=INT8_PRODUCTS["xla"])


# --- RoPE ----------------------------------------------------------------------------------------


def rope_lanes(x, positions, base=10000.0):
    """ops.rope over the whole last axis: y = x ⊙ cos θ + (x Π) ⊙ s ⊙ sin θ, θ each pair's angle repeated, Π the
    (D, D) permutation that swaps each pair's entries (exact in any dtype) and s = (−1, +1, −1, …): a TPU lays
    out an axis of 2 (the pairs' form) as 128 lanes."""
    d = x.shape[-1]
    lane = jnp.arange(d)
    angles = lane_angles(positions, d, base)
    swap = (lane[:, None] ^ 1) == lane[None, :]
    partner = jnp.einsum("...d,de->...e", x, swap.astype(x.dtype), precision=jax.lax.Precision.HIGHEST)
    sign = jnp.where(lane % 2 == 0, -1.0, 1.0)
    rotated = x.astype(jnp.float32) * jnp.cos(angles) + sign * partner.astype(jnp.float32) * jnp.sin(angles)
    return rotated.astype(x.dtype)


def lane_angles(positions, d: int, base: float):
    """ops.rope_angles's θ_j for both entries of each pair j, lane by lane: (B,T,1,D) for positions (B,T)."""
    pair = jnp.arange(d) // 2
    inv_freq = jnp.power(base, -(2 * pair).astype(jnp.float32) / d)
    return jnp.asarray(positions, jnp.float32)[..., None, None] * inv_freq


# Compiled for a TPU v5e:2x4 slice (configs/speedrun_gpt2.py, 16 rows per chip), the lanes took XLA's count of
# a train step's bytes accessed from 123.5 to 91.6 GB: by pairs, it copied q and k in float32 through 128-lane
# tiles four times a layer. On a CPU the lanes' train step was 14% slower (docs/EXPERIMENTS.md, "RoPE by lanes").
ROPES = {"pairs": ops.rope, "lanes": rope_lanes}  # compute.rope's forms


def rope(x, positions, base=10000.0, form: str = AUTO):
    """ops.rope in compute.rope's `form` (ROPES, or AUTO: by pairs on a CPU, by lanes elsewhere,
    chosen when the program is lowered)."""
    if form != AUTO:
        return ROPES[form](x, positions, base)
    return jax.lax.platform_dependent(x, positions, cpu=functools.partial(ROPES["pairs"], base=base),
                                      default=functools.partial(ROPES["lanes"], base=base))
