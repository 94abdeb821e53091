"""All-gather: one quantization, every packet to everyone (docs/design.md section 4)."""

from __future__ import annotations

from cgx_jax.collectives.transport import gather_packets


def allgather_reduce(buf, axis_name, index, num_participants, seeds, codec, backend,
                     local_error=False):
    """All-gather: quantize the whole buffer once, gather every packet, decode and sum all
    of them (the own one decoded too, so replicas stay identical). Traffic: N-1 packets per
    participant; each value quantized once."""
    packet = backend.quantize_rows(buf.reshape(1, -1), seeds[0], codec)[0]
    gathered = gather_packets(packet, axis_name, num_participants)
    _, total = backend.reduce_requantize(gathered, None, index, seeds[1], codec, buf.shape[0],
                                         emit_packet=False, emit_sum=True)
    error = None
    if local_error:
        error = buf - backend.dequantize_rows(packet[None], codec, buf.shape[0], "float32")[0]
    return total, error
