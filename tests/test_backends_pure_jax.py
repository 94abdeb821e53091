"""backends/pure_jax.py, the jnp codec (backend="jax"), against the FFI kernels: the same packet
layout and min, the unit within the error of XLA's reciprocal rewrite, levels within one and at
most a 1e-4 fraction of them differing (docs/design.md section 1, "One format, three
implementations"); the same for reduce_requantize; non-finite and constant buckets; and a
whole compressed_psum with either backend. Runs on the CPU device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_model as model
import pytest
from helpers import (
    BITS,
    EPS,
    F32,
    ROUNDINGS,
    assert_bytes_equal,
    assert_same_floats,
    codec_of,
    dequantize,
    float_bits,
    jit_reduce,
    jnp_dequantize,
    jnp_quantize,
    on_cpu,
    quantize,
    realistic,
    run_sharded,
    with_specials,
)

import cgx_jax as cgx
from cgx_jax._src.backends import ffi, pure_jax

pytestmark = pytest.mark.usefixtures("cpu_default_device")


# ---------------------------------------------------------------------------
# The codec operations against the kernels
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
        jnp_packet = np.asarray(jnp_quantize(x, seed, codec))
        fractions[f"quantize b{bits}"] = _compare_packets(kernel_packet, jnp_packet, x, codec, n)
        # Decoding the kernel's packet: min + level * unit, at most one rounding apart.
        got = np.asarray(jnp_dequantize(kernel_packet, codec, n, F32))
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
        jnp_packet = np.asarray(jnp_quantize(x, np.array([1, 2], np.uint32), codec))
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
    jnp_packet = np.asarray(jnp_quantize(x, np.zeros(2, np.uint32), codec))
    _, unit, _ = model.split_packets(jnp_packet, 4, 64, x.shape[1])
    assert np.all(unit == 0), unit
    np.testing.assert_array_equal(np.asarray(jnp_dequantize(jnp_packet, codec, 192, F32)), x)


@pytest.mark.parametrize("with_own", [None, "chunk", "rows"])
def test_jax_backend_reduce_requantize_matches_kernels(with_own):
    codec, n = codec_of(4, 1024, "stochastic"), 1 << 16
    rng = np.random.default_rng(7)
    chunks = rng.standard_normal((3, n)).astype(np.float32)
    peers = model.quantize_rows(chunks, [8, 9], 4, 1024, True)
    # "rows": all three rows, of which both backends read row own_index = 1.
    own = (None if with_own is None else
           rng.standard_normal(n if with_own == "chunk" else (3, n)).astype(np.float32))
    seed = np.array([10, 11], np.uint32)
    kwargs = dict(codec=codec, n=n, emit_sum=True)
    kp, ks = jit_reduce(on_cpu(peers), own, np.int32(1), seed, backend=ffi, **kwargs)
    jp, js = jit_reduce(peers, own, np.int32(1), seed, backend=pure_jax, **kwargs)
    ks, js = np.asarray(ks), np.asarray(js)
    sum_fraction = float(np.mean(float_bits(ks) != float_bits(js)))
    assert np.all(np.abs(ks - js) <= 4 * EPS * np.abs(ks) + 1e-30)
    level_fraction = _compare_packets(np.asarray(kp)[None], np.asarray(jp)[None], ks[None],
                                      codec, n)
    print(f"\njnp vs kernel reduce_requantize: sums differ {sum_fraction:.2e}, "
          f"levels differ {level_fraction:.2e}")
    assert sum_fraction <= BOUNDARY_FRACTION_BOUND and level_fraction <= BOUNDARY_FRACTION_BOUND


# ---------------------------------------------------------------------------
# A whole compressed_psum
# ---------------------------------------------------------------------------

def test_ffi_and_jax_backends_agree():
    codec = cgx.Codec(bits=4, bucket_size=128, rounding="nearest")
    inputs = jax.random.normal(jax.random.key(3), (8, 4096))
    results = {
        backend: np.asarray(run_sharded(
            lambda x: cgx.compressed_psum(x, "batch", codec=codec, backend=backend), inputs, 8))
        for backend in ("ffi", "jax")}
    unit_bound = 8 * float(jnp.max(jnp.abs(inputs))) * 2 / 15  # a level step of the sum
    diff = np.abs(results["ffi"] - results["jax"])
    assert np.max(diff) <= unit_bound
    # XLA rewrites the jnp float arithmetic (reciprocals, fused multiply-adds), so values
    # differ by ulps everywhere and by a whole level only at rounding boundaries.
    level_steps = diff > 1e-3 * unit_bound
    assert np.mean(level_steps) < 0.01, np.mean(level_steps)


@pytest.mark.parametrize("bits", BITS)
def test_ties_round_up_in_both_backends(bits):
    # Values exactly halfway between two levels, and the bucket's own min and max, in buckets
    # whose unit is a power of two (so every step is exact in f32): nearest rounding is
    # floor(t + 0.5) (ties up; docs/design.md section 2) in the kernels, the jnp backend and
    # the numpy model, byte for byte. Half-to-even rounding would differ on every even level.
    top = 2**bits - 1
    size = 512  # holds min, max and all 2^b - 1 half levels for every b
    halves = np.arange(top, dtype=np.float32) + 0.5            # t = k + 1/2, k = 0..top-1
    bucket = np.resize(np.concatenate([[0.0, float(top)], halves]), size).astype(np.float32)
    rows = np.stack([bucket * scale + shift for scale, shift in
                     ((1.0, 0.0), (0.125, 0.0), (4.0, -64.0), (0.5, 1.0))]).astype(np.float32)
    codec = codec_of(bits, size, "nearest")
    seed = np.zeros(2, np.uint32)
    want = model.quantize_rows(rows, seed, bits, size, False)
    assert_bytes_equal(quantize(rows, seed, codec), want, "kernels vs model")
    assert_bytes_equal(jnp_quantize(on_cpu(rows), on_cpu(seed), codec), want, "jnp vs model")
    decoded = dequantize(want, codec, size, F32)[0]  # row 0: unit 1, min 0, so value = level
    expected = np.resize(np.concatenate([[0.0, top], np.arange(1, top + 1)]), size)
    np.testing.assert_array_equal(decoded, expected)  # each half level went up


def test_both_backends_have_the_same_signatures():
    """The callers use either module through get_backend: the same names, parameters and
    defaults (a parameter added to one only would be a TypeError on the other backend)."""
    import inspect

    from cgx_jax._src.backends import ffi, pure_jax

    def parameters(function):
        return [(p.name, p.kind, p.default)
                for p in inspect.signature(function).parameters.values()]

    for name in ("quantize_rows", "dequantize_rows", "reduce_requantize",
                 "reduce_requantize_with_sum", "reduce_sum"):
        assert parameters(getattr(ffi, name)) == parameters(getattr(pure_jax, name)), name
