"""Which leaves of a model cgx works on: models carry more than arrays (an Equinox module's
activation functions, a dataclass's ints and strings), and ``jax.grad``, ``shard_map`` and the
policy take arrays only. Like ``equinox.partition``/``combine``, a tree is split into the
leaves kept (arrays; for gradients, floating arrays) and the rest, each side holding ``None``
where the other has a leaf; the rest is closed over, never differentiated, split, reduced or
given a residual (docs/design.md section 6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def is_array(leaf) -> bool:
    """A JAX or NumPy array (or an abstract one: ``jax.ShapeDtypeStruct``)."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def is_differentiable(leaf) -> bool:
    """An array of a floating (or complex) dtype: what ``jax.grad`` differentiates and
    ``equinox.filter_grad`` calls an inexact array."""
    return is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)


def partition(tree, keep):
    """``(kept, rest)``: ``tree`` with ``None`` for every leaf ``keep(leaf)`` refuses, and
    ``tree`` with ``None`` for every leaf it keeps.

    Example:
        >>> import jax.numpy as jnp
        >>> kept, rest = partition({"w": jnp.ones(2), "act": abs}, is_array)
        >>> kept["act"] is None, rest["w"] is None, rest["act"] is abs
        (True, True, True)
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    kept = [leaf if keep(leaf) else None for leaf in leaves]
    rest = [None if keep(leaf) else leaf for leaf in leaves]
    return treedef.unflatten(kept), treedef.unflatten(rest)


def combine(kept, rest):
    """The tree ``partition`` split: each leaf from ``kept`` where it has one, else from
    ``rest``."""
    return jax.tree.map(lambda a, b: b if a is None else a, kept, rest,
                        is_leaf=lambda x: x is None)
