"""Compressed all-reduce algorithms over one flat buffer, built only from ``lax`` collectives
(DESIGN.md section 4). They run inside ``pmap``/``shard_map`` with ``axis_name`` bound; the
kernels never communicate, XLA moves every byte.

Each function takes a flat buffer already padded for it (``padding_multiple``), this
participant's index, ``seeds uint32[num_phases(algorithm, N), 2]`` (one pair per
quantization phase: two for SRA and all-gather, one per encode for the ring) and a backend
module (``cgx_jax.kernels`` or ``cgx_jax.jax_backend``), and returns the f32 sum and, with
``local_error=True``, what this participant's own compression lost (``buf`` minus what its
peers decoded of it; error feedback adds it to the next step's gradient), else ``None``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

try:  # typed Varying -> Invariant; public jax.lax has only the Varying -> Varying all_gather
    from jax._src.lax.parallel import all_gather_invariant as _jax_all_gather_invariant
except ImportError:  # older jax: gather_invariant falls back to a psum
    _jax_all_gather_invariant = None

from cgx_jax.codec import Codec

ALGORITHMS = ("sra", "allgather", "ring", "auto")


def resolve_algorithm(algorithm: str, num_participants: int) -> str:
    """``"auto"``: all-gather for N <= 2 participants, SRA otherwise.

    At N = 2 both move one packet per participant, but all-gather quantizes once instead of
    twice (less error) and runs one collective instead of two; from N = 3 on all-gather moves
    N-1 packets against SRA's 2(N-1)/N, so SRA wins on bytes. The ring moves as many bytes as
    SRA but in N-1 dependent steps and with more error, so "auto" never picks it.
    """
    if algorithm == "auto":
        return "allgather" if num_participants <= 2 else "sra"
    return algorithm


def num_phases(algorithm: str, num_participants: int) -> int:
    """How many seed pairs an algorithm consumes: the ring encodes N times (the raw chunk,
    then the partial sum after each of the N-1 hops); SRA and all-gather take two."""
    if algorithm == "ring":
        return max(num_participants, 2)
    return 2


def padding_multiple(algorithm: str, codec: Codec, num_participants: int) -> int:
    """SRA and the ring split the buffer into one whole-bucket chunk per participant;
    all-gather does not."""
    if algorithm in ("sra", "ring"):
        return codec.bucket_size * num_participants
    return codec.bucket_size


def scatter_reduce_allgather(buf, axis_name, index, num_participants, seeds, codec, ops,
                             local_error=False):
    """SRA: quantize the N-1 chunks of the peers (the own one stays raw, so it is not
    encoded) -> exchange them (an all-to-all) -> reduce own chunk and re-encode -> all_gather
    -> decode. Every participant decodes the same bytes, so all replicas end bitwise
    identical."""
    chunk = buf.shape[0] // num_participants
    rows = buf.reshape(num_participants, chunk)
    packets = ops.quantize_rows(rows, seeds[0], codec, skip_row=index)
    error = None
    if local_error:  # the own chunk is used raw, so it loses nothing
        lost = rows - ops.dequantize_rows(packets, codec, chunk, "float32")
        error = jnp.where(jnp.arange(num_participants)[:, None] == index, 0.0, lost).reshape(-1)
    received = exchange_rows(packets, axis_name, index, num_participants)
    own = lax.dynamic_index_in_dim(rows, index, axis=0, keepdims=False)
    reduced, _ = ops.reduce_requantize(received, own, index, seeds[1], codec, chunk)
    gathered = gather_packets(reduced, axis_name, num_participants)
    return ops.dequantize_rows(gathered, codec, chunk, "float32").reshape(-1), error


def allgather_reduce(buf, axis_name, index, num_participants, seeds, codec, ops,
                     local_error=False):
    """All-gather: quantize the whole buffer once, gather every packet, decode and sum all
    of them (the own one decoded too, so replicas stay identical)."""
    packet = ops.quantize_rows(buf.reshape(1, -1), seeds[0], codec)[0]
    gathered = gather_packets(packet, axis_name, num_participants)
    _, total = ops.reduce_requantize(gathered, None, index, seeds[1], codec, buf.shape[0],
                                     emit_packet=False, emit_sum=True)
    error = None
    if local_error:
        error = buf - ops.dequantize_rows(packet[None], codec, buf.shape[0], "float32")[0]
    return total, error


def ring_reduce(buf, axis_name, index, num_participants, seeds, codec, ops, local_error=False):
    """Ring: the buffer is N chunks; chunk ``c`` starts as the encoded raw chunk of participant
    ``c+1`` and travels ``c+1 -> c+2 -> ... -> c`` in N-1 ``ppermute`` hops. Each receiver
    decodes the partial sum, adds its own raw chunk and re-encodes (``reduce_requantize`` with
    one peer packet), so participant ``c`` ends holding the encoded full sum of chunk ``c``.
    An ``all_gather`` of those packets and one decode finish it: every participant decodes
    the same bytes, so all replicas end bitwise identical.

    Chunk ``c`` is encoded N times, the k-th time as a sum of k raw chunks, so its error is
    at most ``r * sum_{k=1..N} unit(partial sum k)`` <= ``r * sum_{m=1..N} (N-m+1) u_m``
    (``u_m`` the bucket unit of the m-th contributor's raw values, ``r`` = 1/2 for nearest
    and 1 for stochastic rounding): it grows with the number of hops, up to about N/2 times
    SRA's bound. With ``local_error`` a participant's error is what each of its own N encodes
    lost (it encodes every chunk once), so the errors of all participants add up to exactly
    ``exact sum - result``.
    """
    n = num_participants
    chunk = buf.shape[0] // n
    rows = buf.reshape(n, chunk)
    perm = [(j, (j + 1) % n) for j in range(n)]
    errors = jnp.zeros((n, chunk), jnp.float32) if local_error else None

    def encode_error(errors, c, values, packet):
        if errors is None:
            return None
        lost = values - ops.dequantize_rows(packet[None], codec, chunk, "float32")[0]
        return lax.dynamic_update_index_in_dim(errors, lost, c, axis=0)

    def raw_chunk(c):
        return lax.dynamic_index_in_dim(rows, c, axis=0, keepdims=False)

    c = (index + n - 1) % n  # the chunk this participant starts
    values = raw_chunk(c)
    packet = ops.quantize_rows(values[None], seeds[0], codec)[0]
    errors = encode_error(errors, c, values, packet)
    for hop in range(n - 1):
        received = lax.ppermute(packet, axis_name, perm)
        c = (index + 2 * n - 2 - hop) % n  # the chunk that just arrived from participant i-1
        own = raw_chunk(c)
        peers = jnp.stack([received, received])  # row 1 is replaced by the raw own chunk
        if errors is None:
            packet, _ = ops.reduce_requantize(peers, own, 1, seeds[hop + 1], codec, chunk)
        else:
            packet, values = ops.reduce_requantize(peers, own, 1, seeds[hop + 1], codec,
                                                   chunk, emit_sum=True)
            errors = encode_error(errors, c, values, packet)
    # Now c == index: this participant holds the encoded full sum of its own chunk.
    gathered = gather_packets(packet, axis_name, n)
    total = ops.dequantize_rows(gathered, codec, chunk, "float32").reshape(-1)
    return total, (None if errors is None else errors.reshape(-1))


# XLA:CPU's Gloo transport posts a send before the matching receive, and a receive is
# announced to the peer on the same TCP stream as the data. When two participants exchange
# in one collective, the one that arrives last writes its whole message before announcing
# its receive, so the first one can only start sending once that message has crossed:
# the two directions of the link take turns. Splitting such a swap into several
# collectives lets the directions overlap again (each process moves on to the next piece
# while its last one is still in the socket buffer). Measured on 1 Gbit/s links: 4
# processes exchanging 2 MiB per peer, all_to_all 78-85 ms, shift rounds 72 ms, with the
# swap round in 4 pieces 56 ms (50 ms ideal); 2 processes gathering 8 MiB, one all_gather
# 100-104 ms, 4 pieces 80 ms, 8 pieces 72 ms (67 ms ideal). Each extra collective costs
# about 1 ms where the link is fast (10 Gbit/s: the 8 MiB gather took 10-15 ms whole, 24 ms
# in 8 pieces), so pieces stay at least SWAP_PIECE_BYTES and at most MAX_SWAP_PIECES.
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


def gather_invariant(x, axis_name, *, tiled=False):
    """``lax.all_gather(x, axis_name, tiled=tiled)`` (piece k from participant k), typed
    invariant over the axis under ``shard_map``: every participant receives the same values.
    Decoding gathered packets then gives an invariant sum, like a ``lax.psum`` result, so
    ``jax.grad`` of a per-participant loss counts it once (a varying sum would make the
    straight-through gradient N times larger). XLA runs the same all-gather; only the type
    differs. Older jax without ``all_gather_invariant`` gets a ``psum`` of zero-padded
    pieces instead: exact (every other term is zero) but about twice the bytes."""
    if _jax_all_gather_invariant is not None:
        return _jax_all_gather_invariant(x, axis_name, axis=0, tiled=tiled)
    rows = jnp.zeros((lax.axis_size(axis_name),) + x.shape, x.dtype)
    rows = lax.psum(lax.dynamic_update_index_in_dim(rows, x, lax.axis_index(axis_name), 0),
                    axis_name)
    return rows.reshape((-1,) + x.shape[1:]) if tiled else rows


def _exact_reduce_scatter(buf, axis_name):
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


ALGORITHM_FUNCTIONS = {"sra": scatter_reduce_allgather, "allgather": allgather_reduce,
                       "ring": ring_reduce}


def hierarchical_reduce(buf, axis_name, inner_axis_name, index, num_participants, seeds, codec,
                        ops, algorithm, local_error=False):
    """Hierarchical: exact reduce-scatter over the fast inner axis (piece ``j`` of the
    buffer to inner participant ``j``; on CPU through a ``psum``, see
    ``_exact_reduce_scatter``), the compressed ``algorithm`` over the outer
    ``axis_name`` on that piece (``index``/``num_participants`` are the outer ones), then an
    exact tiled ``all_gather`` over the inner axis. ``buf`` is padded to a multiple of
    ``inner_size * padding_multiple(algorithm, codec, num_participants)``.

    The result is the outer compressed reduction of the exact inner sums, identical on all
    devices. With ``local_error``: this device's outer error on its own piece, zero
    elsewhere (the exact inner sum loses nothing).
    """
    piece = _exact_reduce_scatter(buf, inner_axis_name)
    reduce = ALGORITHM_FUNCTIONS[algorithm]
    total, error = reduce(piece, axis_name, index, num_participants, seeds, codec, ops,
                          local_error=local_error)
    total = gather_invariant(total, inner_axis_name, tiled=True)
    if error is not None:
        # The piece's error sits where the piece came from; the other inner participants
        # report zero there, so the errors of all devices still add up to the total error.
        start = lax.axis_index(inner_axis_name) * piece.shape[0]
        error = lax.dynamic_update_slice_in_dim(jnp.zeros_like(buf), error, start, axis=0)
    return total, error
