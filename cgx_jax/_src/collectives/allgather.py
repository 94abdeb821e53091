"""All-gather: one quantization, every packet to everyone (docs/design.md section 4)."""

from __future__ import annotations

import jax.numpy as jnp

from cgx_jax._src.collectives.transport import column_offsets, gather_packets


def allgather_reduce(bufs, lengths, axis_name, index, num_participants, seeds, codecs, backend,
                     with_residual=False, divisor=1):
    """All-gather of the segments ``bufs`` (each seen as one row of ``length`` values, which
    the buffer may fall short of; ``seeds`` one ``[2, 2]`` pair and ``codecs`` one codec per
    segment): quantize each segment once, gather every participant's packets (one packet per
    segment, one after the other), decode and sum all of them (the own one decoded too, so
    replicas stay identical).
    Traffic: N-1 packets per participant; each value quantized once.

    Returns the segments' f32 sums (each as long as its buffer, times ``f32(1/divisor)``) and,
    with ``with_residual``, their residuals (else None)."""
    encoded = [backend.quantize_rows(buf, s[0], codec, n=length, with_residual=with_residual)
               for buf, s, codec, length in zip(bufs, seeds, codecs, lengths)]
    packets = [e[0] for e in encoded] if with_residual else encoded
    gathered = gather_packets(jnp.concatenate(packets, axis=1)[0], axis_name, num_participants)
    totals = [backend.reduce_sum(gathered, None, index, codec, length, offset=offset,
                                 size=buf.size, divisor=divisor)
              for buf, codec, length, offset in zip(bufs, codecs, lengths,
                                                    column_offsets(packets))]
    return totals, ([e[1] for e in encoded] if with_residual else None)
