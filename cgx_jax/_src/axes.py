"""Named axes: a name or a tuple of names, their size where they are bound, and the inner axis
of the hierarchical reduction (docs/design.md section 6)."""

from __future__ import annotations

from jax import lax


def axis_tuple(axis_name) -> tuple:
    """``axis_name`` (a name or a tuple/list of names) as a tuple of names.

    Example:
        >>> axis_tuple("batch"), axis_tuple(["a", "b"])
        (('batch',), ('a', 'b'))
    """
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def axis_size(axis_name, argument: str = "axis_name") -> int:
    """The number of participants of ``axis_name`` where it is bound; a ``ValueError``
    naming ``argument`` and the ways to bind it where it is not.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> jax.pmap(lambda x: x * axis_size("i"), axis_name="i")(jnp.ones(1)).tolist()
        [1.0]
    """
    try:
        return lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(
            f"{argument} {axis_name!r} is not bound here: call compressed_psum inside "
            f"jax.pmap(..., axis_name=...) or jax.shard_map over a mesh with that axis ({err}). "
            f"Under plain jax.jit with sharded arrays XLA reduces gradients itself: wrap the "
            f"gradient and update in jax.shard_map (the README's 'Use' section)"
        ) from None


def inner_axis_size(axis_name, inner_axis_name) -> int:
    """The size of the inner axis; ValueError when it is unbound or overlaps ``axis_name``."""
    shared = set(axis_tuple(axis_name)) & set(axis_tuple(inner_axis_name))
    if shared:
        raise ValueError(
            f"inner_axis_name {inner_axis_name!r} must differ from axis_name {axis_name!r} "
            f"(both name {sorted(map(str, shared))}): the inner axis is reduced exactly and "
            f"the outer one compressed, each device belongs to one of each")
    return axis_size(inner_axis_name, "inner_axis_name")
