"""All-gather: one quantization, every packet to everyone (docs/design.md section 4)."""

from __future__ import annotations

import jax.numpy as jnp

from cgx_jax.collectives.transport import column_offsets, gather_packets


def allgather_reduce(bufs, axis_name, index, num_participants, seeds, codec, backend,
                     local_error=False):
    """All-gather of the segments ``bufs`` (``seeds`` one ``[2, 2]`` pair per segment):
    quantize each segment once, gather every participant's packets (one packet per segment,
    one after the other), decode and sum all of them (the own one decoded too, so replicas
    stay identical). Traffic: N-1 packets per participant; each value quantized once.

    Returns the segments' f32 sums and, with ``local_error``, their errors (else None)."""
    packets = [backend.quantize_rows(buf.reshape(1, -1), s[0], codec)
               for buf, s in zip(bufs, seeds)]
    gathered = gather_packets(jnp.concatenate(packets, axis=1)[0], axis_name, num_participants)
    totals = [backend.reduce_requantize(gathered, None, index, s[1], codec, buf.shape[0],
                                        emit_packet=False, emit_sum=True, offset=offset)[1]
              for buf, s, offset in zip(bufs, seeds, column_offsets(packets))]
    errors = None
    if local_error:
        errors = [buf - backend.dequantize_rows(p, codec, buf.shape[0], "float32")[0]
                  for buf, p in zip(bufs, packets)]
    return totals, errors
