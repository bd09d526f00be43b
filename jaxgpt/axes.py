"""The mesh's axes by name, and how activations say which of their dimensions lie along them.

    data    batch rows; the parameters replicated
    fsdp    batch rows, and one large dimension of each matrix (gathered where it is used)
    tensor  attention heads and the FFN hidden dimension

A program traced under a mesh (jax.set_mesh) with these axes lays its activations out by
them; traced under no mesh, each function here returns its input unchanged.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def current_mesh():
    """The abstract mesh the program is traced under when it has the three axes, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or not set(AXES) <= set(mesh.axis_names) else mesh


def batch_ways(mesh) -> int:
    """How many ways the rows of a batch are split: data × fsdp."""
    return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def rows_split(x):
    """x with its leading axis (the rows of a batch) split over ('data', 'fsdp'), its other
    dimensions left to XLA; x itself under no mesh or when the rows do not divide.

    The model marks its activations so: under fsdp a weight (d, F) sharded over 'fsdp' meets
    rows sharded over 'fsdp', and XLA may otherwise gather the activations (or the logits)
    instead of the weight. Marked, each device keeps its rows, the weight is all-gathered
    where it is used and its gradient reduce-scattered."""
    mesh = current_mesh()
    if mesh is None or batch_ways(mesh) == 1 or x.ndim == 0 or x.shape[0] % batch_ways(mesh):
        return x
    return jax.lax.with_sharding_constraint(x, P(BATCH_AXES, *[P.UNCONSTRAINED] * (x.ndim - 1)))


def whole(x):
    """x whole on every device where it is read: a lookup table under fsdp, all-gathered before
    the lookup as FSDP gathers a weight (a lookup from a split table would instead move every
    looked-up row). Its gradient is left in the layout XLA gives it, not made whole in turn:
    each device's sum over its own rows, reduce-scattered where the gradient is laid out as the
    table is (a gradient made whole would be all-reduced and then sliced). x itself under no mesh."""
    return x if current_mesh() is None else _gathered(x)


@jax.custom_vjp
def _gathered(x):
    return jax.lax.with_sharding_constraint(x, P())


_gathered.defvjp(lambda x: (_gathered(x), None), lambda _, cotangent: (cotangent,))
