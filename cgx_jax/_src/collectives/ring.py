"""The ring: partial sums travel N-1 hops, re-encoded at each (docs/design.md section 4)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from cgx_jax._src.collectives.transport import gather_packets


def ring_reduce(buf, axis_name, index, num_participants, seeds, codec, backend, with_residual=False,
                divisor=1):
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
    SRA's bound. With ``with_residual`` a participant's residual is what its own N encodes lost
    (it encodes every chunk once), so the residuals of all participants add up to exactly
    ``exact sum - result``.
    """
    n = num_participants
    chunk = buf.shape[0] // n
    rows = buf.reshape(n, chunk)
    perm = [(j, (j + 1) % n) for j in range(n)]
    residuals = jnp.zeros((n, chunk), jnp.float32) if with_residual else None

    def encode_residual(residuals, c, values, packet):
        if residuals is None:
            return None
        residual = values - backend.dequantize_rows(packet[None], codec, chunk, "float32")[0]
        return lax.dynamic_update_index_in_dim(residuals, residual, c, axis=0)

    def raw_chunk(c):
        return lax.dynamic_index_in_dim(rows, c, axis=0, keepdims=False)

    c = (index + n - 1) % n  # the chunk this participant starts
    values = raw_chunk(c)
    packet = backend.quantize_rows(values[None], seeds[0], codec)[0]
    residuals = encode_residual(residuals, c, values, packet)
    for hop in range(n - 1):
        received = lax.ppermute(packet, axis_name, perm)
        c = (index + 2 * n - 2 - hop) % n  # the chunk that just arrived from participant i-1
        own = raw_chunk(c)
        peers = jnp.stack([received, received])  # row 1 is replaced by the raw own chunk
        if residuals is None:
            packet = backend.reduce_requantize(peers, own, 1, seeds[hop + 1], codec, chunk)
        else:
            packet, values = backend.reduce_requantize_with_sum(peers, own, 1, seeds[hop + 1],
                                                                codec, chunk)
            residuals = encode_residual(residuals, c, values, packet)
    # Now c == index: this participant holds the encoded full sum of its own chunk.
    gathered = gather_packets(packet, axis_name, n)
    total = backend.dequantize_rows(gathered, codec, chunk, "float32", divisor=divisor).reshape(-1)
    return total, (None if residuals is None else residuals.reshape(-1))
