"""Fusion: the leaves of a pytree that share a codec travel together, so a model's many
layers cost one set of collectives per codec (docs/design.md section 6).

The group is split into segments (``split_segments``): with SRA and all-gather each large
leaf that needs no padding is a segment of its own, which the kernels read and whose result
they write in place (a reshape, no copy); the other leaves are packed into one more
segment. Packing flattens each leaf and pads it to whole buckets (so no bucket mixes two
layers' scales), concatenates the pieces and pads the segment to what the algorithm needs.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from cgx_jax.codec import Codec, pad_to_multiple, padded_length


def group_by_codec(leaves, codecs) -> tuple[dict[Codec, list[int]], list[int]]:
    """``({codec: leaf indices}, exact leaf indices)``: non-empty leaves with a codec are
    grouped by it (in first-seen order); the rest (codec ``None``, or no values) are exact.

    Example:
        >>> import jax.numpy as jnp, cgx_jax as cgx
        >>> c = cgx.Codec()
        >>> group_by_codec([jnp.ones(3), jnp.ones(2), jnp.ones(4)], [c, None, c])
        ({Codec(bits=4, bucket_size=1024, rounding='stochastic'): [0, 2]}, [1])
    """
    groups: dict[Codec, list[int]] = {}
    exact = []
    for i, (codec, leaf) in enumerate(zip(codecs, leaves)):
        if codec is not None and leaf.size > 0:
            groups.setdefault(codec, []).append(i)
        else:
            exact.append(i)
    return groups, exact


# A leaf of at least this many values whose size is a whole number of the algorithm's
# chunks travels as its own segment: the kernels read it and write its result in place
# (reshapes, no copies). Packing it with other leaves would copy it into the fused buffer
# and its result back out: for the 10M-value kernels of an MLP (4 processes, 1 Gbit/s) those
# copies made the pytree 1.5x slower than the same values as one array. A leaf that needs
# padding is copied either way (and its result sliced out), and measured faster packed with
# the others (one copy pass instead of one per leaf); small leaves are packed so that a
# model's many small leaves do not cost three kernel calls each.
OWN_SEGMENT_MIN_VALUES = 1 << 18


def split_segments(sizes, multiple: int, leaf_segments: bool) -> list[list[int]]:
    """Positions (into ``sizes``) of each segment's leaves. With ``leaf_segments``, every leaf
    of at least ``OWN_SEGMENT_MIN_VALUES`` values that is a multiple of ``multiple`` (the
    algorithm's padding multiple) alone, in order, then the others together; without, one
    segment of all (the ring and the hierarchical reduction run on one buffer).

    Example:
        >>> split_segments([1 << 20, 10, 1 << 18, 5, (1 << 20) + 1], 4096, leaf_segments=True)
        [[0], [2], [1, 3, 4]]
        >>> split_segments([1 << 20, 10], 4096, leaf_segments=False)
        [[0, 1]]
    """
    if not leaf_segments:
        return [list(range(len(sizes)))]

    def alone(size):
        return size >= OWN_SEGMENT_MIN_VALUES and size % multiple == 0

    packed = [i for i, size in enumerate(sizes) if not alone(size)]
    return [[i] for i, size in enumerate(sizes) if alone(size)] + ([packed] if packed else [])


def pack(leaves, bucket_size: int, multiple: int):
    """One f32 buffer (a reshape when ``leaves`` is one f32 leaf needing no padding): each
    leaf flattened and padded to whole buckets of ``bucket_size``, concatenated, the whole
    padded to a multiple of ``multiple`` (padding repeats the last value, see
    ``codec.pad_to_multiple``)."""
    pieces = [pad_to_multiple(leaf.reshape(-1).astype(jnp.float32), bucket_size)
              for leaf in leaves]
    return pad_to_multiple(jnp.concatenate(pieces), multiple)


def unpack(buf, shapes, bucket_size: int) -> list:
    """The inverse of ``pack``: one f32 array per shape, read from its bucket-aligned
    offset in ``buf``."""
    out, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(buf[offset:offset + size].reshape(shape))
        offset += padded_length(size, bucket_size)
    return out
