"""The codec: bits, bucket size and rounding of a compressed all-reduce, the padding rule,
and packet sizes (the one place that computes them: the all-reduce, ``summary``, the
adaptive fit, the examples and the benchmarks all call ``packet_bytes``/``wire_bytes``).

A packet (docs/design.md section 2) is one contiguous ``uint8`` buffer::

    [ meta: nb x (min f32, unit f32) ][ codes: nb x (bucket_size * bits / 8) bytes ]

so ``n`` elements (``n`` a multiple of ``bucket_size``) cost ``packet_bytes(n, codec)`` bytes.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

ROUNDINGS = ("stochastic", "nearest")
META_BYTES_PER_BUCKET = 8
# Matches kMaxBucketSize in xla_ffi/validate.h.
MAX_BUCKET_SIZE = 1 << 24


@dataclasses.dataclass(frozen=True)
class Codec:
    """How one group of values is quantized: ``bits`` per value, one (min, unit) scale per
    ``bucket_size`` values, and ``rounding`` ("stochastic", unbiased, or "nearest").

    Frozen and hashable, so it can be a static argument of ``jax.jit``.

    Attributes:
      bits: bits per value, an int in 1..8.
      bucket_size: values per bucket (each with its own scale), a positive multiple of 8 up
        to 2^24 (default 128: 4.5 bits per value at 4 bits).
      rounding: ``"stochastic"`` (unbiased, noise from the call's PRNG key) or ``"nearest"``.

    Raises:
      TypeError: ``bits`` or ``bucket_size`` not an int.
      ValueError: one of them out of range, or another ``rounding``.

    Example:
        >>> import cgx_jax as cgx
        >>> codec = cgx.Codec(bits=4, bucket_size=1024)
        >>> round(codec.bits_per_element, 3)
        4.062
    """

    bits: int = 4
    # 128, not 1024: 10.7% more bytes at 4 bits, half the loss gap to exact in training
    # (docs/design.md section 7, "Why the defaults").
    bucket_size: int = 128
    rounding: str = "stochastic"

    def __post_init__(self):
        _check_int("bits", self.bits, "an integer in 1..8")
        if not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be an integer in 1..8, got {self.bits!r}")
        allowed = f"a positive multiple of 8 no larger than {MAX_BUCKET_SIZE}"
        _check_int("bucket_size", self.bucket_size, allowed)
        if not (0 < self.bucket_size <= MAX_BUCKET_SIZE and self.bucket_size % 8 == 0):
            raise ValueError(f"bucket_size must be {allowed}, got {self.bucket_size!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")

    @property
    def stochastic(self) -> bool:
        return self.rounding == "stochastic"

    @property
    def bits_per_element(self) -> float:
        """Wire bits per value, the per-bucket scale included."""
        return 8 * packet_bytes(self.bucket_size, self) / self.bucket_size


def _check_int(name: str, value, allowed: str) -> None:
    # bool is an int subclass, and numpy integers are fine; floats and strings are not.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be {allowed}, got {value!r} of type {type(value).__name__}")


def padded_length(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (0 stays 0)."""
    return -(-n // multiple) * multiple


def pad_to_multiple(flat, multiple: int):
    """Pads a 1-D array to a multiple of ``multiple`` by repeating its last value, so padding
    never widens a bucket's range (and a constant tensor stays exact).

    Example:
        >>> import jax.numpy as jnp
        >>> pad_to_multiple(jnp.array([1.0, 2.0, 3.0]), 4).tolist()
        [1.0, 2.0, 3.0, 3.0]
    """
    n = flat.shape[0]
    extra = padded_length(n, multiple) - n
    if extra == 0 or n == 0:
        return flat
    return jnp.concatenate([flat, jnp.broadcast_to(flat[-1], (extra,))])


def packet_bytes(n: int, codec: Codec) -> int:
    """Bytes of the packet that encodes ``n`` values, ``n`` a multiple of the bucket size.

    Args:
      n: the number of values, a multiple of ``codec.bucket_size``.
      codec: the ``Codec``.

    Returns:
      The packet's size in bytes.

    Example:
        >>> import cgx_jax as cgx
        >>> cgx.packet_bytes(2048, cgx.Codec(bits=4, bucket_size=1024))
        1040
    """
    if n % codec.bucket_size:
        raise ValueError(f"n must be a multiple of bucket_size {codec.bucket_size}, got {n}")
    buckets = n // codec.bucket_size
    return buckets * (META_BYTES_PER_BUCKET + codec.bucket_size * codec.bits // 8)


def wire_bytes(n: int, codec: Codec) -> int:
    """Bytes of the packet for ``n`` values of any count (padded to whole buckets).

    Args:
      n: the number of values.
      codec: the ``Codec``.

    Returns:
      The packet's size in bytes, ``n`` padded to whole buckets.

    Example:
        >>> import cgx_jax as cgx
        >>> cgx.wire_bytes(1000, cgx.Codec(bits=4, bucket_size=512))  # 2 x (8 + 256) bytes
        528
    """
    return packet_bytes(padded_length(n, codec.bucket_size), codec)
