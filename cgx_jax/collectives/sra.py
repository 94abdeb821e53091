"""Scatter-reduce-allgather (SRA), CGX's default algorithm (docs/design.md section 4)."""

from __future__ import annotations

import jax.numpy as jnp

from cgx_jax.collectives.transport import exchange_rows, gather_packets


def scatter_reduce_allgather(buf, axis_name, index, num_participants, seeds, codec, backend,
                             local_error=False):
    """SRA: quantize the N-1 chunks of the peers (the own one stays raw, so it is not
    encoded) -> exchange them (an all-to-all) -> reduce own chunk and re-encode -> all_gather
    -> decode. Every participant decodes the same bytes, so all replicas end bitwise
    identical. Traffic: 2(N-1)/N packets per participant; each value quantized twice."""
    chunk = buf.shape[0] // num_participants
    rows = buf.reshape(num_participants, chunk)
    packets = backend.quantize_rows(rows, seeds[0], codec, skip_row=index)
    error = None
    if local_error:  # the own chunk is used raw, so it loses nothing
        lost = rows - backend.dequantize_rows(packets, codec, chunk, "float32")
        error = jnp.where(jnp.arange(num_participants)[:, None] == index, 0.0, lost).reshape(-1)
    received = exchange_rows(packets, axis_name, index, num_participants)
    # The kernel reads the own chunk from the rows: slicing it out here would make XLA
    # materialize the fused buffer a second time for the slice.
    reduced, _ = backend.reduce_requantize(received, rows, index, seeds[1], codec, chunk)
    gathered = gather_packets(reduced, axis_name, num_participants)
    return backend.dequantize_rows(gathered, codec, chunk, "float32").reshape(-1), error
