"""The codec in pure ``jax.numpy``: the readable specification of the packet format
(docs/design.md section 2) and the ``backend="jax"`` fallback (TPU, or no compiled kernels).

Same signatures as ``cgx_jax._src.backends.ffi``. Layout, meta values and levels match the kernels,
except where XLA rewrites float arithmetic (reciprocal multiplication, fused multiply-add)
and a value on a rounding boundary lands one level away.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cgx_jax._src.codec import Codec, packet_bytes, pad_to_multiple

_F32_MAX = np.float32(np.finfo(np.float32).max)


def _mix32(x):
    """lowbias32, as ``mix32`` in codec.h (uint32 arithmetic wraps)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def uniform01(seed, counter):
    """Uniform [0, 1) with 24 bits from ``(seed[0], seed[1], counter)``, as codec.h."""
    h = _mix32((counter ^ seed[0]) + seed[1])
    return (h >> 8).astype(jnp.int32).astype(jnp.float32) * jnp.float32(2.0**-24)


def _pack(levels, bits):
    """[..., B] levels -> [..., B*bits/8] bytes, an LSB-first bit stream."""
    shifts = jnp.arange(bits, dtype=jnp.uint32)
    bitstream = (levels[..., None] >> shifts) & 1  # [..., B, bits]
    bitstream = bitstream.reshape(*levels.shape[:-1], -1, 8)
    return jnp.sum(bitstream << jnp.arange(8, dtype=jnp.uint32), axis=-1).astype(jnp.uint8)


def _unpack(codes, bits):
    """[..., B*bits/8] bytes -> [..., B] levels."""
    bitstream = (codes[..., None].astype(jnp.uint32) >> jnp.arange(8, dtype=jnp.uint32)) & 1
    bitstream = bitstream.reshape(*codes.shape[:-1], -1, bits)
    return jnp.sum(bitstream << jnp.arange(bits, dtype=jnp.uint32), axis=-1)


def _full_rows(x, n):
    """``x`` (flat, its last row of ``n`` possibly short) padded with its last value ->
    ``[rows, n]``."""
    return pad_to_multiple(x.reshape(-1), n).reshape(-1, n)


def quantize_rows(x, seed, codec: Codec, skip_row=None, n=None, *, with_residual=False):
    """Same contract as ``cgx_jax._src.backends.ffi.quantize_rows``."""
    packets = _encode_rows(x if n is None else _full_rows(x, n), seed, codec, skip_row)
    if not with_residual:
        return packets
    n = x.shape[-1] if n is None else n
    flat = x.reshape(-1).astype(jnp.float32)
    residual = flat - dequantize_rows(packets, codec, n, jnp.float32, size=x.size)
    if skip_row is not None:  # the skipped row is not encoded: nothing of it is residual
        residual = jnp.where(jnp.arange(x.size) // n == skip_row, 0.0, residual)
    return packets, residual.reshape(x.shape)


def _encode_rows(x, seed, codec: Codec, skip_row):
    rows, n = x.shape
    b, size = codec.bits, codec.bucket_size
    values = x.astype(jnp.float32).reshape(rows, n // size, size)
    finite = jnp.all(jnp.isfinite(values), axis=-1)
    mn = jnp.min(values, axis=-1) + 0.0  # -0 -> +0, as make_scale
    mx = jnp.max(values, axis=-1) + 0.0
    # The barrier keeps XLA from turning the two divisions into one fused multiply-add.
    levels = jax.lax.optimization_barrier(jnp.float32(2**b - 1))
    unit = mx / levels - mn / levels
    unit = jnp.where(jnp.isfinite(unit), unit, _F32_MAX)
    inv = jnp.where(unit > 0, 1.0 / jnp.where(unit > 0, unit, 1.0), 0.0).astype(jnp.float32)
    if codec.stochastic:
        counter = jnp.arange(rows * n, dtype=jnp.uint32).reshape(values.shape)
        noise = uniform01(seed, counter)
    else:
        noise = jnp.float32(0.5)
    difference = values - mn[..., None]
    # Buckets wider than the largest float: the offset at half scale, doubled (encode_level).
    halved = ((values * 0.5 - mn[..., None] * 0.5) * inv[..., None]) * 2.0
    t = jnp.where(jnp.isfinite(difference), difference * inv[..., None], halved) + noise
    top = 2**b - 1
    level = jnp.where(t >= top, top, jnp.where(t > 0, t.astype(jnp.int32), 0))
    level = jnp.where(finite[..., None], level, 0).astype(jnp.uint32)
    nan = jnp.float32(np.nan)
    meta = jnp.stack([jnp.where(finite, mn, nan), jnp.where(finite, unit, nan)], axis=-1)
    meta = jax.lax.bitcast_convert_type(meta, jnp.uint8).reshape(rows, -1)
    codes = _pack(level, b).reshape(rows, -1)
    packets = jnp.concatenate([meta, codes], axis=1)
    if skip_row is None:
        return packets
    return jnp.where(jnp.arange(rows)[:, None] == skip_row, jnp.uint8(0), packets)


def dequantize_rows(packets, codec: Codec, n: int, dtype, offset: int = 0, size=None,
                    divisor: int = 1):
    """Same contract as ``cgx_jax._src.backends.ffi.dequantize_rows``."""
    if size is not None:
        return dequantize_rows(packets, codec, n, dtype, offset,
                               divisor=divisor).reshape(-1)[:size]
    packets = packets[:, offset:offset + packet_bytes(n, codec)]
    rows = packets.shape[0]
    nb = n // codec.bucket_size
    meta = jax.lax.bitcast_convert_type(
        packets[:, : 8 * nb].reshape(rows, nb, 2, 4), jnp.float32)
    mn, unit = meta[..., 0:1], meta[..., 1:2]
    codes = packets[:, 8 * nb:].reshape(rows, nb, -1)
    level = _unpack(codes, codec.bits).astype(jnp.float32)
    offset = level * unit
    # As decode_level in codec.h: half scale when the offset overflows, saturation at the
    # largest float, NaN for a non-finite bucket.
    halved = (mn * 0.5 + level * (unit * 0.5)) * 2.0
    values = jnp.where(jnp.isfinite(offset), mn + offset, halved)
    values = jnp.clip(values, -_F32_MAX, _F32_MAX)
    values = jnp.where(jnp.isfinite(unit), values, jnp.float32(np.nan))
    return _scaled(values, divisor).reshape(rows, n).astype(dtype)


def _scaled(values, divisor: int):
    """``values`` times ``1 / divisor`` rounded to f32, as the kernels scale a mean."""
    return values if divisor == 1 else values * (np.float32(1) / np.float32(divisor))


def _reduced(peers, own, own_index, codec: Codec, n: int, offset: int):
    """The f32 sum in peer order of the peers' decoded packets (peer ``own_index`` replaced by
    the raw ``own`` chunk unless ``own`` is None), as the kernels add them."""
    num_peers = peers.shape[0]
    pbytes = packet_bytes(n, codec)
    if not 0 <= offset <= peers.shape[1] - pbytes:
        raise ValueError(f"peers rows of {peers.shape[1]} bytes cannot hold a packet of "
                         f"{pbytes} bytes at offset {offset}")
    peers = peers[:, offset:offset + pbytes]
    decoded = dequantize_rows(peers, codec, n, jnp.float32)
    if own is not None:  # the chunk, or all rows of which row own_index is the own chunk
        rows = _full_rows(own, n)
        own = rows[0] if own.size <= n else jax.lax.dynamic_index_in_dim(
            rows, own_index, axis=0, keepdims=False)
        is_own = jnp.arange(num_peers)[:, None] == own_index
        decoded = jnp.where(is_own, own.astype(jnp.float32)[None, :], decoded)
    total = jnp.zeros((n,), jnp.float32)
    for peer in range(num_peers):  # peer order 0..N-1, as the kernels
        total = total + decoded[peer]
    return total


def reduce_requantize(peers, own, own_index, seed, codec: Codec, n: int, *, offset: int = 0):
    """Same contract as ``cgx_jax._src.backends.ffi.reduce_requantize``."""
    total = _reduced(peers, own, own_index, codec, n, offset)
    return quantize_rows(total[None, :], seed, codec)[0]


def reduce_requantize_with_sum(peers, own, own_index, seed, codec: Codec, n: int, *,
                               offset: int = 0):
    """Same contract as ``cgx_jax._src.backends.ffi.reduce_requantize_with_sum``."""
    total = _reduced(peers, own, own_index, codec, n, offset)
    return quantize_rows(total[None, :], seed, codec)[0], total


def reduce_sum(peers, own, own_index, codec: Codec, n: int, *, offset: int = 0, size=None,
               divisor: int = 1):
    """Same contract as ``cgx_jax._src.backends.ffi.reduce_sum``."""
    total = _scaled(_reduced(peers, own, own_index, codec, n, offset), divisor)
    return total if size is None else total[:size]
