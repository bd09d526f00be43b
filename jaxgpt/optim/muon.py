"""Muon's orthogonalisation over banks: every matrix of the same shape, stacked, orthogonalised
in one batched Newton–Schulz iteration, each device its own share of each bank.

    M̃ = β·m̂ + (1−β)·ĝ                        Nesterov momentum (m̂, ĝ bias-corrected)
    X₀ = M̃ / (‖M̃‖_F + ε)                      each matrix (m × n, oriented so that m ≤ n)
    X ← a·X + (b·A + c·A²)·X,  A = X Xᵀ        muon_ns_steps times, (a, b, c) per step
    update = X (transposed back where it was)

A matrix is a weight's reduction (input) axes × its output axes, read from its declaration
(jaxgpt.layout.matrix_axes); its batch axes (Q, K and V side by side, the stacked layers) hold
several matrices. A **bank** is every matrix, across parameters and layers, of one oriented
shape (m, n): GPT-2's Q, K, V and W_O of every layer are one bank of (d, d) matrices, its FFN's
W_in and W_outᵀ one of (d, 4d). NS(Xᵀ) = NS(X)ᵀ, so orienting changes nothing.

Under a mesh (jax.set_mesh), a bank of N matrices is split over all its devices along N
(padded with zero matrices to a multiple of the device count, whose update is zero): each
device orthogonalises N/D whole matrices, no device repeats another's work or holds a whole
bank's momentum (unless the bank has fewer matrices than the mesh has devices), and each
update is then laid out as its parameter is. On one device each bank is one batched chain of
matrix products instead of one chain per parameter.

The state is optax.contrib.MuonState (count, momentum in the params' structure, the NS
coefficients), so a state written by optax.contrib.scale_by_muon restores into it.

NorMuon (scale_by_neuron_norm) then normalises each matrix's update O per output neuron i
(each index of its output axes), with a second moment v kept per neuron:

    v_i ← β₂·v_i + (1−β₂)·mean_j O_ij²         (j over the matrix's reduction axes)
    Ô = O / √max(v, ε),   update = Ô · ‖O‖_F / max(‖Ô‖_F, ε)     (each matrix keeps its norm)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonState

from jaxgpt import axes, layout


class Matrix(NamedTuple):
    """Where one parameter's matrices go: its path, its bank (oriented shape and dtype) and the
    reshapes between the parameter and its (count, m, n) stack of oriented matrices."""

    path: str
    bank: tuple[int, int, str]
    count: int
    to_stack: Callable
    from_stack: Callable
    declaration: layout.Declared


def matrix_of(path: str, value, declaration: layout.Declared) -> Matrix:
    """The (count, m, n) view of a parameter whose declaration names its reduction and output
    axes: batch axes first (each index a matrix), then reduction × output, transposed to
    output × reduction when there are more inputs than outputs (so m ≤ n)."""
    reduction, output = layout.matrix_axes(declaration)
    batch = tuple(i for i in range(value.ndim) if i not in reduction + output)
    order = batch + reduction + output
    sizes = [math.prod(value.shape[i] for i in group) for group in (batch, reduction, output)]
    flip = sizes[1] > sizes[2]
    oriented = (sizes[2], sizes[1]) if flip else (sizes[1], sizes[2])
    inverse = tuple(order.index(i) for i in range(value.ndim))
    unflat = tuple(value.shape[i] for i in order)

    def to_stack(x):
        x = x.transpose(order).reshape(sizes)
        return x.swapaxes(1, 2) if flip else x

    def from_stack(x):
        x = x.swapaxes(1, 2) if flip else x
        return x.reshape(unflat).transpose(inverse)

    return Matrix(path, (*oriented, jnp.dtype(value.dtype).name), sizes[0], to_stack, from_stack, declaration)


def newton_schulz(x_NxMxK, coeffs, eps: float):
    """NS of each matrix of a stack X (N, m, k), m ≤ k: X₀ = X/(‖X‖_F + ε) per matrix, then for
    each row (a, b, c) of `coeffs` (steps, 3): X ← a·X + (b·A + c·A²)·X with A = X Xᵀ."""
    x_NxMxK = x_NxMxK / (jnp.linalg.norm(x_NxMxK, axis=(1, 2), keepdims=True) + eps)
    for step in range(coeffs.shape[0]):
        a, b, c = coeffs[step, 0], coeffs[step, 1], coeffs[step, 2]
        gram_NxMxM = jnp.einsum("nik,njk->nij", x_NxMxK, x_NxMxK)
        poly_NxMxM = b * gram_NxMxM + c * jnp.einsum("nij,njl->nil", gram_NxMxM, gram_NxMxM)
        x_NxMxK = a * x_NxMxK + jnp.einsum("nij,njk->nik", poly_NxMxM, x_NxMxK)
    return x_NxMxK


def split_axes(mesh) -> tuple[str, ...]:
    """The mesh axes of more than one device: a bank is split over all of them."""
    return tuple(name for name in mesh.axis_names if mesh.shape[name] > 1)


def orthogonalise(tree, matrices: dict[str, Matrix], coeffs, eps: float):
    """NS of every matrix in `tree` (leaves at the paths of `matrices`; others left out by
    optax's masking), bank by bank; under a mesh each bank split over its devices and each
    result laid out as its parameter."""
    mesh = axes.current_mesh()
    mesh = mesh if mesh is not None and mesh.size > 1 else None
    specs = {path: layout.spec(matrix.declaration, mesh) for path, matrix in matrices.items()} if mesh else {}
    place = (lambda x, at: x if mesh is None else jax.lax.with_sharding_constraint(x, at))  # noqa: E731
    # the momentum in its own layout, so that its elementwise steps run where it lies
    leaves = {jax.tree_util.keystr(path): place(leaf, specs.get(jax.tree_util.keystr(path)))
              for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
    banks: dict[tuple, list[Matrix]] = {}
    for path in leaves:
        banks.setdefault(matrices[path].bank, []).append(matrices[path])
    done = {}
    for members in banks.values():
        stack = jnp.concatenate([member.to_stack(leaves[member.path]) for member in members])
        count = stack.shape[0]
        if mesh is not None:  # N/D whole matrices on each device
            stack = place(jnp.pad(stack, ((0, -count % mesh.size), (0, 0), (0, 0))), P(split_axes(mesh), None, None))
        stack = newton_schulz(stack, coeffs, eps)
        if mesh is not None and all(not any(specs[member.path]) for member in members):
            stack = place(stack, P())  # whole parameters (no fsdp, no tensor): one all-gather, sliced in place
        start = 0
        for member in members:
            update = member.from_stack(stack[start:start + member.count])
            done[member.path], start = place(update, specs.get(member.path)), start + member.count
    return jax.tree_util.tree_map_with_path(lambda path, _: done[jax.tree_util.keystr(path)], tree)


def scale_by_banked_muon(declared, ns_coeffs, ns_steps: int, beta: float, eps: float = 1e-8,
                         nesterov: bool = True) -> optax.GradientTransformation:
    """Muon's direction for the matrices `declared` (the params' tree of declarations) names:
    momentum β (Nesterov when `nesterov`), then `orthogonalise` by banks with `ns_steps`
    Newton–Schulz steps of `ns_coeffs` ((a, b, c), or one row per step). The updates equal
    optax.contrib.scale_by_muon's with the declarations' dimension numbers."""
    found = layout.by_path(declared)

    def matrices_of(tree) -> dict[str, Matrix]:
        return {key: matrix_of(key, leaf, found[key]) for key, leaf in
                ((jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree))}

    def init(params):
        coeffs = jnp.asarray(ns_coeffs)
        coeffs = coeffs[-ns_steps:] if coeffs.ndim == 2 else coeffs
        return MuonState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params), ns_coeffs=coeffs)

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                                  optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                                  optax.tree.bias_correction(updates, beta, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        coeffs = state.ns_coeffs if state.ns_coeffs.ndim == 2 else jnp.tile(state.ns_coeffs, (ns_steps, 1))
        directions = orthogonalise(mu_hat, matrices_of(mu_hat), coeffs.astype(jnp.float32), eps)
        return directions, MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(init, update)


def scale_by_width(declared) -> optax.GradientTransformation:
    """u ← √max(1, fan_out/fan_in)·u for each matrix (fan_in its reduction axes' size, fan_out its
    output axes'): the width scaling of Muon's update that optax.contrib.muon applies. Stateless."""
    def scale(u, declaration):
        reduction, output = layout.matrix_axes(declaration)
        fan_in, fan_out = (math.prod(u.shape[i] for i in group) for group in (reduction, output))
        return math.sqrt(max(1.0, fan_out / fan_in)) * u

    def update(updates, state, params=None):
        del params
        return layout.pair(scale, updates, declared), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


class NeuronNormState(NamedTuple):
    """NorMuon's state: `nu`, each output neuron's moving mean of its update's mean square, in the
    params' structure, each leaf the parameter's shape with its reduction axes kept as 1."""

    nu: optax.Params


def neuron_normalised(o, nu, reduction: tuple[int, ...], output: tuple[int, ...], eps: float):
    """Ô · ‖O‖_F/max(‖Ô‖_F, ε) with Ô = O/√max(ν, ε): each output neuron's row of O divided by its
    RMS estimate √ν (broadcast over the reduction axes), each matrix (its reduction × output
    axes; batch axes apart) rescaled to the norm it had."""
    scaled = o * jax.lax.rsqrt(jnp.maximum(nu, eps))
    norm_of = lambda x: jnp.sqrt(jnp.sum(jnp.square(x), axis=reduction + output, keepdims=True))  # noqa: E731
    return scaled * (norm_of(o) / jnp.maximum(norm_of(scaled), eps))


def scale_by_neuron_norm(declared, beta2: float, eps: float = 1e-10) -> optax.GradientTransformation:
    """NorMuon's normalisation (module docstring) of the orthogonalised updates of the matrices
    `declared` names: ν ← β₂ν + (1−β₂)·mean over the reduction axes of O², then
    neuron_normalised. Each matrix's own rows: the batch axes (Q, K, V; the layers) are never
    reduced over. It runs in the parameters' layout, so under a mesh each reduction is XLA's
    over the devices that hold that matrix's shards."""
    found = layout.by_path(declared)

    def axes_at(path) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return layout.matrix_axes(layout.at_path(found, path))

    def init(params):
        def zeros(p, declaration):
            reduction, _ = layout.matrix_axes(declaration)
            return jnp.zeros([1 if i in reduction else n for i, n in enumerate(p.shape)], jnp.float32)

        return NeuronNormState(nu=layout.pair(zeros, params, declared))

    def update(updates, state, params=None):
        del params

        def moment(path, o, nu):
            reduction, _ = axes_at(path)
            return beta2 * nu + (1 - beta2) * jnp.mean(jnp.square(o.astype(jnp.float32)), axis=reduction,
                                                        keepdims=True)

        nu = jax.tree_util.tree_map_with_path(moment, updates, state.nu)
        normalised = jax.tree_util.tree_map_with_path(
            lambda path, o, v: neuron_normalised(o.astype(jnp.float32), v, *axes_at(path), eps).astype(o.dtype),
            updates, nu)
        return normalised, NeuronNormState(nu=nu)

    return optax.GradientTransformation(init, update)
