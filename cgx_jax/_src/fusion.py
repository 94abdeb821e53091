"""Fusion: the leaves of a pytree that share a codec travel together, so a model's many
layers cost one set of collectives (with SRA and all-gather, one for all codecs; the ring
and the hierarchical reduction: one per codec; docs/design.md section 6).

The group is split into segments (``split_segments``): with SRA and all-gather each large
leaf is a segment of its own, which the kernels read and whose result they write in place
(a reshape, no copy; a leaf short of whole chunks is padded by the kernels, which read its
missing values as its last one); the other leaves are packed into one more segment.
Packing flattens each leaf and pads it to whole buckets (so no bucket mixes two layers'
scales), concatenates the pieces and pads the segment to what the algorithm needs.

Exact leaves travel fused too across CPU processes (``reduce_exact``): the small ones share
one flat buffer per dtype, so the exact collective has a few operands instead of one per
bias and norm.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from cgx_jax._src.codec import Codec, pad_to_multiple, padded_length
from cgx_jax._src.vma import varying_axes


def group_by_codec(leaves, codecs) -> tuple[dict[Codec, list[int]], list[int]]:
    """``({codec: leaf indices}, exact leaf indices)``: non-empty leaves with a codec are
    grouped by it (in first-seen order); the rest (codec ``None``, or no values) are exact.

    Example:
        >>> import jax.numpy as jnp, cgx_jax as cgx
        >>> c = cgx.Codec()
        >>> group_by_codec([jnp.ones(3), jnp.ones(2), jnp.ones(4)], [c, None, c])
        ({Codec(bits=4, bucket_size=128, rounding='stochastic'): [0, 2]}, [1])
    """
    groups: dict[Codec, list[int]] = {}
    exact = []
    for i, (codec, leaf) in enumerate(zip(codecs, leaves)):
        if codec is not None and leaf.size > 0:
            groups.setdefault(codec, []).append(i)
        else:
            exact.append(i)
    return groups, exact


# A leaf of at least this many values travels as its own segment when the kernels can read
# it in place: its size is a whole number of the algorithm's chunks, or it falls short only
# within the last one (the kernels read the missing values as the leaf's last, and write
# only the values the leaf has). They then read the leaf and write its result in place
# (reshapes, no copies). Packing it with other leaves would copy it into the fused buffer
# and its result back out, which made a large MLP's pytree markedly slower than the same
# values as one array (docs/design.md section 6 has the measurement). Small leaves are
# packed so that a model's many small leaves do not cost three kernel calls each.
OWN_SEGMENT_MIN_VALUES = 1 << 18


def fits_short_row(size: int, multiple: int, rows: int | None) -> bool:
    """Whether ``size`` values padded to ``multiple`` and viewed as ``rows`` rows leave only
    the last row short (what the kernels read in place); ``rows`` None: never.

    Example:
        >>> fits_short_row(4000, 4096, 4), fits_short_row(3000, 4096, 4)
        (True, False)
    """
    padded = padded_length(size, multiple)
    return rows is not None and size > 0 and padded - size < padded // rows


def split_segments(sizes, multiple: int, rows: int | None, *,
                   by_rows: bool = False) -> list[list[int]]:
    """Positions (into ``sizes``) of each segment's leaves. With ``rows`` (the rows the
    algorithm views a segment as: SRA N, all-gather 1), every leaf of at least
    ``OWN_SEGMENT_MIN_VALUES`` values that ``fits_in_place`` alone, in order, then the others
    together; with ``rows`` None, one segment of all (the ring and the hierarchical reduction
    run on one padded buffer). ``by_rows``: see ``pack``.

    Example:
        >>> split_segments([1 << 20, 10, 1 << 18, 5, (1 << 20) + 1], 4096, rows=4)
        [[0], [2], [4], [1, 3]]
        >>> split_segments([1 << 20, (1 << 20) + 1], 4096, rows=None)
        [[0, 1]]
    """
    if rows is None:
        return [list(range(len(sizes)))]

    def alone(size):
        return size >= OWN_SEGMENT_MIN_VALUES and fits_in_place(size, multiple, rows, by_rows)

    packed = [i for i, size in enumerate(sizes) if not alone(size)]
    return [[i] for i, size in enumerate(sizes) if alone(size)] + ([packed] if packed else [])


def fits_in_place(size: int, multiple: int, rows: int | None, by_rows: bool = False) -> bool:
    """Whether one leaf of ``size`` values can be its segment as it is (a reshape): with
    ``by_rows`` only when it is a whole number of ``multiple`` (each of its rows whole
    buckets), else when ``fits_short_row``.

    Example:
        >>> fits_in_place(4000, 4096, 4), fits_in_place(4000, 4096, 4, by_rows=True)
        (True, False)
    """
    if by_rows:
        return size > 0 and size % multiple == 0
    return fits_short_row(size, multiple, rows)


def packed_size(sizes, bucket_size: int, multiple: int, rows: int | None, *,
                by_rows: bool = False) -> tuple[int, int]:
    """``(values of the buffer, length the algorithm sees)`` that ``pack`` makes of leaves of
    ``sizes`` values: one leaf that ``fits_in_place`` is read in place (the kernels pad its
    short last row), anything else is packed bucket-aligned and padded to ``multiple``.

    Example:
        >>> packed_size([4000], 64, 4096, rows=4), packed_size([10, 100], 64, 256, rows=4)
        ((4000, 4096), (256, 256))
        >>> packed_size([40, 400], 64, 256, rows=4, by_rows=True)  # rows of 10 and 100 values
        (768, 768)
    """
    if len(sizes) == 1 and fits_in_place(sizes[0], multiple, rows, by_rows):
        return sizes[0], padded_length(sizes[0], multiple)
    if by_rows:
        total = rows * sum(padded_length(size // rows, bucket_size) for size in sizes)
    else:
        total = padded_length(sum(padded_length(size, bucket_size) for size in sizes), multiple)
    return total, total


def pack(leaves, bucket_size: int, multiple: int, rows: int | None = None, *,
         by_rows: bool = False):
    """One f32 buffer and the length the algorithm sees (``packed_size``). One leaf that
    ``fits_in_place`` is the buffer itself, flattened (a reshape for f32), its padding left
    to the kernels. Otherwise each leaf is flattened and padded to whole buckets of
    ``bucket_size``, the pieces concatenated and the whole padded to a multiple of
    ``multiple`` (padding repeats the last value, see ``codec.pad_to_multiple``).

    ``by_rows`` (the reduce-scatter): each leaf is ``rows`` rows, row j going to participant
    j. The buffer is then ``rows`` rows too: row j holds row j of every leaf, each padded to
    whole buckets with its own last value, side by side, so chunk j of the buffer is what
    participant j owns of every leaf."""
    if len(leaves) == 1 and fits_in_place(leaves[0].size, multiple, rows, by_rows):
        return (leaves[0].reshape(-1).astype(jnp.float32),
                padded_length(leaves[0].size, multiple))
    if by_rows:
        pad = jax.vmap(lambda row: pad_to_multiple(row, bucket_size))
        buf = jnp.concatenate([pad(leaf.reshape(rows, -1).astype(jnp.float32))
                               for leaf in leaves], axis=1).reshape(-1)
        return buf, buf.size
    pieces = [pad_to_multiple(leaf.reshape(-1).astype(jnp.float32), bucket_size)
              for leaf in leaves]
    buf = pad_to_multiple(jnp.concatenate(pieces), multiple)
    return buf, buf.size


def unpack(buf, shapes, bucket_size: int) -> list:
    """The inverse of ``pack``: one f32 array per shape, read from its bucket-aligned
    offset in ``buf`` (with ``by_rows``: of one row, the leaves' row shapes)."""
    out, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(buf[offset:offset + size].reshape(shape))
        offset += padded_length(size, bucket_size)
    return out


# Exact leaves below this many values share a buffer where that pays (exact_fusion_pays).
# XLA:CPU runs an all-reduce of many operands across processes as one Gloo collective per
# operand, each paying the link's latency, so a model's many biases and norms cost far more
# as operands than as one buffer (docs/performance.md measures a ViT's). Larger leaves go as
# they are: their copy in and out would cost more than the one latency they save.
EXACT_FUSE_MAX_VALUES = 1 << 20


def exact_fusion_pays() -> bool:
    """Whether small exact leaves share one buffer: only across CPU processes, where each
    operand of an all-reduce pays a network latency. In one process that cost is nil (and
    on GPUs one all-reduce carries all its operands), while unpacking the buffer costs a
    copy kernel per leaf to compile, which slows the compile of a many-leaf model's step
    (docs/performance.md measures it)."""
    return jax.process_count() > 1 and jax.default_backend() == "cpu"


def reduce_exact(reduce, leaves, axes, fuse: bool = True) -> list:
    """``reduce(leaves, axes)`` (``lax.psum`` or ``lax.pmean``); with ``fuse``, the leaves of
    fewer than ``EXACT_FUSE_MAX_VALUES`` values concatenated into one flat buffer per dtype and
    varying-axes type, so the collective gets one operand per buffer; an empty leaf's sum is
    empty and skips the collective (jax 0.11's XLA:CPU crashes compiling an all-reduce of
    zero elements beside other outputs). Returns the reduced leaves in order. In one process
    each element's sum is bitwise the one it has alone; across processes Gloo's summation
    order depends on the buffer, so an f32 sum may differ from the leaf's own ``psum`` in
    the last bits (every replica still gets the same bits).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = jax.pmap(lambda a, b: reduce_exact(jax.lax.psum, [a, b], "i"), axis_name="i")
        >>> [x.tolist() for x in f(jnp.ones((1, 3)), jnp.ones((1, 2), jnp.int32))]
        [[[1.0, 1.0, 1.0]], [[1, 1]]]
    """
    out = [None] * len(leaves)
    operands: dict[tuple, list[int]] = {}  # what travels as one operand -> its leaves
    for i, leaf in enumerate(leaves):
        if leaf.size == 0:
            out[i] = jnp.zeros(leaf.shape, leaf.dtype)
        elif fuse and leaf.size < EXACT_FUSE_MAX_VALUES:
            operands.setdefault((leaf.dtype, varying_axes(leaf)), []).append(i)
        else:
            operands[("alone", i)] = [i]
    bufs = [jnp.concatenate([leaves[i].reshape(-1) for i in members]) if len(members) > 1
            else leaves[members[0]].reshape(-1) for members in operands.values()]
    for members, total in zip(operands.values(), reduce(bufs, axes) if bufs else []):
        offset = 0
        for i in members:
            out[i] = total[offset:offset + leaves[i].size].reshape(leaves[i].shape)
            offset += leaves[i].size
    return out
