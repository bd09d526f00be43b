"""Parameters declare their layout where they are made; everything else reads the declaration.

A parameter is made with `declare(init, axes, inputs=…, group=…)`: a logical name for each of
its dimensions, how many of them are a weight matrix's inputs (the axes it is multiplied
along), and its group. `GPT.init` refuses a parameter made without one. From the
declarations, never from module names:

    shardings        RULES maps each logical axis to a mesh axis (or none), by Flax's
                     nn.logical_to_mesh_axes: params and every optimizer state that mirrors
                     them (pair: a leaf's declaration found by its path)
    groups           embed (lookup tables), head (the untied unembedding), matrix (the other
                     weight matrices), scalar (biases, gains): learning rates and weight decay
    muon_axes        a matrix's reduction (input) and output axes; BATCH axes hold several
                     matrices side by side (Q, K, V; the stacked layers), each its own
    quantisation     int8 weights keep a matrix's input axes last (jaxgpt.quantize)

The tree of declarations (`Declared` boxes around ShapeDtypeStructs) comes from
`jaxgpt.model.param_layout(model)`; its structure is the params'.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import optax
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxgpt.axes import AXES

# Every logical axis a parameter may name, and what it is.
LOGICAL_AXES = {
    "vocab": "the vocabulary: the token table's rows, the unembedding's columns",
    "positions": "the rows of the learned position table",
    "embed": "d_model as a dimension of a matrix",
    "norm": "d_model as the length of a vector: gains and biases",
    "heads": "the query heads",
    "kv_heads": "the key and value heads (grouped-query attention)",
    "head_dim": "the size of a head",
    "qkv": "Q, K and V side by side",
    "kv": "K and V side by side",
    "mlp": "the FFN's hidden width, where a matrix writes it (and W_out reads it)",
    "mlp_in": "the FFN's hidden width read by its second and later layers (ffn_layers > 1)",
    "layers": "the blocks stacked on one axis (compute.scan_layers)",
    "bigrams": "the rows of the bigram hash table (model.bigram_table)",
    "trigrams": "the rows of the trigram hash table (model.trigram_table)",
    "value_dim": "a head's width in a value-embedding table's row (model.value_embeds): split as d_model is",
    "gate": "the few channels of d_model a gate reads (the smear's, the attention gate's)",
    "skip_width": "the hidden width of the small MLP that reads a layer's dense-skip weights (model.dense_skips)",
    "skip_sources": "the earlier hidden states a layer's dense skips weigh, one weight each (model.dense_skips)",
}
# Logical axis → the mesh axis it is split over (None: whole). One table for every parameter.
RULES = (
    ("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"),
    ("mlp_in", "fsdp"), ("positions", None), ("norm", None), ("head_dim", None), ("qkv", None), ("kv", None),
    ("layers", None),
    ("bigrams", "tensor"), ("trigrams", "tensor"), ("gate", None), ("value_dim", "fsdp"),
    ("skip_width", None), ("skip_sources", None),
)
# Axes that must divide their mesh axis evenly (no silent replication): each device's query
# heads read their own key/value heads. (One head, multi-query attention, is on every device.)
STRICT = frozenset({"kv_heads"})
# Axes along which one parameter holds several matrices side by side.
BATCH = frozenset({"qkv", "kv", "layers"})
GROUPS = ("embed", "head", "matrix", "scalar")
LAYERS = "layers"  # the name nn.scan gives the stacked axis (metadata_params)


class Declared(nn.LogicallyPartitioned):
    """A parameter's declaration around its value: `names` (one logical axis per dimension),
    `inputs` (a matrix's input axes, leading, after any batch axes; 0 for vectors and tables)
    and `group`. Unboxed it is the plain value: no constraint is added where it is read."""

    inputs: int = struct.field(default=0, pytree_node=False)
    group: str = struct.field(default="scalar", pytree_node=False)

    def unbox(self, apply_constraint=True) -> Any:
        return self.value


def declare(init, names: tuple[str, ...], inputs: int = 0, group: str = "scalar"):
    """An initializer whose parameter carries its declaration (see Declared)."""
    unknown = [name for name in names if name not in LOGICAL_AXES]
    if unknown or group not in GROUPS:
        raise ValueError(f"declare: unknown logical axes {unknown} or group {group!r} (known axes: "
                         f"{', '.join(LOGICAL_AXES)}; groups: {', '.join(GROUPS)})")

    def make(*args, **kwargs):
        return Declared(init(*args, **kwargs), tuple(names), inputs=inputs, group=group)

    return make


def is_declared(node) -> bool:
    return isinstance(node, Declared)


def by_path(declared) -> dict[str, Declared]:
    """Each parameter's declaration keyed by its path (jax.tree_util.keystr): how any tree in the
    params' structure (an optax transformation's share of them, updates, moments) finds the
    declaration of each of its leaves, at_path."""
    return {jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(declared, is_leaf=is_declared)}


def at_path(found: dict[str, Declared], path) -> Declared:
    """The declaration of the leaf at `path` (a key path) among by_path's; KeyError names the path."""
    return found[jax.tree_util.keystr(path)]


def pair(fn, tree, declared, optimizer=None, other=None):
    """fn(leaf, declaration) for every leaf of `tree` that mirrors a parameter, its declaration found
    by its key path (at_path). `tree` is in the params' structure (params, gradients, updates, or
    a transformation's share of them, the others masked by optax), or, given the `optimizer` (an
    optax GradientTransformation) that made it, an optimizer state: optax.tree_map_params finds
    its copies of the params' structure (AdamW's moments, Muon's momentum, NorMuon's statistics
    per neuron), each handed here whole (its is_leaf: every node), and maps `other` (default:
    keep) over its other leaves (step counts, Newton–Schulz coefficients)."""
    found = by_path(declared)

    def mirror(part):
        return jax.tree_util.tree_map_with_path(lambda path, leaf: fn(leaf, at_path(found, path)), part)

    if optimizer is None:
        return mirror(tree)
    def init(placeholder):  # the state's structure, traced: nothing is computed (a step count, …)
        return jax.eval_shape(optimizer.init, placeholder)

    return optax.tree_map_params(init, mirror, tree, transform_non_params=other, is_leaf=lambda _: True)


def check(params) -> None:
    """ValueError naming the first parameter made without a declaration, or whose names do
    not match its dimensions: a parameter without axes is an error, never replicated silently."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_declared):
        where = jax.tree_util.keystr(path, simple=True, separator="/")
        if not is_declared(leaf):
            raise ValueError(f"parameter {where} was made without logical axes: make it with "
                             "jaxgpt.layout.declare(init, axes, …) so that its layout is known")
        if len(leaf.names) != len(leaf.value.shape):
            raise ValueError(f"parameter {where} of shape {tuple(leaf.value.shape)} declares {len(leaf.names)} axes "
                             f"{leaf.names}: name each dimension")


def _map(fn, layout):
    return jax.tree.map(fn, layout, is_leaf=is_declared)


# --- on the mesh ------------------------------------------------------------------------------


def check_rules(rules=RULES) -> dict[str, str | None]:
    """The rules as a dict; ValueError for one that names an unknown logical or mesh axis."""
    table = dict(rules)
    bad = [f"{logical} → {mesh}" for logical, mesh in rules
           if logical not in LOGICAL_AXES or (mesh is not None and mesh not in AXES)]
    if bad:
        raise ValueError(f"layout rules {', '.join(bad)}: a rule maps a logical axis ({', '.join(LOGICAL_AXES)}) to "
                         f"a mesh axis ({', '.join(AXES)}) or None")
    return table


def splittable(leaf: Declared, mesh, rules=RULES) -> P:
    """The logical axes of a declared parameter that `mesh` can split, as a PartitionSpec of
    logical names (Flax's logical spec): a name is left out (None) where its mesh axis has one
    device or does not divide the dimension (a vocabulary of 65 over 2), so that it holds no
    mesh axis another dimension could take; ValueError where a STRICT axis does not divide."""
    table, names = check_rules(rules), []
    for name, size in zip(leaf.names, leaf.value.shape, strict=True):
        axis = table.get(name)
        ways = 1 if axis is None else mesh.shape[axis]
        if ways > 1 and size % ways and size > 1 and name in STRICT:  # one head: on every device
            raise ValueError(f"{name}={size} is not divisible by the mesh's {axis} axis ({ways}): choose a multiple "
                             f"of mesh.{axis}, or a mesh.{axis} that divides it")
        names.append(name if ways > 1 and size % ways == 0 else None)
    return P(*names)


def spec(leaf: Declared, mesh, rules=RULES) -> P:
    """The mesh spec of one declared parameter: Flax's nn.logical_to_mesh_axes of its splittable
    axes, each logical axis to its mesh axis by the rules (in their order, a mesh axis to one
    dimension at most: the value tables' vocab before their kv_heads), the rest whole."""
    return nn.logical_to_mesh_axes(splittable(leaf, mesh, rules), rules)


def param_shardings(layout, mesh, rules=RULES):
    """A NamedSharding for every parameter of `layout` (Flax's nn.logical_to_mesh_sharding of
    their splittable axes): each its `spec`."""
    logical = _map(lambda leaf: splittable(leaf, mesh, rules), layout)
    return nn.logical_to_mesh_sharding(logical, mesh, rules)


def tree_shardings(tree, declared, mesh, optimizer=None, rules=RULES):
    """A NamedSharding for every leaf of `tree`, a tree in the params' structure or, with the
    `optimizer` that made it, an optimizer state (see pair): a leaf that mirrors a parameter is
    laid out by mirrored_spec, any other leaf whole."""
    def place(leaf, declaration):
        return NamedSharding(mesh, mirrored_spec(tuple(leaf.shape), declaration, mesh, rules))

    return pair(place, tree, declared, optimizer, other=lambda _: NamedSharding(mesh, P()))


def mirrored_spec(shape: tuple[int, ...], leaf: Declared, mesh, rules=RULES) -> P:
    """The spec of a leaf of `shape` that mirrors the parameter `leaf` declares: the parameter's
    for its shape (AdamW's moments, Muon's momentum); for its shape with some dimensions reduced
    to 1 (NorMuon's statistics per neuron), split as the parameter on the dimensions it kept
    and whole on those; whole (P()) for any other shape."""
    full, at = tuple(leaf.value.shape), spec(leaf, mesh, rules)
    if shape == full:
        return at
    if len(shape) != len(full) or any(n not in (1, m) for n, m in zip(shape, full, strict=True)):
        return P()
    return P(*(axis if n == m else None for n, m, axis in zip(shape, full, at, strict=True)))


def bytes_per_device(layout, mesh, rules=RULES) -> int:
    """The parameters' bytes on the device that holds the most: each leaf's shard."""
    def shard_bytes(leaf):
        shape = NamedSharding(mesh, spec(leaf, mesh, rules)).shard_shape(leaf.value.shape)
        return math.prod(shape) * leaf.value.dtype.itemsize

    return sum(jax.tree.leaves(_map(shard_bytes, layout)))


# --- roles --------------------------------------------------------------------------------------


def groups(layout):
    """The group of every parameter (embed, head, matrix, scalar), as a tree of strings."""
    return _map(lambda leaf: leaf.group, layout)


def decays(leaf: Declared, decay_embeddings: bool = True) -> bool:
    """Whether weight decay applies: to the weight matrices (matrix, head) and, with
    decay_embeddings, the embedding tables; never to biases or gains."""
    return leaf.group in ("matrix", "head") or (decay_embeddings and leaf.group == "embed")


def decay_mask(layout, decay_embeddings: bool = True):
    """`decays` of every parameter, as a tree of booleans."""
    return _map(lambda leaf: decays(leaf, decay_embeddings), layout)


def matrix_axes(leaf: Declared) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(reduction axes, output axes) of a weight matrix: its declared inputs, then the rest;
    BATCH axes are neither (each index along them is a matrix of its own)."""
    own = [i for i, name in enumerate(leaf.names) if name not in BATCH]
    if not own or leaf.inputs < 1:
        raise ValueError(f"a parameter with axes {leaf.names} declares no input axes: it is no matrix")
    in_order = [i for i, name in enumerate(leaf.names) if name != LAYERS]
    inputs = set(in_order[:leaf.inputs])
    return tuple(i for i in own if i in inputs), tuple(i for i in own if i not in inputs)


def find(params, layout, names: tuple[str, ...], group: str | None = None) -> list:
    """The parameters of `params` (in tree order) whose declaration in `layout` (the same tree's)
    names exactly these axes, and is of `group` when given: how a reader finds, say, the
    attention's (embed, qkv, heads, head_dim) matrix without knowing what the model calls it."""
    leaves = jax.tree.leaves(layout, is_leaf=is_declared)
    values = jax.tree.leaves(params)
    if len(leaves) != len(values):
        raise ValueError(f"the params hold {len(values)} tensors and their declarations {len(leaves)}: give the "
                         "params of the model whose layout this is")
    return [value for leaf, value in zip(leaves, values, strict=True)
            if tuple(leaf.names) == tuple(names) and group in (None, leaf.group)]


def muon_axes(layout):
    """(reduction, output) axes of every matrix-group parameter, None for the others."""
    return _map(lambda leaf: matrix_axes(leaf) if leaf.group == "matrix" else None, layout)
