"""Fusion: the leaves of a pytree that share a codec travel as one flat f32 buffer, so a
model's many layers cost one set of collectives per codec (docs/design.md section 6).

Each leaf is flattened and padded to whole buckets (so no bucket mixes two layers' scales),
the pieces are concatenated, and the buffer is padded to what the algorithm needs.
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


def pack(leaves, bucket_size: int, multiple: int):
    """One f32 buffer: each leaf flattened and padded to whole buckets of ``bucket_size``,
    concatenated, the whole padded to a multiple of ``multiple`` (padding repeats the last
    value, see ``codec.pad_to_multiple``)."""
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
