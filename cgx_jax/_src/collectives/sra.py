"""Scatter-reduce-allgather (SRA), CGX's default algorithm, and its first half alone: the
compressed reduce-scatter (docs/design.md sections 4 and 10)."""

from __future__ import annotations

import jax.numpy as jnp

from cgx_jax._src.collectives.transport import column_offsets, exchange_rows, gather_packets


def exchange_chunks(bufs, chunks, axis_name, index, num_participants, seeds, codecs, backend,
                    with_residual=False):
    """The first half of SRA, and the whole wire of the reduce-scatter: each segment of
    ``bufs`` seen as N whole-bucket chunks of ``chunks`` values (the last possibly short),
    the N-1 chunks of the peers quantized with the seed ``seeds[s][0]`` (the own one stays
    raw, so it is not encoded), exchanged in one all-to-all. Row ``j`` on the wire holds
    chunk ``j`` of every segment, one packet after the other, so all segments share the
    collective.

    Returns ``(received uint8 [N, W]: row k from participant k, each segment's byte offset in
    a row, each segment's loss with with_residual else None)``."""
    # With with_residual the kernel also writes what each value lost (0 in the own chunk,
    # which is used raw), while the packet is in cache.
    encoded = [backend.quantize_rows(buf, s[0], codec, skip_row=index, n=chunk,
                                     with_residual=with_residual)
               for buf, s, codec, chunk in zip(bufs, seeds, codecs, chunks)]
    packets = [e[0] for e in encoded] if with_residual else encoded
    received = exchange_rows(jnp.concatenate(packets, axis=1), axis_name, index,
                             num_participants)
    return received, column_offsets(packets), ([e[1] for e in encoded] if with_residual else None)


def reduce_scatter(bufs, lengths, axis_name, index, num_participants, seeds, codecs, backend):
    """The compressed reduce-scatter of the segments ``bufs`` (``exchange_chunks``; each
    ``length`` values long, N rows of whole buckets): this participant's chunk of each, the
    f32 sum in participant order of the decoded chunks its peers sent and its own raw one.
    Each value is quantized once; traffic (N-1)/N packets per participant."""
    n = num_participants
    chunks = [length // n for length in lengths]
    received, offsets, _ = exchange_chunks(bufs, chunks, axis_name, index, n, seeds, codecs,
                                           backend)
    return [backend.reduce_sum(received, buf, index, codec, chunk, offset=offset)
            for buf, codec, chunk, offset in zip(bufs, codecs, chunks, offsets)]


def scatter_reduce_allgather(bufs, lengths, axis_name, index, num_participants, seeds, codecs,
                             backend, with_residual=False, divisor=1):
    """SRA of the segments ``bufs`` (each seen as N whole-bucket chunks of ``length / N``
    values, the last possibly short; ``seeds`` one ``[2, 2]`` pair and ``codecs`` one codec
    per segment: segments of different codecs share the collectives too): quantize and
    exchange the peers' chunks (``exchange_chunks``) -> reduce own chunk and re-encode ->
    all_gather -> decode. Every participant decodes the same bytes, so all replicas end
    bitwise identical. Traffic: 2(N-1)/N packets per participant; each value quantized twice.

    Returns the segments' f32 sums (each as long as its buffer, times ``f32(1/divisor)``) and,
    with ``with_residual``, their residuals (else None)."""
    n = num_participants
    chunks = [length // n for length in lengths]
    received, offsets, residuals = exchange_chunks(bufs, chunks, axis_name, index, n, seeds,
                                                codecs, backend, with_residual)
    # The kernels read the own chunk from the buffer (its row `index`) and each segment's
    # packets at their offset in the wire rows: slicing either out here would make XLA copy it.
    reduced = [backend.reduce_requantize(received, buf, index, s[1], codec, chunk,
                                         offset=offset)
               for buf, s, codec, chunk, offset in zip(bufs, seeds, codecs, chunks, offsets)]
    gathered = gather_packets(jnp.concatenate(reduced), axis_name, n)
    totals = [backend.dequantize_rows(gathered, codec, chunk, "float32", offset=offset,
                                      size=buf.size, divisor=divisor)
              for buf, codec, chunk, offset in zip(bufs, codecs, chunks, offsets)]
    return totals, residuals
