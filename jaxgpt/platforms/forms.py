"""The platform forms of three equations: each the same function as its equation, computed another
way because one backend measured faster so (docs/ARCHITECTURE.md, "Backends").

    linear(x, w, form)                y = x W (ops.linear): 'xla' XLA's own product and gradient;
                                      'cpu' 2-D matmuls with a hand-written backward
    int8_product(x, q, form)          Y = x qᵀ of int8 weights (jaxgpt.quantize.layers): 'xla' one
                                      product; 'cpu' a chunk of rows at a time
    rope(x, positions, base, form)    ops.rope: 'pairs' (ops.rope itself); 'lanes' over the whole last axis

The compute config chooses a form by name (compute.matmul: MATMULS; compute.rope: ROPES). AUTO
is the form measured faster on a CPU there and XLA's (for RoPE: the lanes) elsewhere, chosen when
the program is lowered (jax.lax.platform_dependent): a program lowered for a GPU or TPU, even on
a CPU host, never holds a CPU form. No other backend has been measured, so the others use XLA's.
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
    k = len(dimension_numbers[0][0])
    rows, inner = lhs.shape[:lhs.ndim - k], lhs.shape[lhs.ndim - k:]
    x = lhs.reshape(math.prod(rows), math.prod(inner))
    w = rhs.reshape(math.prod(inner), math.prod(rhs.shape[k:]))
    return cpu_matmul(x, w, precision, preferred_element_type).reshape(*rows, *rhs.shape[k:])


def plain(lhs, dimension_numbers) -> bool:
    """Whether a dot_general is y = x W: lhs's last k axes against rhs's first k, no batch axes."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    k = len(lhs_contract)
    return (not lhs_batch and not rhs_batch and tuple(lhs_contract) == tuple(range(lhs.ndim - k, lhs.ndim))
            and tuple(rhs_contract) == tuple(range(k)))


# compute.matmul's forms (the float product's and the int8 product's)
DOT_GENERALS = {"xla": jax.lax.dot_general, "cpu": cpu_dot_general}
MATMULS = tuple(DOT_GENERALS)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, form: str = AUTO):
    """jax.lax.dot_general in compute.matmul's `form` (MATMULS, or AUTO: 'cpu' on a CPU, 'xla'
    elsewhere, chosen when the program is lowered). Only the plain contraction has a CPU form."""
    options = dict(dimension_numbers=dimension_numbers, precision=precision,
                   preferred_element_type=preferred_element_type)
    chosen = {name: functools.partial(fn, **options) for name, fn in DOT_GENERALS.items()}
    if form != AUTO:
        return chosen[form](lhs, rhs)
    if not plain(lhs, dimension_numbers):
        return chosen["xla"](lhs, rhs)
    return jax.lax.platform_dependent(lhs, rhs, cpu=chosen["cpu"], default=chosen["xla"])


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


INT8_PRODUCTS = {"xla": int8_product_xla, "cpu": int8_product_cpu}  # MATMULS' forms for int8 weights


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
