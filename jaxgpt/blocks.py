"""The blocks' names and their two parameter layouts: per layer (`h_0 … h_{L−1}`, the loop's) and
stacked (one `h` whose leaves carry a leading layer axis, compute.scan_layers'). Every module
that names a block asks block_name; the layouts convert both ways (params, and anything that
mirrors them, such as an optimizer's moments), on the host when the leaves are there."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

STACKED = "h"  # the one name of all blocks stacked on a layer axis (compute.scan_layers)
_PER_LAYER = re.compile(r"h_(\d+)")


def block_name(layer: int) -> str:
    """The name of block `layer` (0-based) in the per-layer layout."""
    return f"h_{layer}"


def block_index(name: str) -> int | None:
    """The layer of a per-layer block's name, or None for any other name."""
    match = _PER_LAYER.fullmatch(name)
    return int(match[1]) if match else None


def _per_layer(node) -> bool:
    return isinstance(node, dict) and block_name(0) in node


def _stacked(node) -> bool:
    return isinstance(node, dict) and isinstance(node.get(STACKED), dict)


def stack_layers(tree):
    """The loop's layout → scan_layers': in every dict holding blocks h_0 … h_{L−1} (params, and
    the optimizer state's moments, which mirror them), they become one 'h' whose leaves are
    the L layers' leaves stacked on a new leading axis."""
    def stack(node):
        if not _per_layer(node):
            return node
        layers = sorted((block_index(key), key) for key in node if block_index(key) is not None)
        rest = {key: value for key, value in node.items() if block_index(key) is None}
        on_host = all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(node))  # no device program then
        return {**rest, STACKED: jax.tree.map(lambda *leaves: (np if on_host else jnp).stack(leaves),
                                              *(node[key] for _, key in layers))}

    return jax.tree.map(stack, tree, is_leaf=_per_layer)


def unstack_layers(tree):
    """scan_layers' layout → the loop's: each stacked 'h' becomes h_0 … h_{L−1}, L read from the
    first 'h' that holds arrays (an optimizer's masked copy of the params may hold none)."""
    n_layer = next((leaf.shape[0] for node in jax.tree.leaves(tree, is_leaf=_stacked) if _stacked(node)
                    for leaf in jax.tree.leaves(node[STACKED])), 0)

    def unstack(node):
        if not _stacked(node):
            return node
        rest = {key: value for key, value in node.items() if key != STACKED}
        return {**rest, **{block_name(i): jax.tree.map(lambda a, i=i: a[i], node[STACKED]) for i in range(n_layer)}}

    return jax.tree.map(unstack, tree, is_leaf=_stacked)


def layers_as(tree, scan_layers: bool):
    """`tree` (params or anything mirroring them) in the layout compute.scan_layers asks for
    (stacked when True), whichever layout it is in."""
    return stack_layers(tree) if scan_layers else unstack_layers(tree)
