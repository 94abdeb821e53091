"""How packets cross processes on CPU (docs/design.md section 5): SRA's exchange, the packet
gather and the exact reduce-scatter of the hierarchical reduction, each the plain ``lax``
collective except where XLA:CPU's cross-process (Gloo) transport needs another shape of the
same traffic. Every function gives the same bytes as the plain collective; one process and
other platforms run the plain collective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from cgx_jax._src.collectives.jax_compat import gather_invariant

# XLA:CPU's Gloo transport posts a send before the matching receive, and a receive is
# announced to the peer on the same TCP stream as the data. When two participants exchange
# in one collective, the one that arrives last writes its whole message before announcing
# its receive, so the first one can only start sending once that message has crossed:
# the two directions of the link take turns. Splitting such a swap into several
# collectives lets the directions overlap again (each process moves on to the next piece
# while its last one is still in the socket buffer; docs/performance.md measures it on 1
# and 10 Gbit/s links). Each extra collective costs a latency where the link is fast, so
# pieces stay at least SWAP_PIECE_BYTES and at most MAX_SWAP_PIECES.
SWAP_PIECE_BYTES = 512 * 1024
MAX_SWAP_PIECES = 4


def _swap_bounds(length, itemsize):
    """Piece boundaries along an axis of ``length`` items for a swap of that many items."""
    pieces = max(1, min(MAX_SWAP_PIECES, length * itemsize // SWAP_PIECE_BYTES))
    return [length * p // pieces for p in range(pieces + 1)]


def exchange_rows(rows, axis_name, index, num_participants, *, in_rounds=None):
    """``lax.all_to_all(rows, axis_name, 0, 0, tiled=True)`` of ``rows [N, m]``: row ``j``
    goes to participant ``j``, row ``k`` of the result came from participant ``k``.

    On CPU across processes (``in_rounds=None``: when ``jax.process_count() > 1``, where Gloo
    carries the collectives; ``True`` forces it, for tests) it runs as ``N-1`` ``ppermute``
    shift rounds instead (round ``k``: participant ``i`` sends row ``i+k`` to ``i+k``), so that
    every link carries data one way per collective; only the swap round ``k = N/2`` of an even
    ``N`` goes both ways, and it runs in pieces (see the comment above). Same bytes, same
    result, bit for bit. Devices of one process (in-process collectives: the rounds would only
    add rendezvous) and other platforms (NCCL runs its peers concurrently) use the
    ``all_to_all``.
    """
    n = num_participants

    def all_to_all(rows):
        return lax.all_to_all(rows, axis_name, split_axis=0, concat_axis=0, tiled=True)

    if in_rounds is None:
        in_rounds = jax.process_count() > 1
    if n == 1 or not in_rounds:
        return all_to_all(rows)

    def shift_rounds(rows):
        out = rows  # the own row stays in place, as in the all_to_all
        for k in range(1, n):
            perm = [(j, (j + k) % n) for j in range(n)]
            send = lax.dynamic_index_in_dim(rows, (index + k) % n, axis=0, keepdims=True)
            width = rows.shape[1]
            bounds = _swap_bounds(width, rows.dtype.itemsize) if 2 * k == n else [0, width]
            got = jnp.concatenate([lax.ppermute(send[:, lo:hi], axis_name, perm)
                                   for lo, hi in zip(bounds[:-1], bounds[1:])], axis=1)
            out = lax.dynamic_update_index_in_dim(out, got[0], (index + n - k) % n, axis=0)
        return out

    return lax.platform_dependent(rows, cpu=shift_rounds, default=all_to_all)


def gather_packets(packet, axis_name, num_participants, *, in_pieces=None):
    """``gather_invariant(packet, axis_name)`` of a 1-D packet -> ``[N, bytes]``. Between two
    participants the gather is a swap, so on CPU across processes (``in_pieces`` as
    ``exchange_rows``'s ``in_rounds``) it runs in pieces (see the comment above
    ``exchange_rows``); the result is the same, bit for bit, and typed invariant too."""
    if in_pieces is None:
        in_pieces = jax.process_count() > 1
    if num_participants != 2 or not in_pieces:
        return gather_invariant(packet, axis_name)

    def gather_in_pieces(packet):
        bounds = _swap_bounds(packet.shape[0], packet.dtype.itemsize)
        return jnp.concatenate([gather_invariant(packet[lo:hi], axis_name)
                                for lo, hi in zip(bounds[:-1], bounds[1:])], axis=1)

    return lax.platform_dependent(packet, cpu=gather_in_pieces,
                                  default=lambda p: gather_invariant(p, axis_name))


def column_offsets(parts) -> list[int]:
    """Where each part starts in ``jnp.concatenate(parts, axis=1)``: the byte offset of each
    segment's packet in a wire row, which the kernels read in place.

    Example:
        >>> import jax.numpy as jnp
        >>> column_offsets([jnp.zeros((4, 2)), jnp.zeros((4, 3)), jnp.zeros((4, 1))])
        [0, 2, 5]
    """
    offsets = [0]
    for part in parts[:-1]:
        offsets.append(offsets[-1] + part.shape[1])
    return offsets


def exact_reduce_scatter(buf, axis_name):
    """Tiled ``lax.psum_scatter`` over ``axis_name``, except on CPU, where it is a ``psum``
    followed by taking this participant's piece: XLA:CPU's multi-process (Gloo) reduce-scatter
    intermittently returns wrong values for pieces of a few MiB (jax-ml/jax#40830; seen
    here with 4 processes x 2 devices and 32 MiB pieces, in about 1 call in 3). The psum
    moves about twice the bytes, on the inner axis only."""
    def via_psum(x):
        size = x.shape[0] // lax.axis_size(axis_name)
        return lax.dynamic_slice_in_dim(lax.psum(x, axis_name), lax.axis_index(axis_name) * size,
                                        size)

    return lax.platform_dependent(
        buf, cpu=via_psum,
        default=lambda x: lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True))
