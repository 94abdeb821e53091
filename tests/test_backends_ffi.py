"""backends/ffi.py: the three codec kernels (cgx_quantize, cgx_dequantize,
cgx_reduce_requantize) against the numpy model, tests/numpy_model.py, byte for byte
(docs/design.md sections 2 and 3), large inputs split over XLA's thread pool included; the
model's own building blocks against plain Python integers; properties of the rounding (error
bounds, unbiased stochastic rounding, constant, non-finite, huge and subnormal buckets); and
the FFI handlers called directly, where every inconsistency is an error (section 8).

Everything runs on the CPU device, also on a machine with a GPU. The jnp backend is compared
with these kernels in test_backends_pure_jax.py, the CUDA kernels in test_backends_cuda.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpy_model as model
import pytest
from helpers import (
    BF16,
    BITS,
    DTYPES,
    EPS,
    F16,
    F32,
    ROUNDINGS,
    as_dtype,
    assert_bytes_equal,
    assert_same_floats,
    codec_of,
    dequantize,
    ffi_quantize,
    jit_reduce,
    jnp_quantize,
    model_decoded,
    on_cpu,
    quantize,
    realistic,
    reduce_outputs,
    with_specials,
)

from cgx_jax._src.backends import ffi, pure_jax
from cgx_jax._src.codec import packet_bytes

pytestmark = pytest.mark.usefixtures("cpu_default_device")

FLT_MAX = float(np.finfo(np.float32).max)


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
    jnp_noise = np.asarray(jax.jit(pure_jax.uniform01)(seed, counters))
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
        for name, fn in (("kernels", ffi_quantize), ("jnp", jnp_quantize)):
            got = np.asarray(fn(on_cpu(x), on_cpu(seed), codec, np.int32(skip)))
            assert_bytes_equal(got, want, f"{name} skip_row={skip}")


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n,short", [(3, 64 * 5, 70), (4, 1 << 18, 1000)],
                         ids=["small", "threaded"])
def test_quantize_with_residual_writes_x_minus_decoded(rows, n, short, dtype, rounding):
    """``with_residual`` (error feedback's residual, written by the encoding kernel): the same
    packets as without it, and residual == x - decode(packets) bit for bit against the numpy
    model, with 0 in the skipped row, for a flat x whose last row is short (the missing
    values are padding, so they have no loss to report) and buckets with NaN, infinities and
    huge ranges; the jnp backend gives the same bits."""
    rng = np.random.default_rng([n, DTYPES.index(dtype), ROUNDINGS.index(rounding)])
    codec = codec_of(3, 64, rounding)
    x = with_specials(realistic(rng, rows, n, 64), 64, dtype, rng)
    xd, xf = as_dtype(x, dtype)
    flat_d, flat_f = xd.reshape(-1)[:rows * n - short], xf.reshape(-1)[:rows * n - short]
    padded = np.concatenate([flat_f, np.repeat(flat_f[-1:], short)]).reshape(rows, n)
    seed = rng.integers(0, 2**32, 2, dtype=np.uint32)
    for skip in (-1, 1):
        want = model.quantize_rows(padded, seed, 3, 64, codec.stochastic, skip)
        want_residual = model.residual_rows(padded, want, 3, 64, skip).reshape(-1)[:flat_f.size]
        for name, backend in (("kernels", ffi), ("jnp", pure_jax)):
            encode = jax.jit(lambda x, s, b=backend, k=skip: b.quantize_rows(  # noqa: B023
                x, s, codec, skip_row=k, n=n, with_residual=True))
            packets, residual = encode(on_cpu(flat_d), on_cpu(seed))
            assert residual.dtype == jnp.float32 and residual.shape == flat_d.shape
            assert_bytes_equal(np.asarray(packets), want, f"{name} packets skip_row={skip}")
            assert_same_floats(np.asarray(residual), want_residual,
                               f"{name} residual skip_row={skip}")


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
        packet, total = jit_reduce(on_cpu(peers), own, on_cpu(np.int32(own_index)), on_cpu(seed),
                                   backend=ffi, codec=codec, n=n, emit_packet=emit_packet,
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
        packet, total = jit_reduce(on_cpu(peers), None, np.int32(own_index), seed, backend=ffi,
                                   codec=codec, n=640, emit_sum=True)
        assert_bytes_equal(packet, want_packet, f"own_index {own_index}")
        assert_same_floats(total, want_sum, f"own_index {own_index}")


@pytest.mark.parametrize("own_dtype", [F32, BF16, F16], ids=str)
def test_reduce_requantize_reads_row_own_index_of_all_rows(own_dtype):
    # SRA passes its whole [N, n] buffer as own: the result must be the one of the [n] row.
    codec = codec_of(3, 64, "stochastic")
    rng = np.random.default_rng(5)
    num_peers, n = 4, 640
    peers = model.quantize_rows(realistic(rng, num_peers, n, 64), [7, 8], 3, 64, True)
    rows, rows_f32 = as_dtype(realistic(rng, num_peers, n, 64), own_dtype)
    seed = np.array([9, 10], np.uint32)
    for own_index in range(num_peers):
        want_packet, want_sum = model.reduce_requantize(
            peers, rows_f32[own_index], own_index, seed, 3, 64, True, n)
        packet, total = jit_reduce(on_cpu(peers), on_cpu(rows), np.int32(own_index), seed,
                                   backend=ffi, codec=codec, n=n, emit_sum=True)
        assert_bytes_equal(packet, want_packet, f"own row {own_index}")
        assert_same_floats(total, want_sum, f"own row {own_index}")


@pytest.mark.parametrize("backend", [ffi, pure_jax], ids=["ffi", "jax"])
def test_packet_windows_read_in_place_match_model(backend):
    # Rows carrying two segments' packets one after the other (SRA's wire rows): decoding
    # and reducing the second one at its byte offset gives the bytes of the packets alone.
    codec = codec_of(3, 64, "stochastic")
    rng = np.random.default_rng(6)
    num_peers, n_first, n = 4, 192, 640
    first = model.quantize_rows(realistic(rng, num_peers, n_first, 64), [1, 2], 3, 64, True)
    second = model.quantize_rows(realistic(rng, num_peers, n, 64), [3, 4], 3, 64, True)
    rows = np.concatenate([first, second, np.full((num_peers, 5), 0xAB, np.uint8)], axis=1)
    offset = first.shape[1]
    decoded = jax.jit(backend.dequantize_rows, static_argnums=(1, 2, 3, 4))(
        on_cpu(rows), codec, n, np.dtype(np.float32), offset)
    assert_same_floats(decoded, model.dequantize_rows(second, 3, 64, n), "dequantize")
    own = realistic(rng, 1, n, 64)[0]
    seed = np.array([9, 10], np.uint32)
    packet, total = jax.jit(functools.partial(reduce_outputs, backend, codec=codec, n=n,
                                              emit_sum=True, offset=offset))(
        on_cpu(rows), on_cpu(own), np.int32(2), seed)
    want_packet, want_sum = model.reduce_requantize(second, own, 2, seed, 3, 64, True, n)
    assert_bytes_equal(packet, want_packet, "reduce packet")
    assert_same_floats(total, want_sum, "reduce sum")


@pytest.mark.parametrize("backend,dtype", [(ffi, F32), (ffi, BF16), (ffi, F16), (pure_jax, F32)],
                         ids=["ffi-f32", "ffi-bf16", "ffi-f16", "jax-f32"])
def test_short_last_row_reads_as_padding_and_writes_only_its_values(backend, dtype):
    # A large leaf short of whole chunks travels in place (fusion.py): the kernels read its
    # missing values as its last one and write only the values it has. The model sees the
    # leaf padded with its last value (codec.pad_to_multiple), then cut back.
    codec = codec_of(3, 64, "stochastic")
    rng = np.random.default_rng(11)
    rows, n = 4, 640
    seed = np.array([9, 10], np.uint32)
    peers = model.quantize_rows(realistic(rng, rows, n, 64), [7, 8], 3, 64, True)
    for size in (rows * n - 1, rows * n - 63, rows * n - 64, rows * n - 65, (rows - 1) * n + 1):
        x, x32 = as_dtype(realistic(rng, 1, rows * n, 64)[0, :size], dtype)
        padded = np.concatenate([x32, np.repeat(x32[-1:], rows * n - size)]).reshape(rows, n)
        what = f"{size} of {rows} x {n} values"
        packets = jax.jit(functools.partial(backend.quantize_rows, codec=codec, n=n))(
            on_cpu(x), seed, skip_row=np.int32(1))
        want = model.quantize_rows(padded, seed, 3, 64, True, 1)
        assert_bytes_equal(packets, want, f"quantize {what}")
        decoded = jax.jit(functools.partial(backend.dequantize_rows, codec=codec, n=n,
                                            dtype=dtype, size=size))(on_cpu(want))
        want_decoded = model.dequantize_rows(want, 3, 64, n).astype(dtype).reshape(-1)[:size]
        assert decoded.shape == (size,)
        assert_same_floats(decoded, want_decoded, f"dequantize {what}")
        reduce = jax.jit(functools.partial(reduce_outputs, backend, codec=codec, n=n,
                                           emit_sum=True, size=size - 3 * n))
        for own_index in (0, rows - 1):  # a full row, and the short one
            packet, total = reduce(on_cpu(peers), on_cpu(x), np.int32(own_index), seed)
            want_packet, want_sum = model.reduce_requantize(peers, padded[own_index], own_index,
                                                            seed, 3, 64, True, n)
            assert_bytes_equal(packet, want_packet, f"reduce own row {own_index} of {what}")
            assert total.shape == (size - 3 * n,)
            assert_same_floats(total, want_sum[:size - 3 * n], f"short sum, {what}")


@pytest.mark.parametrize("backend,dtype", [(ffi, F32), (ffi, BF16), (ffi, F16), (pure_jax, F32),
                                           (pure_jax, BF16)],
                         ids=["ffi-f32", "ffi-bf16", "ffi-f16", "jax-f32", "jax-bf16"])
def test_divisor_divides_decoded_values_before_narrowing(backend, dtype):
    # compressed_pmean divides in the kernel that writes the result: each value is
    # multiplied by 1 / divisor rounded to f32 (XLA:CPU's x / divisor), then narrowed to the
    # output dtype; the reduction's packet still encodes the undivided sum.
    codec = codec_of(4, 64, "stochastic")
    rng = np.random.default_rng(12)
    rows, n = 3, 640
    x = with_specials(realistic(rng, rows, n, 64), 64, F32, rng)
    packets = model.quantize_rows(x, [1, 2], 4, 64, True)
    decoded = model.dequantize_rows(packets, 4, 64, n)
    own = realistic(rng, 1, n, 64)[0]
    seed = np.array([3, 4], np.uint32)
    want_packet, want_sum = model.reduce_requantize(packets, own, 1, seed, 4, 64, True, n)
    for divisor in (1, 3, 7, 2**24):
        got = jax.jit(functools.partial(backend.dequantize_rows, codec=codec, n=n, dtype=dtype,
                                        divisor=divisor))(on_cpu(packets))
        scale = np.float32(1) / np.float32(divisor)
        with np.errstate(over="ignore"):  # f16 narrows huge values to inf, as the kernel does
            want = (decoded * scale).astype(dtype)
        assert_same_floats(got, want, f"dequantize / {divisor}")
        packet, total = jax.jit(functools.partial(
            reduce_outputs, backend, codec=codec, n=n, emit_sum=True, divisor=divisor))(
            on_cpu(packets), on_cpu(own), np.int32(1), seed)
        assert_bytes_equal(packet, want_packet, f"reduce packet, divisor {divisor}")
        assert_same_floats(total, want_sum * scale, f"reduce sum / {divisor}")


@pytest.mark.parametrize("own", [False, True])
def test_reduce_requantize_matches_model_on_large_chunk(own):
    """3 peers x 2^18 values: enough work for the thread-pool split."""
    codec, n = codec_of(4, 1024, "stochastic"), 1 << 18
    rng = np.random.default_rng(4)
    peers = model.quantize_rows(realistic(rng, 3, n, 1024), [3, 4], 4, 1024, True)
    own_f32 = realistic(rng, 1, n, 1024)[0] if own else None
    seed = np.array([11, 12], np.uint32)
    want_packet, want_sum = model.reduce_requantize(peers, own_f32, 2, seed, 4, 1024, True, n)
    packet, total = jit_reduce(on_cpu(peers), None if own_f32 is None else on_cpu(own_f32),
                               np.int32(2), seed, backend=ffi, codec=codec, n=n, emit_sum=True)
    assert_bytes_equal(packet, want_packet, "large reduce packet")
    assert_same_floats(total, want_sum, "large reduce sum")


# ---------------------------------------------------------------------------
# Properties of the kernels' rounding, checked in float64
# ---------------------------------------------------------------------------

def bucket_extremes(x, bucket_size):
    """Per-element |min| + |max| of the element's bucket, in float64 (for error slack)."""
    b = np.asarray(x, np.float64).reshape(-1, bucket_size)
    mag = np.abs(b.min(-1)) + np.abs(b.max(-1))
    return np.repeat(mag, bucket_size).reshape(np.shape(x))


def per_element_unit(packets, codec, n):
    _, unit, _ = model.split_packets(packets, codec.bits, codec.bucket_size, n)
    return np.repeat(unit.astype(np.float64), codec.bucket_size, axis=-1)


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
    packets = jax.jit(jax.vmap(lambda s: ffi.quantize_rows(jnp.asarray(x), s, codec)[0]))(
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
# FFI handlers called directly: every inconsistency is an error, never a crash
# ---------------------------------------------------------------------------

def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _call(target, outs, *args, bits=4, bucket_size=8, **attrs):
    ffi._register()
    call = jax.ffi.ffi_call(target, outs)
    return call(*(on_cpu(a) for a in args), bits=np.int64(bits),
                bucket_size=np.int64(bucket_size), **attrs)


X16 = np.ones((1, 16), np.float32)
SEED = np.zeros(2, np.uint32)
P16 = packet_bytes(16, codec_of(4, 8, "nearest"))  # 48
PEERS = np.zeros((3, P16), np.uint8)
OWN = np.ones(16, np.float32)


def _quantize_call(x=X16, seed=SEED, out=(1, P16), skip_row=np.int32(-1), n=16,
                   residual=None, **attrs):
    """cgx_quantize, or with ``residual`` values cgx_quantize_with_residual."""
    attrs.setdefault("stochastic", False)
    packets = _sds(out, jnp.uint8)
    if residual is None:
        return _call("cgx_quantize", packets, x, seed, skip_row, n=np.int64(n), **attrs)
    return _call("cgx_quantize_with_residual", (packets, _sds((residual,), jnp.float32)), x,
                 seed, skip_row, n=np.int64(n), **attrs)[0]


def _dequantize_call(packets=np.zeros((1, P16), np.uint8), out=(1, 16), dtype=jnp.float32,
                     offset=0, n=16, divisor=1, **attrs):
    return _call("cgx_dequantize", _sds(out, dtype), packets, offset=np.int64(offset),
                 n=np.int64(n), divisor=np.int64(divisor), **attrs)


def _reduce_call(peers=PEERS, own=OWN, own_index=0, seed=SEED, n=16, packet=P16, total=16,
                 offset=0, **attrs):
    """cgx_reduce_requantize_with_sum: ``(packet, sum)``."""
    attrs.setdefault("stochastic", False)
    outs = (_sds((packet,), jnp.uint8), _sds((total,), jnp.float32))
    return _call("cgx_reduce_requantize_with_sum", outs, peers, own,
                 np.array(own_index, np.int32), seed, n=np.int64(n), offset=np.int64(offset),
                 **attrs)


def _reduce_packet_call(peers=PEERS, own=OWN, own_index=0, seed=SEED, n=16, packet=P16,
                        **attrs):
    """cgx_reduce_requantize: the packet."""
    attrs.setdefault("stochastic", False)
    return _call("cgx_reduce_requantize", _sds((packet,), jnp.uint8), peers, own,
                 np.array(own_index, np.int32), seed, n=np.int64(n), offset=np.int64(0),
                 **attrs)


def _reduce_sum_call(peers=PEERS, own=OWN, own_index=0, n=16, total=16, divisor=1, **attrs):
    """cgx_reduce_sum: the sum."""
    return _call("cgx_reduce_sum", _sds((total,), jnp.float32), peers, own,
                 np.array(own_index, np.int32), n=np.int64(n), offset=np.int64(0),
                 divisor=np.int64(divisor), **attrs)


FFI_ERROR_CASES = {
    "quantize packets length": (lambda: _quantize_call(out=(1, P16 + 1)),
                                f"packets rows must hold {P16} bytes"),
    # (A call whose only result is empty is dropped by XLA, so the result has 8 bytes.)
    "quantize n not multiple": (lambda: _quantize_call(x=np.ones((1, 12), np.float32),
                                                       out=(1, 8), n=12),
                                "n length 12 .*bucket_size"),
    "quantize x short of its rows": (
        lambda: _quantize_call(out=(2, P16)),
        r"x must hold 2 rows of 16 values, the last possibly short \(17 to 32 values\), got 16"),
    "quantize x past its rows": (lambda: _quantize_call(x=np.ones(17, np.float32)),
                                 r"x must hold 1 rows of 16 values.*got 17"),
    "quantize bits=9": (lambda: _quantize_call(bits=9), "bits must be"),
    "quantize bits=0": (lambda: _quantize_call(bits=0), "bits must be"),
    "quantize bucket_size=12": (lambda: _quantize_call(bucket_size=12), "bucket_size must be"),
    "quantize bucket_size=2^25": (lambda: _quantize_call(bucket_size=2**25),
                                  "bucket_size must be"),
    "quantize seed of 3": (lambda: _quantize_call(seed=np.zeros(3, np.uint32)),
                           "seed must hold 2"),
    "quantize skip_row of 2": (lambda: _quantize_call(skip_row=np.zeros(2, np.int32)),
                               "skip_row must hold 1"),
    "quantize packets rank 3": (lambda: _quantize_call(out=(1, 1, P16)), "rank"),
    "quantize int32 x": (lambda: _quantize_call(x=np.ones((1, 16), np.int32)), "x must be"),
    "quantize residual of 15": (lambda: _quantize_call(residual=15),
                                r"residual must hold as many values as x \(16\), got 15"),
    "quantize residual of 0": (lambda: _quantize_call(residual=0),
                               r"residual must hold as many values as x \(16\), got 0"),
    "dequantize packets length": (lambda: _dequantize_call(np.zeros((1, P16 - 1), np.uint8)),
                                  f"packets rows of {P16 - 1} bytes cannot hold a packet of "
                                  f"{P16} bytes at offset 0"),
    "dequantize window past the row": (
        lambda: _dequantize_call(np.zeros((1, P16 + 7), np.uint8), offset=8),
        f"packets rows of {P16 + 7} bytes cannot hold a packet of {P16} bytes at offset 8"),
    "dequantize negative offset": (lambda: _dequantize_call(offset=-1), "at offset -1"),
    "dequantize packets rows": (lambda: _dequantize_call(np.zeros((2, P16), np.uint8)),
                                r"output must hold 2 rows of 16 values.*\(17 to 32 values\), "
                                "got 16"),
    "dequantize output past its rows": (lambda: _dequantize_call(out=(17,)),
                                        "output must hold 1 rows of 16 values.*got 17"),
    "dequantize n not multiple": (lambda: _dequantize_call(out=(1, 12), n=12),
                                  "n length 12 .*bucket_size"),
    "dequantize bits=9": (lambda: _dequantize_call(bits=9), "bits must be"),
    "dequantize int32 output": (lambda: _dequantize_call(dtype=jnp.int32), "output must be"),
    "dequantize divisor=0": (lambda: _dequantize_call(divisor=0),
                             r"divisor must be in \[1, 16777216\], got 0"),
    "dequantize divisor=2^24+1": (lambda: _dequantize_call(divisor=2**24 + 1),
                                  "divisor must be in .*got 16777217"),
    "reduce bits=9": (lambda: _reduce_call(bits=9), "bits must be"),
    "reduce_sum divisor=-3": (lambda: _reduce_sum_call(divisor=-3),
                              "divisor must be in .*got -3"),
    "reduce_sum bits=9": (lambda: _reduce_sum_call(bits=9), "bits must be"),
    "reduce_sum sum length": (lambda: _reduce_sum_call(total=17),
                              "sum must hold 1 rows of 16 values"),
    "reduce_sum own_index = N": (lambda: _reduce_sum_call(own_index=3), "own_index"),
    "reduce_requantize packet length": (lambda: _reduce_packet_call(packet=P16 + 1),
                                        "packet must hold"),
    "reduce_requantize seed of 1": (lambda: _reduce_packet_call(seed=np.zeros(1, np.uint32)),
                                    "seed must hold 2"),
    "reduce bucket_size=12": (lambda: _reduce_call(bucket_size=12), "bucket_size must be"),
    "reduce n not multiple": (lambda: _reduce_call(n=12), "n length 12 .*bucket_size"),
    "reduce peers row": (lambda: _reduce_call(peers=np.zeros((3, P16 - 8), np.uint8)),
                         f"peers rows of {P16 - 8} bytes cannot hold a packet of {P16} bytes"),
    "reduce window past the row": (
        lambda: _reduce_call(peers=np.zeros((3, P16 + 8), np.uint8), offset=9),
        f"peers rows of {P16 + 8} bytes cannot hold a packet of {P16} bytes at offset 9"),
    "reduce seed of 3": (lambda: _reduce_call(seed=np.zeros(3, np.uint32)), "seed must hold 2"),
    "reduce own length": (lambda: _reduce_call(own=np.ones(8, np.float32)), "own must hold"),
    "reduce own of 2 rows": (lambda: _reduce_call(own=np.ones(32, np.float32)),
                             "own must hold n = 16 elements, all 3 rows"),
    "reduce own_index = N": (lambda: _reduce_call(own_index=3), "own_index"),
    "reduce own_index < 0": (lambda: _reduce_call(own_index=-1), "own_index"),
    "reduce packet length": (lambda: _reduce_call(packet=P16 - 1), "packet must hold"),
    "reduce sum length": (lambda: _reduce_call(total=17), "sum must hold 1 rows of 16 values"),
    "reduce empty sum": (lambda: _reduce_call(total=0), "sum must hold 1 rows of 16 values"),
    "reduce own short of its rows": (lambda: _reduce_call(own=np.ones(33, np.float32)[:32]),
                                     r"all 3 rows \(33 to 48, the last row possibly short\)"),
}


@pytest.mark.parametrize("case", FFI_ERROR_CASES)
def test_ffi_handlers_reject_inconsistent_calls(case):
    make_call, name = FFI_ERROR_CASES[case]
    with pytest.raises(jax.errors.JaxRuntimeError, match=name):
        jax.block_until_ready(make_call())


def test_ffi_handlers_accept_the_consistent_calls():
    """The baselines of the error cases above are valid, so each error comes from its change."""
    assert np.asarray(_quantize_call()).shape == (1, P16)
    assert np.asarray(_quantize_call(residual=16)).shape == (1, P16)
    assert np.asarray(_reduce_packet_call(own_index=2)).shape == (P16,)
    assert np.asarray(_dequantize_call()).shape == (1, 16)
    packet, total = _reduce_call(own_index=2)
    np.testing.assert_array_equal(np.asarray(total), OWN)  # zero packets decode to 0
    assert np.asarray(packet).shape == (P16,)
    total = _reduce_sum_call(own=np.zeros(0, np.float32), own_index=7)  # no own: any index
    np.testing.assert_array_equal(np.asarray(total), np.zeros(16, np.float32))
    # Short last rows: x, the output, own (all rows) and the sum.
    assert np.asarray(_quantize_call(x=np.ones(17, np.float32), out=(2, P16))).shape == (2, P16)
    assert np.asarray(_dequantize_call(np.zeros((2, P16), np.uint8), out=(17,))).shape == (17,)
    packet, total = _reduce_call(own=np.ones(33, np.float32), own_index=2, total=5)
    np.testing.assert_array_equal(np.asarray(total), np.ones(5, np.float32))
    # The largest divisor.
    total = _reduce_sum_call(own_index=2, divisor=2**24)
    np.testing.assert_array_equal(np.asarray(total), OWN * np.float32(2.0**-24))
