"""Hierarchical reduction: exact over a fast inner axis, compressed over the slow outer one
(docs/design.md section 4)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from cgx_jax._src.collectives.jax_compat import gather_invariant
from cgx_jax._src.collectives.transport import exact_reduce_scatter


def hierarchical_reduce(buf, inner_axis_name, reduce_outer):
    """Exact reduce-scatter over the fast inner axis (piece ``j`` of the buffer to inner
    participant ``j``; on CPU through a ``psum``, see ``transport.exact_reduce_scatter``),
    ``reduce_outer(piece) -> (total, residual or None)`` (the compressed algorithm over the
    outer axis) on that piece, then an exact tiled all-gather over the inner axis. ``buf``
    is padded to a multiple of ``inner_size * padding_multiple(algorithm, codec, N_outer)``.

    The result is the outer compressed reduction of the exact inner sums, identical on all
    devices. The residual (when ``reduce_outer`` returns one): this device's outer residual on its
    own piece, zero elsewhere (the exact inner sum loses nothing).
    """
    piece = exact_reduce_scatter(buf, inner_axis_name)
    total, residual = reduce_outer(piece)
    total = gather_invariant(total, inner_axis_name, tiled=True)
    if residual is not None:
        # The piece's residual sits where the piece came from; the other inner participants
        # report zero there, so the residuals of all devices still add up to the total residual.
        start = lax.axis_index(inner_axis_name) * piece.shape[0]
        residual = lax.dynamic_update_slice_in_dim(jnp.zeros_like(buf), residual, start, axis=0)
    return total, residual
