"""The one place cgx_jax uses JAX internals (``jax._src``), so a JAX upgrade that moves them
breaks this file only (docs/design.md section 1). Each has a public-API fallback where one
exists (``gather_invariant``: a ``psum``; the CUDA runtime version: not checked) and a clear
``RuntimeError`` where none does (``distributed_client``); tests/test_jax_internals.py fails
loudly on a JAX that moved any of them."""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax import lax

# jax.reshard is public from jax 0.9 on; older versions have it as jax.sharding.reshard.
reshard = getattr(jax, "reshard", None) or jax.sharding.reshard

try:  # typed Varying -> Invariant; public jax.lax has only the Varying -> Varying all_gather
    from jax._src.lax.parallel import all_gather_invariant as _jax_all_gather_invariant
except ImportError:  # older jax: gather_invariant falls back to a psum
    _jax_all_gather_invariant = None


_UNTYPED = contextvars.ContextVar("cgx_untyped_collectives", default=False)


@contextlib.contextmanager
def untyped_collectives():
    """Collectives traced inside this context run where JAX types no value as varying or
    invariant over mesh axes (a ``custom_partitioning`` op's partitioned function, traced
    outside ``shard_map``): ``gather_invariant`` is then a plain ``lax.all_gather``, as under
    ``pmap``."""
    token = _UNTYPED.set(True)
    try:
        yield
    finally:
        _UNTYPED.reset(token)


def gather_invariant(x, axis_name, *, tiled=False):
    """``lax.all_gather(x, axis_name, tiled=tiled)`` (piece k from participant k), typed
    invariant over the axis under ``shard_map``: every participant receives the same values.
    Decoding gathered packets then gives an invariant sum, like a ``lax.psum`` result, so
    ``jax.grad`` of a per-participant loss counts it once (a varying sum would make the
    straight-through gradient N times larger). XLA runs the same all-gather; only the type
    differs. Older jax without ``all_gather_invariant`` gets a ``psum`` of zero-padded
    pieces instead: exact (every other term is zero) but about twice the bytes."""
    if _UNTYPED.get():
        return lax.all_gather(x, axis_name, tiled=tiled)
    if _jax_all_gather_invariant is not None:
        return _jax_all_gather_invariant(x, axis_name, axis=0, tiled=tiled)
    rows = jnp.zeros((lax.axis_size(axis_name),) + x.shape, x.dtype)
    rows = lax.psum(lax.dynamic_update_index_in_dim(rows, x, lax.axis_index(axis_name), 0),
                    axis_name)
    return rows.reshape((-1,) + x.shape[1:]) if tiled else rows


def distributed_client():
    """This process's ``jax.distributed`` client (its key-value store), ``None`` before
    ``jax.distributed.initialize``. JAX has no public accessor; a JAX that keeps it elsewhere
    gets a ``RuntimeError`` saying so, never a skipped check."""
    try:
        from jax._src import distributed
        return distributed.global_state.client
    except (ImportError, AttributeError) as error:
        raise RuntimeError(_moved("jax._src.distributed.global_state.client",
                                  "checks that the processes agree")) from error


def ambient_mesh():
    """The mesh ``jax.sharding.set_mesh`` made current (``with jax.sharding.set_mesh(mesh):``
    or set for the program), or ``None``. Inside ``jax.jit`` the public
    ``jax.sharding.get_mesh`` refuses and ``get_abstract_mesh`` has no devices, so it is read
    where JAX itself keeps it; a JAX that keeps it elsewhere gets a ``RuntimeError``."""
    try:
        from jax._src.mesh import get_concrete_mesh
    except ImportError as error:
        raise RuntimeError(_moved("jax._src.mesh.get_concrete_mesh",
                                  "reads the mesh set by jax.sharding.set_mesh")) from error
    mesh = get_concrete_mesh()
    return None if mesh is None or not mesh.axis_names else mesh


def jax_cuda_runtime_version() -> int | None:
    """The CUDA runtime version of JAX's CUDA plugin (``1000 * major + 10 * minor``), ``None``
    where no CUDA plugin is installed, or it does not say (then only the driver is checked)."""
    try:
        from jax._src import lib
    except ImportError:
        return None
    versions = getattr(lib, "cuda_versions", None)
    try:
        return int(versions.cuda_runtime_get_version())
    except Exception:  # no plugin (None), or a plugin without the call, or no CUDA runtime
        return None


def _moved(name: str, use: str) -> str:
    return (f"cgx_jax {use} through the JAX internal {name}, which jax {jax.__version__} does "
            f"not have. Install a jax that cgx_jax's tests pass under (pyproject.toml's "
            f"range; tests/test_jax_internals.py checks each internal it uses), or report it.")
