"""backends/ffi.py on CPU (docs/design.md section 3): the bucket loops are compiled per
instruction set (generic, AVX2, AVX-512) and picked at run time; every variant must write the
same bytes, and each the numpy model's (tests/numpy_model.py), so a CPU that runs only the
generic variant is covered too. Each runs in its own process, forced with CGX_JAX_CPU_ISA,
through the FFI handlers, on inputs that take the codec's edge cases (stochastic and
nearest, three dtypes, buckets wider than the largest float, NaN, subnormals) at 1, 3, 4 and
8 bits. Every bit width, the loops alone, is tests/test_cpu_loops.py's C++ driver."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.starts_processes  # run first (tests/conftest.py)

SCRIPT = textwrap.dedent("""
    import hashlib, jax, jax.numpy as jnp, numpy as np
    from cgx_jax import _cgx_cpu
    from cgx_jax._src.backends import ffi
    from cgx_jax._src.codec import Codec
    import numpy_model as model
    from helpers import as_dtype, assert_bytes_equal, assert_same_floats, model_decoded
    rng = np.random.default_rng(0)
    scales = np.float32(10.0) ** rng.integers(-3, 3, (3, 1))
    x = rng.standard_normal((3, 4096)).astype(np.float32) * scales
    x[0, :64] = np.linspace(-3e38, 3e38, 64); x[1, 64:128] = np.arange(64) * 1e-41; x[2, 5] = np.nan
    digest = hashlib.sha256()
    mismatches = []
    seed = jnp.array([3, 4], jnp.uint32)
    for bits in (1, 3, 4, 8):  # a bit, packed across bytes, the default, a byte
        for rounding in ("stochastic", "nearest"):
            codec = Codec(bits, 64, rounding)
            for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
                packets = ffi.quantize_rows(jnp.asarray(x, dtype), seed, codec)
                xd, xf = as_dtype(x, dtype)
                skipped, residual = ffi.quantize_rows(jnp.asarray(xd), seed, codec, skip_row=2,
                                                  with_residual=True)
                decoded = ffi.dequantize_rows(packets, codec, x.shape[1], dtype)
                packet, total = ffi.reduce_requantize_with_sum(
                    packets, jnp.asarray(x[1], dtype), 1, seed, codec, x.shape[1])
                for a in (packets, decoded, packet, total, residual):
                    digest.update(np.asarray(a).tobytes())
                want = model.quantize_rows(xf, np.asarray(seed), bits, 64, codec.stochastic)
                want_packet, want_sum = model.reduce_requantize(
                    want, xf, 1, np.asarray(seed), bits, 64, codec.stochastic, x.shape[1])
                what = f"{bits} bits {rounding} {dtype.__name__}"
                try:
                    assert_bytes_equal(packets, want, "quantize " + what)
                    want_skipped = want.copy(); want_skipped[2] = 0
                    assert_bytes_equal(skipped, want_skipped, "quantize skip_row=2 " + what)
                    assert_same_floats(residual, model.residual_rows(xf, want, bits, 64, 2),
                                       "residual " + what)
                    assert_same_floats(decoded, model_decoded(want, codec, x.shape[1], dtype),
                                       "dequantize " + what)
                    assert_bytes_equal(packet, want_packet, "reduce packet " + what)
                    assert_same_floats(total, want_sum, "reduce sum " + what)
                except AssertionError as error:
                    mismatches.append(str(error)[:200])
    print(mismatches)
    print(_cgx_cpu.cpu_isa(), digest.hexdigest())
""")


TESTS = os.path.dirname(os.path.abspath(__file__))


def run_with_isa(isa: str) -> tuple[str, str, str]:
    """(the variant chosen, the digest of its outputs, its differences from the model)."""
    path = os.pathsep.join(filter(None, (TESTS, os.environ.get("PYTHONPATH"))))
    env = dict(os.environ, CGX_JAX_CPU_ISA=isa, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, check=True, timeout=300)
    mismatches, last = out.stdout.strip().splitlines()[-2:]
    chosen, digest = last.split()
    return chosen, digest, mismatches


def test_all_instruction_set_variants_write_identical_bytes_and_the_models():
    results = {isa: run_with_isa(isa) for isa in ("generic", "avx2", "avx512")}
    chosen = {isa: r[0] for isa, r in results.items()}
    assert chosen["generic"] == "isa_generic"
    for isa, (_, _, mismatches) in results.items():  # each variant against the model itself
        assert mismatches == "[]", f"{isa} ({chosen[isa]}): {mismatches}"
    digests = {r[1] for r in results.values()}
    assert len(digests) == 1, results
    if len(set(chosen.values())) == 1:
        pytest.skip(f"only the generic variant runs on this CPU ({chosen})")
