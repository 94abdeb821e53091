"""backends/ffi.py on a GPU: the CUDA kernels against the CPU kernels, the same bytes for the
same inputs and seeds (docs/design.md section 1, "one target name, two platforms"; section 3),
and compressed_psum on one GPU.

Every test runs one jitted program on the first GPU and the same program on the first CPU
device and compares the outputs bit for bit; the CPU kernels are checked against the numpy
model in test_backends_ffi.py, so agreeing with them is agreeing with the format. The whole
module is skipped, with the reason printed, when JAX has no GPU or this build of cgx_jax
has no CUDA kernels; importing it needs neither. Run it on a GPU machine with
``python -m pytest -q tests/test_backends_cuda.py -rs`` (or ``bash tests/gpu/check.sh``).
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import reduce_outputs
from jax.sharding import Mesh, PartitionSpec as P

import cgx_jax as cgx
from cgx_jax._src.backends import ffi
from cgx_jax._src.codec import Codec, packet_bytes


def _gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend in this JAX, or no GPU it can use
        return []


GPUS = _gpu_devices()
CPU = jax.devices("cpu")[0]

pytestmark = [
    pytest.mark.skipif(
        not GPUS,
        reason="no GPU: jax.devices('gpu') is empty or fails (CPU-only JAX or no NVIDIA GPU); "
               "the CUDA kernels are tested only on a GPU machine"),
    pytest.mark.skipif(
        bool(GPUS) and not cgx.has_cuda_support(),
        reason="JAX sees a GPU but this cgx_jax build has no CUDA kernels (_cgx_cuda): rebuild "
               "with CGX_JAX_CUDA=ON pip install --no-build-isolation --no-deps -e ."),
]

F32, BF16, F16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
DTYPES = (F32, BF16, F16)
ROUNDINGS = ("nearest", "stochastic")
BITS = tuple(range(1, 9))
# 8..200: 8-lane teams on the GPU; 1024: warp teams; 16384: block teams.
BUCKET_SIZES = (8, 64, 200, 1024, 16384)


def run_on_both(fn, *args):
    """jit(fn)(*args) with every argument on the GPU, then on the CPU device: two pytrees of
    numpy arrays, (gpu, cpu)."""
    jitted = jax.jit(fn)
    outs = []
    for device in (GPUS[0], CPU):
        out = jitted(*jax.device_put(args, device))
        outs.append(jax.tree.map(np.asarray, out))
    return outs


# ---------------------------------------------------------------------------
# Inputs and comparisons
# ---------------------------------------------------------------------------

BUCKET_KINDS = ("normal", "normal", "constant", "zeros", "signed_zeros", "zero_min", "zero_max",
                "nan", "+inf", "-inf", "nan_and_inf", "subnormal", "huge", "one_off")


def mixed_buckets(rng, rows, n, bucket_size, dtype):
    """x [rows, n] in `dtype` whose buckets cycle (from a random start) through
    BUCKET_KINDS: ordinary values of a random scale and offset, constant buckets, +0/-0
    extremes, NaN/inf, subnormals, and +/-3e38 (+/-6e4 in f16) wide buckets."""
    tiny = np.float32(1e-40) if dtype != F16 else np.float32(2.0**-20)  # subnormal in dtype
    huge = np.float32(3e38) if dtype != F16 else np.float32(6e4)
    buckets = np.empty((rows * n // bucket_size, bucket_size), np.float32)
    start = int(rng.integers(len(BUCKET_KINDS)))
    for i, bucket in enumerate(buckets):
        kind = BUCKET_KINDS[(start + i) % len(BUCKET_KINDS)]
        scale = 10.0 ** rng.uniform(-3, 3)
        bucket[:] = (rng.standard_normal(bucket_size) + rng.choice([0.0, 3.0])) * scale
        j = rng.integers(bucket_size, size=3)
        if kind == "constant":
            bucket[:] = -2.75
        elif kind == "zeros":
            bucket[:] = 0.0
        elif kind == "signed_zeros":
            bucket[:] = rng.choice([0.0, -0.0], bucket_size)
        elif kind == "zero_min":  # min is a zero, -0.0 somewhere
            bucket[:] = np.abs(bucket)
            bucket[j] = [-0.0, 0.0, -0.0]
        elif kind == "zero_max":
            bucket[:] = -np.abs(bucket)
            bucket[j] = [0.0, -0.0, 0.0]
        elif kind == "nan":
            bucket[j[0]] = np.nan
        elif kind in ("+inf", "-inf"):
            bucket[j[0]] = float(kind[0] + "inf")
        elif kind == "nan_and_inf":
            bucket[j[:2]] = [np.inf, np.nan]
        elif kind == "subnormal":
            bucket[:] = rng.integers(-60, 60, bucket_size) * tiny
        elif kind == "huge":  # x - min and level * unit overflow: the half-scale paths
            bucket[:] = rng.uniform(-1, 1, bucket_size) * huge
            bucket[j[:2]] = [-huge, huge]
        elif kind == "one_off":
            bucket[:] = 1.5
            bucket[j[0]] = 1.25
    return buckets.reshape(rows, n).astype(dtype)


def float_bits(a):
    a = np.asarray(a)
    return a.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[a.dtype.itemsize])


def difference(got, want, what):
    """None when got and want are bit-identical, else a description of the difference.
    Both platforms write one canonical NaN, so NaNs are compared bit for bit too; the
    description says when only NaN payloads differ."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{what}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}"
    bad = np.flatnonzero(float_bits(got) != float_bits(want))
    if bad.size == 0:
        return None
    note = ""
    if got.dtype != np.uint8:
        g, w = got.ravel()[bad].astype(np.float32), want.ravel()[bad].astype(np.float32)
        if np.all(np.isnan(g) & np.isnan(w)):
            note = " (NaN payloads only)"
    first = bad[:4]
    return (f"{what}: {bad.size} of {got.size} differ{note}, first at flat {first.tolist()}: "
            f"gpu {float_bits(got).ravel()[first].tolist()} "
            f"cpu {float_bits(want).ravel()[first].tolist()}")


def assert_no_differences(found):
    found = [d for d in found if d is not None]
    assert not found, f"{len(found)} GPU/CPU differences:\n" + "\n".join(found[:20])


# ---------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_quantize_and_dequantize_match_cpu(rounding, dtype):
    """All bits and bucket sizes in one program per device: packets of mixed buckets,
    their decoding to every output dtype, and the decoding of random bytes (NaN and
    infinite meta, huge and subnormal units)."""
    rng = np.random.default_rng([ROUNDINGS.index(rounding), DTYPES.index(dtype)])
    codecs, inputs = [], []
    for bits in BITS:
        for bucket_size in BUCKET_SIZES:
            codec = Codec(bits=bits, bucket_size=bucket_size, rounding=rounding)
            rows, n = (2, 2 * bucket_size) if bucket_size > 8192 else (3, 5 * bucket_size)
            x = mixed_buckets(rng, rows, n, bucket_size, dtype)
            seed = rng.integers(0, 2**32, 2, dtype=np.uint32)
            junk = rng.integers(0, 256, (rows, packet_bytes(n, codec)), dtype=np.uint8)
            codecs.append(codec)
            inputs.append((x, seed, junk))

    def program(inputs):
        outs = []
        for codec, (x, seed, junk) in zip(codecs, inputs):
            n = x.shape[1]
            packets = ffi.quantize_rows(x, seed, codec)
            skipped = ffi.quantize_rows(x, seed, codec, skip_row=1)  # SRA's own row
            # Error feedback's residual, written by the encoding kernel, with and without a
            # skipped row; a flat x with a short last row (the residual values stop with x).
            with_residual = ffi.quantize_rows(x, seed, codec, skip_row=1, with_residual=True)
            short = ffi.quantize_rows(x.reshape(-1)[:-9], seed, codec, n=n, with_residual=True)
            outs.append((packets, skipped, with_residual, short,
                         [ffi.dequantize_rows(packets, codec, n, d) for d in DTYPES],
                         [ffi.dequantize_rows(junk, codec, n, d) for d in DTYPES]))
        return outs

    gpu, cpu = run_on_both(program, inputs)
    found = []
    for codec, (gp, gs, gl, gsl, gd, gj), (cp, cs, cl, csl, cd, cj) in zip(codecs, gpu, cpu):
        found.append(difference(gp, cp, f"quantize {codec} {dtype}"))
        found.append(difference(gs, cs, f"quantize skip_row=1 {codec} {dtype}"))
        found.append(difference(gl[0], cs, f"quantize skip_row=1 with residual {codec} {dtype}"))
        found.append(difference(gl[1], cl[1], f"residual skip_row=1 {codec} {dtype}"))
        found.append(difference(gsl[0], csl[0], f"quantize short with residual {codec} {dtype}"))
        found.append(difference(gsl[1], csl[1], f"residual of a short row {codec} {dtype}"))
        for d, g, c in zip(DTYPES, gd, cd):
            found.append(difference(g, c, f"dequantize {codec} -> {d}"))
        for d, g, c in zip(DTYPES, gj, cj):
            found.append(difference(g, c, f"dequantize of random bytes {codec} -> {d}"))
    assert_no_differences(found)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_public_quantize_of_odd_sizes_matches_cpu(dtype):
    """cgx.quantize pads with the last value (size 1 is a constant bucket); its packets and
    cgx.dequantize's values agree across platforms, and the program calls the FFI target."""
    rng = np.random.default_rng(DTYPES.index(dtype))
    cases, inputs = [], []
    for size in (1, 7, 1023, 1025):
        for bucket_size, rounding in ((8, "nearest"), (1024, "stochastic"), (64, "stochastic")):
            codec = Codec(bits=1 + size % 8, bucket_size=bucket_size, rounding=rounding)
            cases.append(codec)
            inputs.append((rng.standard_normal(size) * 3).astype(dtype))
    key = jax.random.key(11)

    def program(inputs, key):
        outs = []
        for i, (codec, x) in enumerate(zip(cases, inputs)):
            packet = cgx.quantize(x, codec, jax.random.fold_in(key, i))
            outs.append((packet, cgx.dequantize(packet, codec, x.shape, x.dtype)))
        return outs

    gpu_inputs = jax.device_put((inputs, key), GPUS[0])
    assert "cgx_quantize" in jax.jit(program).lower(*gpu_inputs).as_text()
    gpu, cpu = run_on_both(program, inputs, key)
    found = []
    for codec, x, (gp, gx), (cp, cx) in zip(cases, inputs, gpu, cpu):
        found.append(difference(gp, cp, f"cgx.quantize size {x.size} {codec} {dtype}"))
        found.append(difference(gx, cx, f"cgx.dequantize size {x.size} {codec} {dtype}"))
    assert_no_differences(found)


# ---------------------------------------------------------------------------
# reduce_requantize
# ---------------------------------------------------------------------------

REDUCE_CASES = [  # (peers, bits, bucket_size, n); on the GPU 8..200: 8-lane teams,
    (1, 2, 8, 8 * 40),             # 1024: warp teams, 2048: block teams with staged sums,
    (3, 5, 200, 200 * 6),          # 16384: block teams that sum twice
    (8, 8, 64, 64 * 10),
    (3, 3, 1024, 1024 * 4),
    (1, 7, 1024, 1024 * 3),
    (8, 4, 2048, 2048 * 3),
    (3, 1, 16384, 16384 * 2),
    (8, 6, 200, 200 * 8),
]
# (packet, sum): cgx_reduce_requantize, cgx_reduce_sum, cgx_reduce_requantize_with_sum
EMITS = ((True, False), (False, True), (True, True))


@functools.cache
def _peers(num_peers, bits, bucket_size, n, rounding):
    """num_peers packets of mixed buckets, made by the CPU kernel; with 8 peers the last
    one is random bytes (NaN, infinite, huge meta)."""
    rng = np.random.default_rng([num_peers, bits, bucket_size])
    codec = Codec(bits=bits, bucket_size=bucket_size, rounding=rounding)
    chunks = mixed_buckets(rng, num_peers, n, bucket_size, F32)
    seed = jax.device_put(np.array([bits, 99], np.uint32), CPU)
    peers = np.array(jax.jit(ffi.quantize_rows, static_argnums=2)(
        jax.device_put(chunks, CPU), seed, codec))
    if num_peers == 8:
        peers[-1] = rng.integers(0, 256, peers.shape[1], dtype=np.uint8)
    return peers


@pytest.mark.parametrize("own_dtype", [None, F32, BF16, F16], ids=str)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_reduce_requantize_matches_cpu(rounding, own_dtype):
    """N = 1, 3, 8 peers, with and without the raw own chunk, each output alone and both."""
    rng = np.random.default_rng([ROUNDINGS.index(rounding),
                                 0 if own_dtype is None else 1 + DTYPES.index(own_dtype)])
    cases, inputs = [], []
    for num_peers, bits, bucket_size, n in REDUCE_CASES:
        codec = Codec(bits=bits, bucket_size=bucket_size, rounding=rounding)
        peers = _peers(num_peers, bits, bucket_size, n, rounding)
        own = None if own_dtype is None else mixed_buckets(rng, 1, n, bucket_size, own_dtype)[0]
        own_index = np.int32(num_peers // 2)
        seed = rng.integers(0, 2**32, 2, dtype=np.uint32)
        cases.append((codec, num_peers, n))
        inputs.append((peers, own, own_index, seed))

    def program(inputs):
        outs = []
        for (codec, _, n), (peers, own, own_index, seed) in zip(cases, inputs):
            for emit_packet, emit_sum in EMITS:
                outs.append(reduce_outputs(ffi, peers, own, own_index, seed, codec, n,
                                           emit_packet=emit_packet, emit_sum=emit_sum))
        return outs

    gpu, cpu = run_on_both(program, inputs)
    found = []
    results = iter(zip(gpu, cpu))
    for codec, num_peers, n in cases:
        for emit in EMITS:
            (gp, gs), (cp, cs) = next(results)
            what = f"reduce_requantize N={num_peers} n={n} {codec} own={own_dtype} emit={emit}"
            assert (gp is None) != emit[0] and (gs is None) != emit[1]
            if emit[0]:
                found.append(difference(gp, cp, what + " packet"))
            if emit[1]:
                found.append(difference(gs, cs, what + " sum"))
    assert_no_differences(found)


@pytest.mark.parametrize("offset_kind", ["aligned", "odd"])
def test_packet_windows_match_cpu(offset_kind):
    """dequantize and reduce_requantize reading packets at a byte offset of wider rows (the
    segments of one wire row): an offset of a multiple of 8 keeps the aligned meta loads, an
    odd one takes the unaligned path."""
    rng = np.random.default_rng(21)
    num_peers, bits, bucket_size, n = 4, 3, 64, 64 * 10
    codec = Codec(bits=bits, bucket_size=bucket_size, rounding="stochastic")
    peers = _peers(num_peers, bits, bucket_size, n, "stochastic")
    before = 16 if offset_kind == "aligned" else 5
    rows = np.concatenate([rng.integers(0, 256, (num_peers, before), dtype=np.uint8), peers,
                           rng.integers(0, 256, (num_peers, 3), dtype=np.uint8)], axis=1)
    own = mixed_buckets(rng, 1, n, bucket_size, F32)[0]
    seed = rng.integers(0, 2**32, 2, dtype=np.uint32)

    def program(rows, own, seed):
        decoded = ffi.dequantize_rows(rows, codec, n, F32, offset=before)
        packet, total = ffi.reduce_requantize_with_sum(rows, own, np.int32(1), seed, codec, n,
                                                       offset=before)
        alone = ffi.reduce_sum(rows, own, np.int32(1), codec, n, offset=before)
        return decoded, packet, total, alone

    gpu, cpu = run_on_both(program, rows, own, seed)
    plain = run_on_both(lambda p: ffi.dequantize_rows(p, codec, n, F32), peers)[1]
    found = [difference(g, c, f"window {offset_kind} output {i}")
             for i, (g, c) in enumerate(zip(gpu, cpu))]
    found.append(difference(cpu[0], plain, "window against plain packets"))
    assert_no_differences(found)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_short_last_rows_match_cpu(dtype):
    """Buffers whose last row is short (a leaf travelling in place, fusion.py): x, own and the
    sum of reduce_requantize, and dequantize's output; every bucket kind, team size and a cut
    inside a group of 8, at a bucket edge and one value into the last row. Some outputs are
    scaled for a mean (``divisor``)."""
    rng = np.random.default_rng(DTYPES.index(dtype) + 40)
    cases, inputs = [], []
    for bits, bucket_size in ((3, 8), (4, 64), (5, 1024), (2, 16384)):
        codec = Codec(bits=bits, bucket_size=bucket_size, rounding="stochastic")
        rows, n = 3, 2 * bucket_size
        for short in (1, 5, bucket_size, n - 1):
            x = mixed_buckets(rng, rows, n, bucket_size, dtype).reshape(-1)[:rows * n - short]
            peers = _peers(rows, bits, bucket_size, n, "stochastic")
            seed = rng.integers(0, 2**32, 2, dtype=np.uint32)
            cases.append((codec, n, x.size))
            inputs.append((x, peers, seed))

    def program(inputs):
        outs = []
        for (codec, n, size), (x, peers, seed) in zip(cases, inputs):
            packets = ffi.quantize_rows(x, seed, codec, skip_row=1, n=n)
            decoded = [ffi.dequantize_rows(packets, codec, n, x.dtype, size=size,
                                           divisor=divisor) for divisor in (1, 3)]
            reduced = [reduce_outputs(ffi, peers, x, np.int32(i), seed, codec, n,
                                      emit_sum=True, size=size - 2 * n, divisor=d)
                       for i, d in ((0, 1), (2, 7))]
            outs.append((packets, decoded, reduced))
        return outs

    gpu, cpu = run_on_both(program, inputs)
    found = []
    for case, g, c in zip(cases, gpu, cpu):
        for i, (gl, cl) in enumerate(zip(jax.tree.leaves(g), jax.tree.leaves(c))):
            found.append(difference(gl, cl, f"short rows {case} output {i}"))
    assert_no_differences(found)


# ---------------------------------------------------------------------------
# compressed_psum on one GPU (axis size 1)
# ---------------------------------------------------------------------------

def _psum_inputs():
    rng = np.random.default_rng(7)
    return {
        "w": (rng.standard_normal((3, 1025)) * 5).astype(np.float32),  # odd size
        "b": rng.standard_normal((7, 33)).astype(BF16),
        "h": (rng.standard_normal(300) * 100).astype(np.float16),
    }


def _check_psum(gpu, cpu, inputs, codec):
    found = []
    for name in inputs:
        found.append(difference(gpu[name], cpu[name], f"compressed_psum leaf {name!r}"))
    assert_no_differences(found)
    for name, x in inputs.items():
        # One participant: its sum is its own tensor, quantized once (SRA re-encodes the raw
        # chunk) and so within one unit of the tensor's range.
        x = np.asarray(x, np.float64)
        unit = (x.max() - x.min()) / (2**codec.bits - 1)
        out = np.asarray(gpu[name], np.float64)
        assert out.shape == x.shape and gpu[name].dtype == inputs[name].dtype
        assert np.all(np.abs(out - x) <= unit * 1.01 + 0.01 * np.abs(x)), name


PSUM_CODECS = [Codec(bits=3, bucket_size=64, rounding="stochastic"),
               Codec(bits=8, bucket_size=1024, rounding="nearest")]


def _codec_id(codec):
    return f"{codec.bits}b{codec.bucket_size}{codec.rounding[0]}"


@pytest.mark.parametrize("algorithm", ["sra", "allgather"])
@pytest.mark.parametrize("codec", PSUM_CODECS, ids=_codec_id)
def test_compressed_psum_on_one_gpu_under_pmap(codec, algorithm):
    inputs = _psum_inputs()
    key = jax.random.key(5)
    outs = []
    for device in (GPUS[0], CPU):
        step = jax.pmap(
            lambda x: cgx.compressed_psum(x, "batch", codec=codec, key=key, algorithm=algorithm),
            axis_name="batch", devices=[device])
        out = step(jax.tree.map(lambda v: v[None], inputs))
        outs.append(jax.tree.map(lambda v: np.asarray(v)[0], out))
    _check_psum(outs[0], outs[1], inputs, codec)


@pytest.mark.parametrize("algorithm", ["sra", "allgather"])
@pytest.mark.parametrize("codec", PSUM_CODECS, ids=_codec_id)
def test_compressed_psum_on_one_gpu_under_shard_map(codec, algorithm):
    inputs = _psum_inputs()
    key = jax.random.key(5)
    outs = []
    for device in (GPUS[0], CPU):
        mesh = Mesh(np.array([device]), ("batch",))

        def psum(x, k):  # x: this participant's block, a leading axis of 1
            out = cgx.compressed_psum(jax.tree.map(lambda v: v[0], x), "batch", codec=codec,
                                      key=k, algorithm=algorithm)
            return jax.tree.map(lambda v: v[None], out)

        step = jax.jit(jax.shard_map(psum, mesh=mesh, in_specs=(P("batch"), P()),
                                     out_specs=P("batch")))
        stacked = jax.device_put(jax.tree.map(lambda v: v[None], inputs), device)
        out = step(stacked, jax.device_put(key, device))
        outs.append(jax.tree.map(lambda v: np.asarray(v)[0], out))
    _check_psum(outs[0], outs[1], inputs, codec)


@pytest.mark.parametrize("codec", PSUM_CODECS, ids=_codec_id)
def test_sharded_ops_on_one_gpu_match_cpu(codec):
    """compressed_all_gather (forward and its compressed-gradient backward) and
    compressed_psum_scatter under pmap on one GPU: the CPU's bits."""
    rng = np.random.default_rng(3)
    shard = {"w": rng.standard_normal((1, 200, 130)).astype(np.float32),
             "h": rng.standard_normal((1, 300, 64)).astype(ml_dtypes.bfloat16)}
    key = jax.random.key(7)

    def program(tree):
        def loss(tree):
            full = cgx.compressed_all_gather(tree, "batch", codec=codec, key=key,
                                             grad_codec=codec)
            return sum(jnp.sum(jnp.sin(v.astype(jnp.float32))) for v in jax.tree.leaves(full))

        value, grads = jax.value_and_grad(loss)(tree)
        scattered = cgx.compressed_psum_scatter(tree, "batch", scatter_dimension=0,
                                                tiled=True, codec=codec, key=key)
        return value, grads, scattered

    outs = []
    for device in (GPUS[0], CPU):
        out = jax.pmap(program, axis_name="batch", devices=[device])(
            jax.tree.map(lambda v: v[None], shard))
        outs.append(jax.tree.map(np.asarray, out))
    found = [difference(g, c, f"sharded ops {codec} leaf {i}")
             for i, (g, c) in enumerate(zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])))]
    assert_no_differences(found)
