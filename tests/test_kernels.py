"""The codec kernels against the numpy model (tests/numpy_model.py), the jnp backend against
the kernels, properties of the rounding, the public quantize/dequantize, and the argument
checks of the Python wrappers and of the FFI handlers themselves.

Kernels run on the CPU device; the model is the byte-for-byte oracle (docs/design.md section 2).
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import cgx_jax
import numpy_model as model
from cgx_jax.backends import ffi as kernels, pure_jax as jax_backend
from cgx_jax.codec import Codec, packet_bytes, wire_bytes

CPU = jax.devices("cpu")[0]
F32, BF16, F16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
DTYPES = (F32, BF16, F16)
ROUNDINGS = ("nearest", "stochastic")
BITS = tuple(range(1, 9))
EPS = 2.0**-24  # unit roundoff of f32
FLT_MAX = float(np.finfo(np.float32).max)


def on_cpu(a):
    return jax.device_put(a, CPU)


@pytest.fixture(autouse=True)
def _default_device_cpu():
    """Everything here runs on the CPU device, also on a machine with a GPU."""
    with jax.default_device(CPU):
        yield


# Jitted once per static codec/shape: eager dispatch of each codec would compile just the same.
_quantize = jax.jit(kernels.quantize_rows, static_argnums=2)
_dequantize = jax.jit(kernels.dequantize_rows, static_argnums=(1, 2, 3))
_jnp_quantize = jax.jit(jax_backend.quantize_rows, static_argnums=2)
_jnp_dequantize = jax.jit(jax_backend.dequantize_rows, static_argnums=(1, 2, 3))


@functools.partial(jax.jit, static_argnames=("backend", "codec", "n", "emit_packet", "emit_sum"))
def _reduce(peers, own, own_index, seed, *, backend, codec, n, emit_packet=True, emit_sum=False):
    return backend.reduce_requantize(peers, own, own_index, seed, codec, n,
                                     emit_packet=emit_packet, emit_sum=emit_sum)


def quantize(x, seed, codec):
    return np.asarray(_quantize(on_cpu(x), on_cpu(np.asarray(seed, np.uint32)), codec))


def dequantize(packets, codec, n, dtype):
    return np.asarray(_dequantize(on_cpu(packets), codec, n, np.dtype(dtype)))


def codec_of(bits, bucket_size, rounding):
    return Codec(bits=bits, bucket_size=bucket_size, rounding=rounding)


# ---------------------------------------------------------------------------
# Inputs and comparisons
# ---------------------------------------------------------------------------

def realistic(rng, rows, n, bucket_size, spread=2.0):
    """Normal values with a different scale (10^-spread..10^spread) and offset per bucket."""
    nb = n // bucket_size
    scale = 10.0 ** rng.uniform(-spread, spread, (rows, nb, 1))
    offset = rng.standard_normal((rows, nb, 1)) * scale * rng.choice([0.0, 0.5, 4.0], (rows, nb, 1))
    x = rng.standard_normal((rows, nb, bucket_size)) * scale + offset
    return x.reshape(rows, n).astype(np.float32)


def _large(dtype):
    # Wide, but with unit below 2^126 at every bits so 1/unit stays a normal float (see
    # test_huge_bucket_matches_model for wider buckets).
    return 6e4 if dtype == F16 else 3e37


SPECIAL_KINDS = ("constant", "zeros", "nan", "+inf", "-inf", "large", "one_off")


def with_specials(x, bucket_size, dtype, rng):
    """Puts one bucket of each special kind into x [rows, n] (spread over the rows)."""
    buckets = x.reshape(-1, bucket_size)
    step = max(1, (buckets.shape[0] - 1) // len(SPECIAL_KINDS))
    for k, kind in enumerate(SPECIAL_KINDS):
        i = 1 + k * step
        if i >= buckets.shape[0]:
            break
        j = rng.integers(bucket_size)
        if kind == "constant":
            buckets[i] = -2.75
        elif kind == "zeros":
            buckets[i] = 0.0
        elif kind == "nan":
            buckets[i, j] = np.nan
        elif kind in ("+inf", "-inf"):
            buckets[i, j] = float(kind[0] + "inf")
        elif kind == "large":
            buckets[i] = rng.uniform(-1, 1, bucket_size) * _large(dtype)
            buckets[i, j] = -_large(dtype)
        elif kind == "one_off":
            buckets[i] = 1.5
            buckets[i, j] = 1.25
    return x


def as_dtype(x, dtype):
    """x in `dtype` and the same values exactly in f32 (the model's input)."""
    xd = np.asarray(x, np.float32).astype(dtype)
    return xd, xd.astype(np.float32)


def float_bits(a):
    a = np.asarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def assert_bytes_equal(got, want, what=""):
    got = np.asarray(got)
    assert got.dtype == np.uint8 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{what}: {bad.size} of {got.size} bytes differ, first at flat "
                           f"{bad[:4]}: got {got.ravel()[bad[:4]]}, want {want.ravel()[bad[:4]]}")


def assert_same_floats(got, want, what=""):
    """Bit-identical floats, except that any NaN equals any NaN."""
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
    got_nan, want_nan = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    same = (float_bits(got) == float_bits(want)) | (got_nan & want_nan)
    bad = np.flatnonzero(~same)
    assert bad.size == 0, (f"{what}: {bad.size} of {got.size} values differ, first at "
                           f"{bad[:4]}: got {got.ravel()[bad[:4]]}, want {want.ravel()[bad[:4]]}")


def model_decoded(packets, codec, n, dtype):
    out = model.dequantize_rows(packets, codec.bits, codec.bucket_size, n)
    return out.astype(dtype)


def bucket_extremes(x, bucket_size):
    """Per-element |min| + |max| of the element's bucket, in float64 (for error slack)."""
    b = np.asarray(x, np.float64).reshape(-1, bucket_size)
    mag = np.abs(b.min(-1)) + np.abs(b.max(-1))
    return np.repeat(mag, bucket_size).reshape(np.shape(x))


def per_element_unit(packets, codec, n):
    _, unit, _ = model.split_packets(packets, codec.bits, codec.bucket_size, n)
    return np.repeat(unit.astype(np.float64), codec.bucket_size, axis=-1)


# ---------------------------------------------------------------------------
# The model's building blocks against plain Python integers
# ---------------------------------------------------------------------------

def _mix32_int(x):
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_model_hash_and_noise_match_integer_reference_and_jnp_backend():
    rng = np.random.default_rng(0)
    counters = np.concatenate([np.arange(8), rng.integers(0, 2**32, 1000),
                               [2**32 - 1, 2**31]]).astype(np.uint32)
    seed = np.array([0xDEADBEEF, 0x12345678], np.uint32)
    want = [_mix32_int(((int(c) ^ int(seed[0])) + int(seed[1])) & 0xFFFFFFFF) for c in counters]
    with np.errstate(over="ignore"):
        assert model.mix32((counters ^ seed[0]) + seed[1]).tolist() == want
    noise = model.uniform01(seed, counters)
    assert noise.dtype == np.float32
    np.testing.assert_array_equal(noise, np.array([(h >> 8) / 2**24 for h in want], np.float32))
    assert noise.min() >= 0 and noise.max() < 1
    jnp_noise = np.asarray(jax.jit(jax_backend.uniform01)(seed, counters))
    assert_same_floats(jnp_noise, noise, "jnp uniform01")


@pytest.mark.parametrize("bits", BITS)
def test_model_packing_is_lsb_first_bit_stream(bits):
    rng = np.random.default_rng(bits)
    levels = rng.integers(0, 2**bits, (3, 64)).astype(np.uint32)
    packed = model.pack_levels(levels, bits)
    for row, codes in zip(levels, packed):
        stream = sum(int(v) << (j * bits) for j, v in enumerate(row))
        assert codes.tolist() == list(stream.to_bytes(64 * bits // 8, "little"))
    np.testing.assert_array_equal(model.unpack_levels(packed, bits), levels)


# ---------------------------------------------------------------------------
# Kernels == model, byte for byte
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("bits", BITS)
def test_kernels_match_model(bits, rounding, dtype):
    rng = np.random.default_rng([bits, ROUNDINGS.index(rounding), DTYPES.index(dtype)])
    for bucket_size in (8, 64, 200, 1024):
        codec = codec_of(bits, bucket_size, rounding)
        rows, n = 3, bucket_size * (4 if bucket_size == 1024 else 5)
        x = with_specials(realistic(rng, rows, n, bucket_size), bucket_size, dtype, rng)
        xd, xf = as_dtype(x, dtype)
        seed = rng.integers(0, 2**32, 2, dtype=np.uint32)
        want = model.quantize_rows(xf, seed, bits, bucket_size, codec.stochastic)
        got = quantize(xd, seed, codec)
        assert_bytes_equal(got, want, f"quantize {codec} {dtype}")
        for out_dtype in sorted({F32, dtype}, key=str):
            assert_same_floats(dequantize(got, codec, n, out_dtype),
                               model_decoded(want, codec, n, out_dtype),
                               f"dequantize {codec} -> {out_dtype}")


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("bits,bucket_size,dtype,rows,n", [
    (3, 1024, F32, 1, 1 << 20),
    (5, 64, BF16, 4, 1 << 18),
    (8, 200, F16, 1, 200 * 5243),
], ids=["3b1024f32", "5b64bf16x4", "8b200f16"])
def test_kernels_match_model_on_large_inputs(bits, bucket_size, dtype, rows, n, rounding):
    """Above 2^18 elements the CPU handlers split buckets over XLA's thread pool."""
    rng = np.random.default_rng(bits)
    codec = codec_of(bits, bucket_size, rounding)
    xd, xf = as_dtype(realistic(rng, rows, n, bucket_size), dtype)
    seed = np.array([0x9E3779B9, 7], np.uint32)
    want = model.quantize_rows(xf, seed, bits, bucket_size, codec.stochastic)
    got = quantize(xd, seed, codec)
    assert_bytes_equal(got, want, f"quantize {codec}")
    assert_same_floats(dequantize(got, codec, n, dtype), model_decoded(want, codec, n, dtype),
                       f"dequantize {codec}")


@pytest.mark.parametrize("rows,n", [(4, 64 * 5), (4, 1 << 18)], ids=["small", "threaded"])
def test_quantize_skip_row_zeroes_only_that_row(rows, n):
    """SRA does not encode its own row: ``skip_row`` gives that row zero bytes and leaves the
    other rows byte-identical to a full quantize (same noise counters), with the kernels
    and the jnp backend; an index outside [0, rows) skips nothing."""
    rng = np.random.default_rng(n)
    codec = codec_of(4, 64, "stochastic")
    x = realistic(rng, rows, n, 64)
    seed = np.array([11, 12], np.uint32)
    full = model.quantize_rows(x, seed, 4, 64, True)
    assert full.any(axis=1).all()
    for skip in (-1, 0, 2, rows - 1, rows, 2**31 - 1):
        want = full.copy()
        if 0 <= skip < rows:
            want[skip] = 0
        for name, fn in (("kernels", _quantize), ("jnp", _jnp_quantize)):
            got = np.asarray(fn(on_cpu(x), on_cpu(seed), codec, np.int32(skip)))
            assert_bytes_equal(got, want, f"{name} skip_row={skip}")


def _pad_last(flat, bucket_size):
    extra = -flat.size % bucket_size
    return np.concatenate([flat, np.repeat(flat[-1:], extra)]) if flat.size else flat


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bucket_size", [8, 64, 1024])
def test_public_quantize_dequantize_match_model(bucket_size, dtype):
    """cgx_jax.quantize pads with the last value; the packet is the model's of that input."""
    rng = np.random.default_rng(bucket_size)
    for size in sorted({1, 7, bucket_size - 1, bucket_size, bucket_size + 1}):
        bits = 1 + size % 8
        codec = codec_of(bits, bucket_size, "nearest")
        xd, xf = as_dtype(rng.standard_normal(size) * 3, dtype)
        padded = _pad_last(xf, bucket_size)
        want = model.quantize_rows(padded[None], np.zeros(2, np.uint32), bits, bucket_size, False)
        packet = cgx_jax.quantize(on_cpu(xd), codec)
        assert packet.shape == (wire_bytes(size, codec),)
        assert_bytes_equal(packet, want[0], f"size {size} {codec}")
        decoded = cgx_jax.dequantize(packet, codec, (size,), dtype)
        assert_same_floats(decoded, model_decoded(want, codec, padded.size, dtype)[0, :size],
                           f"size {size} {codec}")


def test_public_quantize_large_odd_size_matches_model():
    size, codec = (1 << 20) + 3, codec_of(4, 1024, "nearest")
    x = realistic(np.random.default_rng(1), 1, 1 << 20, 1024)[0]
    x = np.concatenate([x, [5.0, -5.0, 0.25]]).astype(np.float32)
    padded = _pad_last(x, 1024)
    want = model.quantize_rows(padded[None], np.zeros(2, np.uint32), 4, 1024, False)
    packet = cgx_jax.quantize(on_cpu(x), codec)
    assert_bytes_equal(packet, want[0], "large public quantize")
    assert_same_floats(cgx_jax.dequantize(packet, codec, x.shape),
                       model_decoded(want, codec, padded.size, F32)[0, :size], "large decode")


REDUCE_CASES = [  # (peers, bits, bucket_size, n)
    (1, 2, 64, 64 * 5),
    (3, 5, 200, 200 * 4),
    (8, 8, 8, 8 * 40),
]


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("own_dtype", [None, F32, BF16, F16], ids=str)
@pytest.mark.parametrize("num_peers,bits,bucket_size,n", REDUCE_CASES,
                         ids=[f"N{c[0]}" for c in REDUCE_CASES])
def test_reduce_requantize_matches_model(num_peers, bits, bucket_size, n, own_dtype, rounding):
    rng = np.random.default_rng([num_peers, bits])
    codec = codec_of(bits, bucket_size, rounding)
    chunks = with_specials(realistic(rng, num_peers, n, bucket_size, spread=1.0), bucket_size,
                           F32, rng)
    seed = rng.integers(0, 2**32, 2, dtype=np.uint32)
    peers = model.quantize_rows(chunks, seed[::-1], bits, bucket_size, codec.stochastic)
    own_index = num_peers // 2
    if own_dtype is None:
        own, own_f32 = None, None
    else:
        own, own_f32 = as_dtype(realistic(rng, 1, n, bucket_size)[0], own_dtype)
        own = on_cpu(own)
    want_packet, want_sum = model.reduce_requantize(
        peers, own_f32, own_index, seed, bits, bucket_size, codec.stochastic, n)
    for emit_packet, emit_sum in ((True, False), (False, True), (True, True)):
        packet, total = _reduce(on_cpu(peers), own, on_cpu(np.int32(own_index)), on_cpu(seed),
                                backend=kernels, codec=codec, n=n, emit_packet=emit_packet,
                                emit_sum=emit_sum)
        assert (packet is None) != emit_packet and (total is None) != emit_sum
        if emit_packet:
            assert_bytes_equal(packet, want_packet, f"reduce packet {codec}")
        if emit_sum:
            assert_same_floats(total, want_sum, f"reduce sum {codec}")


def test_reduce_requantize_without_own_ignores_own_index():
    codec = codec_of(4, 64, "stochastic")
    rng = np.random.default_rng(3)
    peers = model.quantize_rows(realistic(rng, 3, 640, 64), [1, 2], 4, 64, True)
    seed = np.array([5, 6], np.uint32)
    want_packet, want_sum = model.reduce_requantize(peers, None, 0, seed, 4, 64, True, 640)
    for own_index in (0, 2, 17, -1):
        packet, total = _reduce(on_cpu(peers), None, np.int32(own_index), seed, backend=kernels,
                                codec=codec, n=640, emit_sum=True)
        assert_bytes_equal(packet, want_packet, f"own_index {own_index}")
        assert_same_floats(total, want_sum, f"own_index {own_index}")


@pytest.mark.parametrize("own", [False, True])
def test_reduce_requantize_matches_model_on_large_chunk(own):
    """3 peers x 2^18 values: enough work for the thread-pool split."""
    codec, n = codec_of(4, 1024, "stochastic"), 1 << 18
    rng = np.random.default_rng(4)
    peers = model.quantize_rows(realistic(rng, 3, n, 1024), [3, 4], 4, 1024, True)
    own_f32 = realistic(rng, 1, n, 1024)[0] if own else None
    seed = np.array([11, 12], np.uint32)
    want_packet, want_sum = model.reduce_requantize(peers, own_f32, 2, seed, 4, 1024, True, n)
    packet, total = _reduce(on_cpu(peers), None if own_f32 is None else on_cpu(own_f32),
                            np.int32(2), seed, backend=kernels, codec=codec, n=n, emit_sum=True)
    assert_bytes_equal(packet, want_packet, "large reduce packet")
    assert_same_floats(total, want_sum, "large reduce sum")


# ---------------------------------------------------------------------------
# jnp backend vs kernels
# ---------------------------------------------------------------------------

# Measured with jaxlib 0.10.2 on CPU over 2^18 normal values, bits 1..8, both roundings and
# several seeds: at most 3 of 262144 levels differ per configuration (1.1e-5; 7.6e-6 with the
# seed below), 2.4e-6 on average, and no decoded value differs. The bound leaves an order of
# magnitude for other XLA versions.
BOUNDARY_FRACTION_BOUND = 1e-4


def _compare_packets(kernel_packet, jnp_packet, x, codec, n):
    """Asserts equal layout, equal min, unit within the reciprocal rewrite's error (equal
    when 2^b - 1 == 1), levels within one; returns the fraction of levels that differ."""
    assert jnp_packet.shape == kernel_packet.shape and jnp_packet.dtype == np.uint8
    b = codec.bits
    mk, uk, lk = model.split_packets(kernel_packet, b, codec.bucket_size, n)
    mj, uj, lj = model.split_packets(jnp_packet, b, codec.bucket_size, n)
    assert_same_floats(mj, mk, f"jnp min {codec}")
    if b == 1:
        assert_same_floats(uj, uk, f"jnp unit {codec}")
    else:
        # XLA turns x / (2^b-1) into x * (1/(2^b-1)): each end moves by ~1.5 eps of itself.
        ends = np.asarray(x, np.float64).reshape(x.shape[0], -1, codec.bucket_size)
        slack = 4 * EPS * (np.abs(ends.min(-1)) + np.abs(ends.max(-1))) / (2**b - 1)
        finite = np.isfinite(uk)
        assert np.array_equal(finite, np.isfinite(uj))
        assert np.all(np.abs(uj[finite].astype(np.float64) - uk[finite]) <= slack[finite])
    diff = np.abs(lk.astype(np.int64) - lj.astype(np.int64))
    assert diff.max() <= 1, f"jnp levels differ by {diff.max()} for {codec}"
    return float(np.mean(diff != 0))


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_jax_backend_matches_kernels_up_to_boundary_levels(rounding):
    n = 1 << 18
    x = np.random.default_rng(5).standard_normal((1, n)).astype(np.float32)
    seed = np.array([0xCAFEF00D, 42], np.uint32)
    fractions = {}
    for bits in BITS:
        codec = codec_of(bits, 1024, rounding)
        kernel_packet = quantize(x, seed, codec)
        jnp_packet = np.asarray(_jnp_quantize(x, seed, codec))
        fractions[f"quantize b{bits}"] = _compare_packets(kernel_packet, jnp_packet, x, codec, n)
        # Decoding the kernel's packet: min + level * unit, at most one rounding apart.
        got = np.asarray(_jnp_dequantize(kernel_packet, codec, n, F32))
        want = dequantize(kernel_packet, codec, n, F32)
        differ = float_bits(got) != float_bits(want)
        assert np.all(np.abs(got - want) <= 2 * EPS * np.abs(want) + 1e-45)
        fractions[f"dequantize b{bits}"] = float(np.mean(differ))
    print(f"\njnp vs kernel, {rounding}: fraction of levels/values that differ:",
          {k: f"{v:.2e}" for k, v in fractions.items()})
    worst = max(fractions, key=fractions.get)
    assert fractions[worst] <= BOUNDARY_FRACTION_BOUND, (worst, fractions[worst])


def test_jax_backend_matches_kernels_on_special_buckets():
    """NaN/inf buckets: identical meta bytes (NaN, NaN) and all-zero levels; the other buckets
    (constant, zeros, large, one-off included) agree as in the test above."""
    rng = np.random.default_rng(6)
    for bits in (1, 4, 8):
        codec = codec_of(bits, 64, "stochastic")
        x = with_specials(realistic(rng, 2, 64 * 8, 64), 64, F32, rng)
        kernel_packet = quantize(x, [1, 2], codec)
        jnp_packet = np.asarray(_jnp_quantize(x, np.array([1, 2], np.uint32), codec))
        _compare_packets(kernel_packet, jnp_packet, x, codec, x.shape[1])
        nonfinite = ~np.all(np.isfinite(x.reshape(-1, 64)), axis=-1)
        assert nonfinite.sum() == 3
        meta_k = kernel_packet[:, : 8 * 8].reshape(-1, 8)[nonfinite]
        meta_j = jnp_packet[:, : 8 * 8].reshape(-1, 8)[nonfinite]
        assert_bytes_equal(meta_j, meta_k, f"non-finite meta {codec}")


# XLA would rewrite max/(2^b-1) - min/(2^b-1) into one fused multiply-add and give a constant
# bucket a unit of one rounding error; the jnp backend keeps the divisions (optimization
# barrier on the divisor), so its unit is 0 like the kernels'.
def test_jax_backend_constant_bucket_has_zero_unit():
    x = np.repeat(np.array([-2.75, 0.1, 1e30], np.float32), 64)[None]
    codec = codec_of(4, 64, "nearest")
    jnp_packet = np.asarray(_jnp_quantize(x, np.zeros(2, np.uint32), codec))
    _, unit, _ = model.split_packets(jnp_packet, 4, 64, x.shape[1])
    assert np.all(unit == 0), unit
    np.testing.assert_array_equal(np.asarray(_jnp_dequantize(jnp_packet, codec, 192, F32)), x)


@pytest.mark.parametrize("with_own", [False, True])
def test_jax_backend_reduce_requantize_matches_kernels(with_own):
    codec, n = codec_of(4, 1024, "stochastic"), 1 << 16
    rng = np.random.default_rng(7)
    chunks = rng.standard_normal((3, n)).astype(np.float32)
    peers = model.quantize_rows(chunks, [8, 9], 4, 1024, True)
    own = rng.standard_normal(n).astype(np.float32) if with_own else None
    seed = np.array([10, 11], np.uint32)
    kwargs = dict(codec=codec, n=n, emit_sum=True)
    kp, ks = _reduce(on_cpu(peers), own, np.int32(1), seed, backend=kernels, **kwargs)
    jp, js = _reduce(peers, own, np.int32(1), seed, backend=jax_backend, **kwargs)
    ks, js = np.asarray(ks), np.asarray(js)
    sum_fraction = float(np.mean(float_bits(ks) != float_bits(js)))
    assert np.all(np.abs(ks - js) <= 4 * EPS * np.abs(ks) + 1e-30)
    level_fraction = _compare_packets(np.asarray(kp)[None], np.asarray(jp)[None], ks[None],
                                      codec, n)
    print(f"\njnp vs kernel reduce_requantize: sums differ {sum_fraction:.2e}, "
          f"levels differ {level_fraction:.2e}")
    assert sum_fraction <= BOUNDARY_FRACTION_BOUND and level_fraction <= BOUNDARY_FRACTION_BOUND


# ---------------------------------------------------------------------------
# Properties of the kernels' rounding, checked in float64
# ---------------------------------------------------------------------------

def _error_slack(x, bucket_size):
    """Float slack of one encode + decode, |min| and |max| of the element's bucket being M:
    the two ends of the unit (each end divided, then subtracted) and the decode's product and
    sum each round by at most eps times their magnitude (<= M), and top * unit ~ max - min;
    the rounding of t = (x - min) * inv + u moves the level by at most ~4 eps * top, i.e.
    about 4 eps * (max - min) in value. 8 eps * M covers all of it. Beside unit/2 it is
    negligible for zero-centred buckets and dominant for buckets whose range is a few ulps of
    their magnitude (where unit is below the inputs' own resolution)."""
    return 8 * EPS * bucket_extremes(x, bucket_size)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_rounding_error_bounds(rounding):
    """Nearest: |x - x'| <= unit/2 (+ slack). Stochastic: |x - x'| < unit (+ slack)."""
    rng = np.random.default_rng(8)
    for bits in BITS:
        for bucket_size in (8, 200):
            codec = codec_of(bits, bucket_size, rounding)
            n = bucket_size * 40
            x = realistic(rng, 2, n, bucket_size, spread=3.0)
            # A bucket only ~100 ulps wide: the unit is below the inputs' resolution.
            x[1, :bucket_size] = 1000.0 + rng.standard_normal(bucket_size) * 1e-3
            packets = quantize(x, rng.integers(0, 2**32, 2, dtype=np.uint32), codec)
            err = np.abs(dequantize(packets, codec, n, F32).astype(np.float64) - x)
            unit = per_element_unit(packets, codec, n)
            limit = (0.5 if rounding == "nearest" else 1.0) * unit + _error_slack(x, bucket_size)
            assert np.all(err <= limit), (codec, np.max(err / unit))
            ratio = np.max(err[unit > 0] / unit[unit > 0])
            # The bound is nearly reached: the check is not vacuous.
            assert ratio > (0.45 if rounding == "nearest" else 0.75), (codec, ratio)


@pytest.mark.parametrize("bits,bucket_size", [(1, 64), (2, 64), (3, 200)])
def test_stochastic_rounding_is_unbiased(bits, bucket_size):
    """The mean of K decodes (K seeds) converges to x: each decode is x plus a zero-mean error
    of standard deviation <= unit/2, so the mean is within 5 sigma = 5 * unit / (2 sqrt K)."""
    k, n = 256, bucket_size * 8
    codec = codec_of(bits, bucket_size, "stochastic")
    rng = np.random.default_rng(bits)
    x = realistic(rng, 1, n, bucket_size, spread=1.0)
    seeds = rng.integers(0, 2**32, (k, 2), dtype=np.uint32)
    assert len({tuple(s) for s in seeds.tolist()}) == k
    packets = jax.jit(jax.vmap(lambda s: kernels.quantize_rows(jnp.asarray(x), s, codec)[0]))(
        on_cpu(seeds))
    decoded = dequantize(packets, codec, n, F32).astype(np.float64)  # [K, n], rows = seeds
    unit = per_element_unit(np.asarray(packets[:1]), codec, n)[0]
    assert np.all(decoded.std(0) <= unit / 2 + 1e-6 * unit)
    bias = decoded.mean(0) - x[0]
    sigma = unit / (2 * np.sqrt(k))
    assert np.all(np.abs(bias) <= 5 * sigma + _error_slack(x, bucket_size)[0]), \
        np.max(np.abs(bias) / sigma)
    # All n*K errors together: their mean (in units) is within 5 sigma of 0, sigma <= 1/2/sqrt(nK).
    assert abs(np.mean(bias / unit)) <= 5 * 0.5 / np.sqrt(n * k)
    # Different seeds draw different noise: most non-grid values take both neighbouring levels.
    assert np.mean(decoded.std(0) > 0) > 0.9


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_constant_buckets_decode_exactly(rounding):
    values = [0.0, -0.0, 1.5, -3.25, 1e-30, -7e30, 3e38, -FLT_MAX, FLT_MAX]
    x = np.repeat(np.array(values, np.float32), 16)[None]
    n = x.shape[1]
    for bits in BITS:
        codec = codec_of(bits, 16, rounding)
        packets = quantize(x, [3, 4], codec)
        _, unit, _ = model.split_packets(packets, bits, 16, n)
        assert np.all(unit == 0)
        np.testing.assert_array_equal(dequantize(packets, codec, n, F32), x)
        for dtype in (BF16, F16):
            small = np.abs(x) < 6e4
            with np.errstate(over="ignore"):  # large values become inf in f16 and bf16
                xd = x.astype(dtype)
            got = quantize(xd, [3, 4], codec)
            np.testing.assert_array_equal(dequantize(got, codec, n, dtype)[small], xd[small])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_nonfinite_bucket_decodes_to_nan_and_spares_the_others(rounding, dtype):
    rng = np.random.default_rng(9)
    bucket_size, nb = 64, 6
    clean = realistic(rng, 1, nb * bucket_size, bucket_size, spread=1.0)
    for bits in BITS:
        codec = codec_of(bits, bucket_size, rounding)
        clean_packet = quantize(clean.astype(dtype), [5, 6], codec)
        clean_decoded = dequantize(clean_packet, codec, clean.shape[1], dtype)
        for bad in (np.nan, np.inf, -np.inf):
            x = clean.copy()
            x[0, 2 * bucket_size + 17] = bad
            packet = quantize(x.astype(dtype), [5, 6], codec)
            mn, unit, _ = model.split_packets(packet, bits, bucket_size, x.shape[1])
            assert np.isnan(mn[0, 2]) and np.isnan(unit[0, 2])
            decoded = dequantize(packet, codec, x.shape[1], dtype).reshape(nb, bucket_size)
            assert np.all(np.isnan(decoded[2].astype(np.float32)))
            others = np.arange(nb) != 2
            assert_same_floats(decoded[others], clean_decoded.reshape(nb, bucket_size)[others],
                               f"{codec} {bad}: other buckets")
            meta = packet[:, : 8 * nb].reshape(nb, 8)
            codes = packet[:, 8 * nb:].reshape(nb, -1)
            clean_meta = clean_packet[:, : 8 * nb].reshape(nb, 8)
            clean_codes = clean_packet[:, 8 * nb:].reshape(nb, -1)
            assert_bytes_equal(meta[others], clean_meta[others])
            assert_bytes_equal(codes[others], clean_codes[others])
            assert not codes[2].any()


def _huge_bucket(rng, bucket_size):
    x = rng.uniform(-3e38, 3e38, bucket_size).astype(np.float32)
    x[:2] = [-3e38, 3e38]
    return x


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_huge_finite_values_decode_to_finite_values(rounding):
    rng = np.random.default_rng(10)
    x = np.stack([_huge_bucket(rng, 64), realistic(rng, 1, 64, 64)[0]]).reshape(1, 128)
    for bits in BITS:
        codec = codec_of(bits, 64, rounding)
        packets = quantize(x, [7, 8], codec)
        _, unit, _ = model.split_packets(packets, bits, 64, 128)
        assert np.isfinite(unit).all()
        if bits == 1:  # 6e38 / 1 overflows and saturates
            assert unit[0, 0] == np.float32(FLT_MAX)
        decoded = dequantize(packets, codec, 128, F32)
        assert np.isfinite(decoded).all(), codec
        assert np.all((decoded >= np.float32(-3e38)) & (decoded <= FLT_MAX))
        for dtype in (BF16,):  # bf16 shares f32's range; +/-3e38 stays finite in it
            got = dequantize(quantize(x.astype(dtype), [7, 8], codec), codec, 128, dtype)
            assert np.isfinite(got.astype(np.float32)).all()
        model_decoded_f32 = model.dequantize_rows(
            model.quantize_rows(x, [7, 8], bits, 64, codec.stochastic), bits, 64, 128)
        assert np.isfinite(model_decoded_f32).all()


# XLA's CPU runtime runs custom calls with FTZ/DAZ set; the kernels clear both, so subnormal
# intermediates (1/unit when unit > 2^126, as for +/-3e38 at 1..3 bits) match the IEEE model.
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("bits", BITS)
def test_huge_bucket_matches_model(bits, rounding):
    x = _huge_bucket(np.random.default_rng(11), 64)[None]
    codec = codec_of(bits, 64, rounding)
    want = model.quantize_rows(x, [1, 1], bits, 64, codec.stochastic)
    got = quantize(x, [1, 1], codec)
    assert_bytes_equal(got, want, f"huge {codec}")
    assert_same_floats(dequantize(got, codec, 64, F32), model_decoded(want, codec, 64, F32))


# In a bucket wider than FLT_MAX (+/-3e38) x - min overflows; encode_level then works at half
# scale so 1e38 keeps its level. (At 1 bit the saturated unit makes the bound unreachable
# by design, so 1 bit is left out.)
@pytest.mark.parametrize("bits", BITS[1:])
def test_huge_bucket_error_bound(bits):
    x = _huge_bucket(np.random.default_rng(11), 64)[None]
    codec = codec_of(bits, 64, "nearest")
    got = quantize(x, [1, 1], codec)
    err = np.abs(dequantize(got, codec, 64, F32).astype(np.float64) - x)
    limit = 0.5 * per_element_unit(got, codec, 64) + _error_slack(x, 64)
    assert np.all(err <= limit), np.max(err / limit)


# A bucket whose max is FLT_MAX: top * unit exceeds max - min by a few ulps; decode_level
# saturates to FLT_MAX instead of overflowing to inf.
@pytest.mark.parametrize("bits", [3, 5])
def test_bucket_reaching_flt_max_decodes_finite(bits):
    x = np.full((1, 8), 0.0 if bits == 5 else 3.3687953e38, np.float32)
    x[0, 0] = FLT_MAX
    codec = codec_of(bits, 8, "nearest")
    decoded = dequantize(quantize(x, [0, 0], codec), codec, 8, F32)
    assert np.isfinite(decoded).all(), decoded


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_subnormal_inputs_do_not_crash(dtype):
    tiny = np.finfo(np.float32).smallest_subnormal if dtype != F16 else 6e-8
    x = np.concatenate([
        np.arange(64) * tiny,                              # all subnormal (in f32/bf16)
        np.linspace(-1, 1, 64) * 1e-39,                    # subnormal, both signs
        np.r_[np.linspace(-1, 1, 63), 1e-40],              # normal and one subnormal
    ]).astype(np.float32)[None]
    xd, xf = as_dtype(x, dtype)
    for bits in (1, 4, 8):
        for rounding in ROUNDINGS:
            codec = codec_of(bits, 64, rounding)
            packets = quantize(xd, [1, 2], codec)
            decoded = dequantize(packets, codec, 192, dtype).astype(np.float64)
            assert np.isfinite(decoded).all()
            # Whatever happens to subnormal arithmetic, each value stays within its bucket's
            # range (plus the smallest normal float) of the input.
            buckets = xf.reshape(3, 64).astype(np.float64)
            span = np.repeat(np.ptp(buckets, -1), 64)
            assert np.all(np.abs(decoded[0] - xf[0]) <= span + 2.0**-125)


def test_subnormal_range_matches_model():
    x = (np.arange(8) * np.float32(1e-40)).astype(np.float32)[None]  # unit ~ 2.7e-42
    codec = codec_of(8, 8, "nearest")
    assert_bytes_equal(quantize(x, [0, 0], codec), model.quantize_rows(x, [0, 0], 8, 8, False))


# ---------------------------------------------------------------------------
# Public quantize / dequantize
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (1,), (7,), (3, 5, 7), (2, 1, 65)], ids=str)
def test_public_round_trip_shapes_and_dtypes(shape, dtype):
    codec = codec_of(8, 64, "stochastic")
    x = np.asarray(np.random.default_rng(12).standard_normal(shape), np.float32).astype(dtype)
    packet = cgx_jax.quantize(x, codec, key=jax.random.key(0))
    size = int(np.prod(shape))
    assert packet.dtype == jnp.uint8 and packet.shape == (wire_bytes(size, codec),)
    for out_dtype in (F32, dtype):
        y = cgx_jax.dequantize(packet, codec, shape, out_dtype)
        assert y.shape == shape and y.dtype == out_dtype
        xf = x.astype(np.float64)
        if size:
            unit = (xf.max() - xf.min()) / 255
            rel = 0 if out_dtype == F32 else 2.0**-8 if out_dtype == BF16 else 2.0**-11
            assert np.all(np.abs(np.asarray(y, np.float64) - xf) <= unit + rel * np.abs(xf) + 1e-6)


def test_public_quantize_accepts_legacy_key_and_differs_by_key():
    codec, x = codec_of(2, 64, "stochastic"), np.linspace(-1, 1, 640, dtype=np.float32)
    a = np.asarray(cgx_jax.quantize(x, codec, key=jax.random.PRNGKey(0)))
    b = np.asarray(cgx_jax.quantize(x, codec, key=jax.random.PRNGKey(0)))
    c = np.asarray(cgx_jax.quantize(x, codec, key=jax.random.PRNGKey(1)))
    np.testing.assert_array_equal(a, b)
    assert np.any(a != c)


def test_stochastic_quantize_without_key_raises():
    with pytest.raises(ValueError, match="key"):
        cgx_jax.quantize(np.ones(8, np.float32), codec_of(4, 8, "stochastic"))


@pytest.mark.parametrize("kwargs,name", [
    (dict(bits=0), "bits"), (dict(bits=9), "bits"), (dict(bits=-1), "bits"),
    (dict(bits=4.5), "bits"), (dict(bits="4"), "bits"), (dict(bits=True), "bits"),
    (dict(bucket_size=0), "bucket_size"), (dict(bucket_size=-8), "bucket_size"),
    (dict(bucket_size=7), "bucket_size"), (dict(bucket_size=12), "bucket_size"),
    (dict(bucket_size=2**40), "bucket_size"), (dict(bucket_size=64.0), "bucket_size"),
    (dict(rounding="up"), "rounding"), (dict(rounding=None), "rounding"),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_invalid_codec_arguments_raise(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name) as info:
        Codec(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)  # the value is named too


@pytest.mark.parametrize("x", [np.arange(8, dtype=np.int32), np.ones(8, bool),
                               np.ones(8, np.complex64)], ids=lambda x: str(x.dtype))
def test_quantize_of_non_float_raises_type_error(x):
    with pytest.raises(TypeError, match="dtype"):
        cgx_jax.quantize(x, codec_of(4, 8, "nearest"))


@pytest.mark.parametrize("packets", [
    np.zeros(packet_bytes(128, codec_of(4, 64, "nearest")) - 1, np.uint8),
    np.zeros(packet_bytes(128, codec_of(4, 64, "nearest")) + 1, np.uint8),
    np.zeros(packet_bytes(64, codec_of(4, 64, "nearest")), np.uint8),
    np.zeros(packet_bytes(128, codec_of(4, 64, "nearest")), np.int8),
    np.zeros(packet_bytes(128, codec_of(4, 64, "nearest")), np.float32),
    np.zeros((1, packet_bytes(128, codec_of(4, 64, "nearest"))), np.uint8),
], ids=["short", "long", "one-bucket", "int8", "float32", "2d"])
def test_dequantize_of_wrong_packets_raises(packets):
    codec = codec_of(4, 64, "nearest")
    assert packet_bytes(128, codec) == wire_bytes(100, codec)
    cgx_jax.dequantize(np.zeros(wire_bytes(100, codec), np.uint8), codec, (10, 10))  # fine
    with pytest.raises(ValueError, match="packets"):
        cgx_jax.dequantize(packets, codec, (10, 10))


# ---------------------------------------------------------------------------
# FFI handlers called directly: every inconsistency is an error, never a crash
# ---------------------------------------------------------------------------

def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _call(target, outs, *args, bits=4, bucket_size=8, **attrs):
    kernels._register()
    call = jax.ffi.ffi_call(target, outs)
    return call(*(on_cpu(a) for a in args), bits=np.int64(bits),
                bucket_size=np.int64(bucket_size), **attrs)


X16 = np.ones((1, 16), np.float32)
SEED = np.zeros(2, np.uint32)
P16 = packet_bytes(16, codec_of(4, 8, "nearest"))  # 48
PEERS = np.zeros((3, P16), np.uint8)
OWN = np.ones(16, np.float32)


def _quantize_call(x=X16, seed=SEED, out=(1, P16), skip_row=np.int32(-1), **attrs):
    attrs.setdefault("stochastic", False)
    return _call("cgx_quantize", _sds(out, jnp.uint8), x, seed, skip_row, **attrs)


def _dequantize_call(packets=np.zeros((1, P16), np.uint8), out=(1, 16), dtype=jnp.float32,
                     **attrs):
    return _call("cgx_dequantize", _sds(out, dtype), packets, **attrs)


def _reduce_call(peers=PEERS, own=OWN, own_index=0, seed=SEED, n=16, packet=P16, total=16,
                 **attrs):
    attrs.setdefault("stochastic", False)
    outs = (_sds((packet,), jnp.uint8), _sds((total,), jnp.float32))
    return _call("cgx_reduce_requantize", outs, peers, own, np.array(own_index, np.int32), seed,
                 n=np.int64(n), **attrs)


FFI_ERROR_CASES = {
    "quantize packets length": (lambda: _quantize_call(out=(1, P16 + 1)), "packets must hold"),
    # (A call whose only result is empty is dropped by XLA, so the result has 8 bytes.)
    "quantize n not multiple": (lambda: _quantize_call(x=np.ones((1, 12), np.float32),
                                                       out=(1, 8)),
                                "x length 12 .*bucket_size"),
    "quantize bits=9": (lambda: _quantize_call(bits=9), "bits must be"),
    "quantize bits=0": (lambda: _quantize_call(bits=0), "bits must be"),
    "quantize bucket_size=12": (lambda: _quantize_call(bucket_size=12), "bucket_size must be"),
    "quantize bucket_size=2^25": (lambda: _quantize_call(bucket_size=2**25),
                                  "bucket_size must be"),
    "quantize seed of 3": (lambda: _quantize_call(seed=np.zeros(3, np.uint32)),
                           "seed must hold 2"),
    "quantize skip_row of 2": (lambda: _quantize_call(skip_row=np.zeros(2, np.int32)),
                               "skip_row must hold 1"),
    "quantize rank 3": (lambda: _quantize_call(x=np.ones((1, 1, 16), np.float32)), "rank"),
    "quantize int32 x": (lambda: _quantize_call(x=np.ones((1, 16), np.int32)), "x must be"),
    "dequantize packets length": (lambda: _dequantize_call(np.zeros((1, P16 - 1), np.uint8)),
                                  "packets must hold"),
    "dequantize n not multiple": (lambda: _dequantize_call(out=(1, 12)),
                                  "output length 12 .*bucket_size"),
    "dequantize bits=9": (lambda: _dequantize_call(bits=9), "bits must be"),
    "dequantize int32 output": (lambda: _dequantize_call(dtype=jnp.int32), "output must be"),
    "reduce bits=9": (lambda: _reduce_call(bits=9), "bits must be"),
    "reduce bucket_size=12": (lambda: _reduce_call(bucket_size=12), "bucket_size must be"),
    "reduce n not multiple": (lambda: _reduce_call(n=12), "n length 12 .*bucket_size"),
    "reduce peers row": (lambda: _reduce_call(peers=np.zeros((3, P16 + 8), np.uint8)),
                         "peers row must hold"),
    "reduce seed of 3": (lambda: _reduce_call(seed=np.zeros(3, np.uint32)), "seed must hold 2"),
    "reduce own length": (lambda: _reduce_call(own=np.ones(8, np.float32)), "own must hold"),
    "reduce own_index = N": (lambda: _reduce_call(own_index=3), "own_index"),
    "reduce own_index < 0": (lambda: _reduce_call(own_index=-1), "own_index"),
    "reduce packet length": (lambda: _reduce_call(packet=P16 - 1), "packet must hold"),
    "reduce sum length": (lambda: _reduce_call(total=15), "sum must hold"),
}


@pytest.mark.parametrize("case", FFI_ERROR_CASES)
def test_ffi_handlers_reject_inconsistent_calls(case):
    make_call, name = FFI_ERROR_CASES[case]
    with pytest.raises(jax.errors.JaxRuntimeError, match=name):
        jax.block_until_ready(make_call())


def test_ffi_handlers_accept_the_consistent_calls():
    """The baselines of the error cases above are valid, so each error comes from its change."""
    assert np.asarray(_quantize_call()).shape == (1, P16)
    assert np.asarray(_dequantize_call()).shape == (1, 16)
    packet, total = _reduce_call(own_index=2)
    np.testing.assert_array_equal(np.asarray(total), OWN)  # zero packets decode to 0
    assert np.asarray(packet).shape == (P16,)
    packet, total = _reduce_call(own=np.zeros(0, np.float32), own_index=7, packet=0)
    assert np.asarray(packet).shape == (0,) and np.asarray(total).shape == (16,)
