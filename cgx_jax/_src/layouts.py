"""PartitionSpecs on a mesh: the axes a spec names, an axis's type, and a value laid out as
a spec says (constraint or reshard). Shared by ``data_parallel`` and ``fsdp``."""

from __future__ import annotations

from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

from cgx_jax._src.collectives.jax_compat import reshard


def axis_type(mesh, name):
    """The ``AxisType`` of mesh axis ``name``."""
    return mesh.axis_types[mesh.axis_names.index(name)]


def entry_axes(entry) -> tuple:
    """The mesh axes one entry of a ``PartitionSpec`` names: none, one, or several."""
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def spec_axes(spec) -> list:
    """The mesh axes a ``PartitionSpec`` names."""
    return [name for entry in spec for name in entry_axes(entry)]


def lay_out(g, spec, mesh):
    """``g`` laid out as ``spec`` says: a constraint over automatic axes, a reshard over
    explicit ones (where JAX refuses constraints); ``spec`` None: as XLA propagates it."""
    if spec is None or spec == P():
        return g
    if any(axis_type(mesh, n) == AxisType.Explicit for n in spec_axes(spec)):
        return reshard(g, spec)
    return lax.with_sharding_constraint(g, spec)
