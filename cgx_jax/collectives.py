"""Compressed all-reduce algorithms over one flat buffer, built only from ``lax`` collectives
(DESIGN.md section 4). They run inside ``pmap``/``shard_map`` with ``axis_name`` bound; the
kernels never communicate, XLA moves every byte.

Each function takes a flat buffer already padded for it (``padding_multiple``), this
participant's index, ``seeds uint32[2, 2]`` (one pair per quantization phase) and a backend
module (``cgx_jax.kernels`` or ``cgx_jax.jax_backend``), and returns the f32 sum and, with
``local_error=True``, what this participant's own compression lost (``buf`` minus what its
peers decoded of it; error feedback adds it to the next step's gradient), else ``None``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from cgx_jax.codec import Codec

ALGORITHMS = ("sra", "allgather")


def padding_multiple(algorithm: str, codec: Codec, num_participants: int) -> int:
    """SRA splits the buffer into one whole-bucket chunk per participant; all-gather does not."""
    if algorithm == "sra":
        return codec.bucket_size * num_participants
    return codec.bucket_size


def scatter_reduce_allgather(buf, axis_name, index, num_participants, seeds, codec, ops,
                             local_error=False):
    """SRA: quantize N chunks -> all_to_all -> reduce own chunk (own values raw) and
    re-encode -> all_gather -> decode. Every participant decodes the same bytes, so all
    replicas end bitwise identical."""
    chunk = buf.shape[0] // num_participants
    rows = buf.reshape(num_participants, chunk)
    packets = ops.quantize_rows(rows, seeds[0], codec)
    error = None
    if local_error:  # the own chunk is used raw, so it loses nothing
        lost = rows - ops.dequantize_rows(packets, codec, chunk, "float32")
        error = jnp.where(jnp.arange(num_participants)[:, None] == index, 0.0, lost).reshape(-1)
    # Row j goes to participant j; row k of the result came from participant k.
    received = lax.all_to_all(packets, axis_name, split_axis=0, concat_axis=0, tiled=True)
    own = lax.dynamic_index_in_dim(rows, index, axis=0, keepdims=False)
    reduced, _ = ops.reduce_requantize(received, own, index, seeds[1], codec, chunk)
    gathered = lax.all_gather(reduced, axis_name, axis=0, tiled=False)
    return ops.dequantize_rows(gathered, codec, chunk, "float32").reshape(-1), error


def allgather_reduce(buf, axis_name, index, num_participants, seeds, codec, ops,
                     local_error=False):
    """All-gather: quantize the whole buffer once, gather every packet, decode and sum all
    of them (the own one decoded too, so replicas stay identical)."""
    packet = ops.quantize_rows(buf.reshape(1, -1), seeds[0], codec)[0]
    gathered = lax.all_gather(packet, axis_name, axis=0, tiled=False)
    _, total = ops.reduce_requantize(gathered, None, index, seeds[1], codec, buf.shape[0],
                                     emit_packet=False, emit_sum=True)
    error = None
    if local_error:
        error = buf - ops.dequantize_rows(packet[None], codec, buf.shape[0], "float32")[0]
    return total, error


ALGORITHM_FUNCTIONS = {"sra": scatter_reduce_allgather, "allgather": allgather_reduce}
