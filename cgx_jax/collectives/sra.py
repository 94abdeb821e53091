"""Scatter-reduce-allgather (SRA), CGX's default algorithm (docs/design.md section 4)."""

from __future__ import annotations

import jax.numpy as jnp

from cgx_jax.collectives.transport import column_offsets, exchange_rows, gather_packets


def scatter_reduce_allgather(bufs, axis_name, index, num_participants, seeds, codec, backend,
                             local_error=False):
    """SRA of the segments ``bufs`` (each padded to N whole-bucket chunks; ``seeds`` one
    ``[2, 2]`` pair per segment): quantize the N-1 chunks of the peers (the own one stays
    raw, so it is not encoded) -> exchange them (an all-to-all) -> reduce own chunk and
    re-encode -> all_gather -> decode. Row ``j`` on the wire holds chunk ``j`` of every
    segment, one packet after the other, so all segments share the two collectives. Every
    participant decodes the same bytes, so all replicas end bitwise identical. Traffic:
    2(N-1)/N packets per participant; each value quantized twice.

    Returns the segments' f32 sums and, with ``local_error``, their errors (else None)."""
    n = num_participants
    rows = [buf.reshape(n, -1) for buf in bufs]
    packets = [backend.quantize_rows(r, s[0], codec, skip_row=index) for r, s in zip(rows, seeds)]
    offsets = column_offsets(packets)
    received = exchange_rows(jnp.concatenate(packets, axis=1), axis_name, index, n)
    # The kernels read the own chunk from the rows and each segment's packets at their
    # offset in the wire rows: slicing either out here would make XLA copy it.
    reduced = [backend.reduce_requantize(received, r, index, s[1], codec, r.shape[1],
                                         offset=offset)[0]
               for r, s, offset in zip(rows, seeds, offsets)]
    gathered = gather_packets(jnp.concatenate(reduced), axis_name, n)
    totals = [backend.dequantize_rows(gathered, codec, r.shape[1], "float32",
                                      offset=offset).reshape(-1)
              for r, offset in zip(rows, offsets)]
    errors = None
    if local_error:  # the own chunk is used raw, so it loses nothing
        errors = []
        for r, p in zip(rows, packets):
            lost = r - backend.dequantize_rows(p, codec, r.shape[1], "float32")
            errors.append(jnp.where(jnp.arange(n)[:, None] == index, 0.0, lost).reshape(-1))
    return totals, errors
