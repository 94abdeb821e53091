"""An independent numpy model of the packet format (docs/design.md section 2, as codified in
``xla_ffi/codec.h``), the oracle the kernel tests compare against byte for byte.

Written from the specification, not from ``cgx_jax.jax_backend``. Every float operation is a
separately rounded IEEE f32 operation on ``np.float32`` arrays and scalars (no float64 ever
enters), and the hash of the stochastic rounding uses wrapping ``np.uint32`` arithmetic:

    packet = [ meta: nb x (min f32, unit f32) little-endian ][ codes: nb x (B*b/8) bytes ]
    unit   = max/(2^b-1) - min/(2^b-1), saturated to the largest float if it overflows (1 bit)
    level  = min(floor((x - min) * inv + u), 2^b - 1),   inv = 1/unit (0 when unit == 0)
             (x - min at half scale, doubled, when it overflows)
    x'     = min + level * unit (at half scale, doubled, when level * unit overflows;
             saturated to +/-FLT_MAX)

A bucket holding a NaN or an infinity gets min = unit = NaN (0x7FC00000) and all-zero codes.
Codes are an LSB-first bit stream per bucket.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
F32_MAX = F32(np.finfo(np.float32).max)
QUIET_NAN_BITS = np.uint32(0x7FC00000)
META_BYTES = 8


def packet_bytes(n: int, bits: int, bucket_size: int) -> int:
    return (n // bucket_size) * (META_BYTES + bucket_size * bits // 8)


def _is_finite(v: np.ndarray) -> np.ndarray:
    """Exponent not all ones, read from the bits (NaN and +/-inf are not finite)."""
    return (v.view(np.uint32) & np.uint32(0x7F800000)) != np.uint32(0x7F800000)


# ---------------------------------------------------------------------------
# Randomness: lowbias32 mixer, 24-bit uniform in [0, 1)
# ---------------------------------------------------------------------------

def mix32(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        x = x ^ (x >> np.uint32(16))
    return x.astype(np.uint32)


def uniform01(seed, counter: np.ndarray) -> np.ndarray:
    """``float(int32(h >> 8)) * 2^-24``, ``h = mix32((counter ^ s0) + s1)``: exact in f32."""
    s0, s1 = (np.uint32(s) for s in np.asarray(seed, np.uint32).reshape(2))
    with np.errstate(over="ignore"):
        h = mix32((np.asarray(counter, np.uint32) ^ s0) + s1)
    return (h >> np.uint32(8)).astype(np.int32).astype(F32) * F32(2.0**-24)


# ---------------------------------------------------------------------------
# Bucket scale, rounding, decoding
# ---------------------------------------------------------------------------

def _bucket_min_max(values: np.ndarray):
    """Min and max of each bucket ``values [M, B]``.

    Taken with strict comparisons in eight interleaved lanes (element j goes to lane j % 8),
    then across lanes in lane order, which is how the kernels walk a bucket. For finite
    values this is the plain min and max; the order only decides which zero is reported when
    a bucket's extreme is a zero of both signs (and NaN never wins a comparison, but a bucket
    with a NaN is encoded as NaN anyway).
    """
    m, size = values.shape
    lanes = values.reshape(m, size // 8, 8)
    lo = lanes[:, 0, :].copy()
    hi = lanes[:, 0, :].copy()
    for j in range(size // 8):
        v = lanes[:, j, :]
        lo = np.where(v < lo, v, lo)
        hi = np.where(v > hi, v, hi)
    mn, mx = lo[:, 0].copy(), hi[:, 0].copy()
    for k in range(1, 8):
        mn = np.where(lo[:, k] < mn, lo[:, k], mn)
        mx = np.where(hi[:, k] > mx, hi[:, k], mx)
    return mn, mx


def make_scale(mn: np.ndarray, mx: np.ndarray, finite: np.ndarray, bits: int):
    """(min, unit, inv) per bucket; min = unit = NaN (inv 0) for a bucket that is not finite."""
    levels = F32(2**bits - 1)
    # A zero extreme is stored as +0 whatever its sign.
    mn = np.where(mn == F32(0), F32(0), mn).astype(F32)
    mx = np.where(mx == F32(0), F32(0), mx).astype(F32)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        unit = (mx / levels) - (mn / levels)
        unit = np.where(_is_finite(unit), unit, F32_MAX).astype(F32)
        positive = unit > F32(0)
        inv = np.where(positive, F32(1) / np.where(positive, unit, F32(1)), F32(0)).astype(F32)
    nan = QUIET_NAN_BITS.reshape(1).view(F32)[0]
    mn = np.where(finite, mn, nan).astype(F32)
    unit = np.where(finite, unit, nan).astype(F32)
    inv = np.where(finite, inv, F32(0)).astype(F32)
    return mn, unit, inv


def encode_levels(x: np.ndarray, mn: np.ndarray, inv: np.ndarray, u, bits: int) -> np.ndarray:
    """``min(floor((x - min) * inv + u), top)``; a NaN ``t`` (0 * inf) and ``t <= 0`` give 0."""
    top = np.uint32(2**bits - 1)
    with np.errstate(over="ignore", invalid="ignore"):
        difference = x - mn
        # Buckets wider than the largest float: the offset at half scale, doubled.
        halved = (((x * F32(0.5)) - (mn * F32(0.5))) * inv) * F32(2)
        offset = np.where(_is_finite(difference), difference * inv, halved)
        t = offset + u
        assert t.dtype == F32
        inside = (t > F32(0)) & (t < F32(top))  # NaN is neither
        truncated = np.where(inside, t, F32(0)).astype(np.int32).astype(np.uint32)
        level = np.where(t >= F32(top), top, np.where(t > F32(0), truncated, np.uint32(0)))
    return level.astype(np.uint32)


def decode_levels(level: np.ndarray, mn: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """``min + level * unit``; when the product overflows for a finite unit, the same sum at
    half scale, doubled; a finite bucket saturates to +/-FLT_MAX; NaN unit gives NaN."""
    lf = level.astype(F32)
    with np.errstate(over="ignore", invalid="ignore"):
        offset = lf * unit
        direct = mn + offset
        half = (mn * F32(0.5)) + (lf * (unit * F32(0.5)))
        halved = half * F32(2)
    out = np.where(_is_finite(offset), direct, halved).astype(F32)
    overflowed = ~_is_finite(out) & ~np.isnan(out)
    out = np.where(overflowed, np.where(out > 0, F32_MAX, -F32_MAX), out).astype(F32)
    nan = QUIET_NAN_BITS.reshape(1).view(F32)[0]
    out = np.where(_is_finite(unit), out, nan).astype(F32)
    assert out.dtype == F32
    return out


# ---------------------------------------------------------------------------
# Bit packing: groups of 8 levels -> `bits` bytes, LSB first
# ---------------------------------------------------------------------------

def pack_levels(level: np.ndarray, bits: int) -> np.ndarray:
    """[..., B] levels -> [..., B*bits/8] bytes; value j occupies bits [j*b, (j+1)*b)."""
    groups = level.astype(np.uint64).reshape(*level.shape[:-1], -1, 8)
    shifts = (np.arange(8, dtype=np.uint64) * np.uint64(bits))
    word = np.bitwise_or.reduce(groups << shifts, axis=-1)  # [..., B/8], bits*8 bits used
    byte_shifts = np.arange(bits, dtype=np.uint64) * np.uint64(8)
    out = (word[..., None] >> byte_shifts) & np.uint64(0xFF)  # [..., B/8, bits]
    return out.astype(np.uint8).reshape(*level.shape[:-1], -1)


def unpack_levels(codes: np.ndarray, bits: int) -> np.ndarray:
    """[..., B*bits/8] bytes -> [..., B] levels."""
    groups = codes.astype(np.uint64).reshape(*codes.shape[:-1], -1, bits)
    byte_shifts = np.arange(bits, dtype=np.uint64) * np.uint64(8)
    word = np.bitwise_or.reduce(groups << byte_shifts, axis=-1)
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
    mask = np.uint64((1 << bits) - 1)
    level = (word[..., None] >> shifts) & mask
    return level.astype(np.uint32).reshape(*codes.shape[:-1], -1)


# ---------------------------------------------------------------------------
# Packets
# ---------------------------------------------------------------------------

def split_packets(packets: np.ndarray, bits: int, bucket_size: int, n: int):
    """packets [rows, P] -> (min [rows, nb], unit [rows, nb], levels [rows, n])."""
    packets = np.asarray(packets, np.uint8)
    rows, nb = packets.shape[0], n // bucket_size
    assert packets.shape[1] == packet_bytes(n, bits, bucket_size), packets.shape
    meta = np.ascontiguousarray(packets[:, : META_BYTES * nb]).view("<f4").reshape(rows, nb, 2)
    codes = packets[:, META_BYTES * nb:].reshape(rows, nb, bucket_size * bits // 8)
    levels = unpack_levels(codes, bits).reshape(rows, n)
    return meta[..., 0].astype(F32), meta[..., 1].astype(F32), levels


def quantize_rows(x2d: np.ndarray, seed, bits: int, bucket_size: int,
                  stochastic: bool, skip_row: int = -1) -> np.ndarray:
    """x [rows, n] f32 -> packets uint8 [rows, P]; the noise of element (r, j) is keyed by the
    seed and the counter ``uint32(r * n + j)``. Row ``skip_row`` (if in [0, rows)) is not
    encoded: its packet is zero bytes."""
    x2d = np.asarray(x2d)
    assert x2d.dtype == F32, x2d.dtype
    rows, n = x2d.shape
    assert n % bucket_size == 0
    nb = n // bucket_size
    if rows * n == 0:
        return np.zeros((rows, packet_bytes(n, bits, bucket_size)), np.uint8)
    values = x2d.reshape(rows * nb, bucket_size)
    finite = np.all(_is_finite(values), axis=-1)
    mn, mx = _bucket_min_max(values)
    mn, unit, inv = make_scale(mn, mx, finite, bits)
    if stochastic:
        counter = np.arange(rows * n, dtype=np.uint64).astype(np.uint32)
        u = uniform01(seed, counter).reshape(values.shape)
    else:
        u = F32(0.5)
    level = encode_levels(values, mn[:, None], inv[:, None], u, bits)
    level = np.where(finite[:, None], level, np.uint32(0))
    meta = np.stack([mn, unit], axis=-1).astype("<f4").view(np.uint8).reshape(rows, -1)
    codes = pack_levels(level, bits).reshape(rows, -1)
    packets = np.concatenate([meta, codes], axis=1)
    if 0 <= skip_row < rows:
        packets[skip_row] = 0
    return packets


def dequantize_rows(packets: np.ndarray, bits: int, bucket_size: int, n: int) -> np.ndarray:
    """packets uint8 [rows, P] -> f32 [rows, n]."""
    packets = np.asarray(packets, np.uint8)
    rows = packets.shape[0]
    if rows * n == 0:
        return np.zeros((rows, n), F32)
    mn, unit, levels = split_packets(packets, bits, bucket_size, n)
    levels = levels.reshape(rows, n // bucket_size, bucket_size)
    out = decode_levels(levels, mn[..., None], unit[..., None])
    return out.reshape(rows, n)


def residual_rows(x2d: np.ndarray, packets: np.ndarray, bits: int, bucket_size: int,
              skip_row: int = -1) -> np.ndarray:
    """What quantizing x2d [rows, n] into ``packets`` residual: x - decoded in f32, 0 in row
    ``skip_row`` (not encoded)."""
    x2d = np.asarray(x2d, F32)
    with np.errstate(invalid="ignore", over="ignore"):
        residual = x2d - dequantize_rows(packets, bits, bucket_size, x2d.shape[1])
    if 0 <= skip_row < x2d.shape[0]:
        residual[skip_row] = 0
    return residual


def reduce_requantize(peers: np.ndarray, own, own_index: int, seed, bits: int, bucket_size: int,
                      stochastic: bool, n: int):
    """Decodes the N packets ``peers [N, P]`` of one chunk, sums them in f32 in peer order
    (peer ``own_index`` replaced by the raw f32 chunk ``own`` unless it is None), re-encodes
    the sum with counters 0..n-1. Returns (packet uint8[P], sum f32[n])."""
    peers = np.asarray(peers, np.uint8)
    if own is not None and np.ndim(own) == 2:  # all rows given: row own_index is the own chunk
        own = np.asarray(own)[own_index]
    decoded = dequantize_rows(peers, bits, bucket_size, n)
    total = np.zeros((n,), F32)
    for peer in range(peers.shape[0]):
        if own is not None and peer == own_index:
            term = np.asarray(own)
            assert term.dtype == F32, term.dtype
        else:
            term = decoded[peer]
        with np.errstate(over="ignore", invalid="ignore"):
            total = total + term
    assert total.dtype == F32
    packet = quantize_rows(total[None, :], seed, bits, bucket_size, stochastic)[0]
    return packet, total
