"""api.py: compressed_psum and compressed_pmean against numpy and lax.psum (docs/design.md
section 6): pytrees of mixed dtypes with scalar, empty and integer leaves (fused by codec,
fusion.py), pmap against shard_map, a tuple of mesh axes as one group, keys, empty arrays,
long runs (replicas never drift, memory does not grow) and bad arguments; and the public
quantize/dequantize against the numpy model (tests/numpy_model.py, section 2). The
algorithms themselves are tested in test_collectives.py, the default policy in test_policy.py.
"""

import resource
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpy_model as model
import pytest
from helpers import (
    BF16,
    DTYPES,
    F32,
    as_dtype,
    assert_bytes_equal,
    assert_same_floats,
    codec_of,
    cpu_mesh,
    model_decoded,
    on_cpu,
    realistic,
    run_sharded,
)
from jax.sharding import PartitionSpec as P

import cgx_jax as cgx
from cgx_jax._src.codec import packet_bytes, wire_bytes

CPU = jax.devices("cpu")
NEAREST = cgx.Codec(bits=4, bucket_size=64, rounding="nearest")


# ---------------------------------------------------------------------------
# compressed_psum / compressed_pmean
# ---------------------------------------------------------------------------

def test_pmap_matches_shard_map_and_same_key_same_bytes():
    codec = cgx.Codec(bits=3, bucket_size=256)
    inputs = jax.random.normal(jax.random.key(0), (8, 3000))
    key = jax.random.key(42)
    psum = lambda x: cgx.compressed_psum(x, "batch", codec=codec, key=key)
    via_pmap = jax.pmap(psum, axis_name="batch", devices=jax.devices("cpu"))(inputs)
    via_shard_map = run_sharded(psum, inputs, 8)
    again = run_sharded(psum, inputs, 8)
    np.testing.assert_array_equal(np.asarray(via_pmap), np.asarray(via_shard_map))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(via_shard_map))
    other_key = run_sharded(
        lambda x: cgx.compressed_psum(x, "batch", codec=codec, key=jax.random.key(43)), inputs, 8)
    assert not np.array_equal(np.asarray(other_key), np.asarray(via_shard_map))


@pytest.mark.parametrize("case, warns", [
    ("flat 1-D array, default policy", True),
    ("small layers, default policy", True),
    ("small layers, compressed_allreduce", True),
    ("flat 1-D array, codec=", False),
    ("a matrix, default policy", False),
    ("integer leaves only", False),
    ("policy that compresses nothing by choice", False),
])
def test_warns_when_the_policy_compresses_no_leaf(case, warns):
    """A compressed all-reduce that the policy turned into an exact one says so (a flat
    gradient buffer is 1-D, so the default policy keeps it exact), naming the largest leaf;
    it stays silent when something is compressed or the policy compresses nothing by choice."""
    key = jax.random.key(0)
    small = {"w": jnp.ones((1, 8, 8)), "b": jnp.ones((1, 8))}
    tx = cgx.compressed_allreduce("i")
    calls = {
        "flat 1-D array, default policy": (lambda x: cgx.compressed_psum(x, "i", key=key),
                                           jnp.ones((1, 1 << 16))),
        "small layers, default policy": (lambda x: cgx.compressed_pmean(x, "i", key=key), small),
        "small layers, compressed_allreduce": (lambda x: tx.update(x, tx.init(x))[0], small),
        "flat 1-D array, codec=": (lambda x: cgx.compressed_psum(x, "i", codec=NEAREST),
                                   jnp.ones((1, 1 << 16))),
        "a matrix, default policy": (lambda x: cgx.compressed_psum(x, "i", key=key),
                                     jnp.ones((1, 256, 256))),
        "integer leaves only": (lambda x: cgx.compressed_psum(x, "i"),
                                jnp.ones((1, 1 << 16), jnp.int32)),
        "policy that compresses nothing by choice": (
            lambda x: cgx.compressed_psum(x, "i", policy=cgx.LayerPolicy(default=None)),
            jnp.ones((1, 1 << 16))),
    }
    fn, x = calls[case]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = jax.pmap(fn, axis_name="i", devices=CPU[:1])(x)
    messages = [str(w.message) for w in caught if "no leaf is compressed" in str(w.message)]
    assert jax.tree.map(jnp.shape, out) == jax.tree.map(jnp.shape, x)
    if not warns:
        assert messages == []
        return
    assert len(messages) == 1, messages
    largest = "(65536,)" if "flat" in case else "(8, 8)"
    assert f"the largest of shape {largest}" in messages[0]
    assert "codec=cgx.Codec()" in messages[0]


def test_pytree_mixed_dtypes_scalars_empty_and_integer_leaves():
    codec = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")
    tree = {
        "w": jnp.linspace(-1, 1, 8 * 300).reshape(8, 30, 10),
        "half": jnp.linspace(0, 2, 8 * 100, dtype=jnp.float16).reshape(8, 100),
        "brain": [jnp.linspace(-4, 4, 8 * 65, dtype=jnp.bfloat16).reshape(8, 65)],
        "scalar": jnp.arange(8, dtype=jnp.float32),
        "empty": jnp.zeros((8, 0)),
        "count": jnp.arange(8 * 3, dtype=jnp.int32).reshape(8, 3),
    }
    out = run_sharded(lambda t: cgx.compressed_psum(t, "batch", codec=codec), tree, 8)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
        assert got.shape == want.shape and got.dtype == want.dtype
        exact = np.asarray(want, np.float64).sum(0)
        got0 = np.asarray(got[0], np.float64)
        if want.dtype == jnp.int32:
            np.testing.assert_array_equal(got0, exact)  # integers reduced exactly
        elif want.size:
            scale = 8 * np.max(np.abs(np.asarray(want, np.float64))) / 255 + 0.02 * np.abs(exact)
            assert np.all(np.abs(got0 - exact) <= scale + 1e-6)
    # The scalar leaf (one value per device) is a constant bucket: exact.
    np.testing.assert_array_equal(np.asarray(out["scalar"][0]), np.float32(28))


def test_empty_leaves_skip_the_collective():
    # jax 0.11's XLA:CPU crashes compiling a zero-element all-reduce beside other outputs, so
    # an empty leaf must come back (empty, its dtype) without one.
    tree = {"w": jnp.ones((8, 64)), "empty": jnp.zeros((8, 0), jnp.bfloat16)}
    fn = lambda t: cgx.compressed_psum(t, "batch", codec=cgx.Codec(rounding="nearest"))  # noqa
    mapped = jax.shard_map(lambda t: fn(jax.tree.map(lambda v: v[0], t)), mesh=cpu_mesh(8),
                           in_specs=P("batch"), out_specs=P())
    assert "all_reduce" not in jax.jit(mapped).lower(tree).as_text()  # "w" travels compressed
    out = run_sharded(fn, tree, 8)
    assert out["empty"].shape == (8, 0) and out["empty"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["w"]), 8.0)


@pytest.mark.parametrize("algorithm,num_devices", [("sra", 6), ("allgather", 3), ("ring", 5)])
def test_pmean_is_psum_divided_by_participants(algorithm, num_devices):
    """The kernel that writes the sum scales it by 1 / N rounded to f32 (XLA:CPU's x / N), so
    the mean has the bits of the sum divided in XLA, for f32 and narrowed bf16 leaves."""
    codec = cgx.Codec(bits=8, bucket_size=64, rounding="stochastic")
    inputs = jax.random.normal(jax.random.key(5), (num_devices, 5000)) * 100
    tree = {"x": inputs, "n": jnp.full((num_devices, 2), 3.0), "b": inputs.astype(jnp.bfloat16)}
    reduce = lambda f: run_sharded(lambda t: f(t, "batch", codec=codec, algorithm=algorithm,
                                               key=jax.random.key(1)), tree, num_devices)
    total, mean = reduce(cgx.compressed_psum), reduce(cgx.compressed_pmean)
    scale = np.float32(1) / np.float32(num_devices)
    np.testing.assert_array_equal(np.asarray(mean["x"]), np.asarray(total["x"]) * scale)
    assert mean["b"].dtype == jnp.bfloat16
    # bf16: the f32 sum is scaled, then narrowed once (not narrowed, scaled and narrowed).
    f32_sum = reduce(lambda t, *a, **k: cgx.compressed_psum(
        {**t, "b": t["b"].astype(jnp.float32)}, *a, **k))["b"]
    np.testing.assert_array_equal(np.asarray(mean["b"]),
                                  (np.asarray(f32_sum) * scale).astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(mean["n"]), np.full((num_devices, 2), 3.0))


def test_tuple_of_mesh_axes_is_one_group():
    codec = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")
    mesh = cpu_mesh(8, ("outer", "inner"))
    inputs = jax.random.normal(jax.random.key(2), (8, 640))
    fn = jax.jit(jax.shard_map(
        lambda x: cgx.compressed_psum(x, ("outer", "inner"), codec=codec),
        mesh=mesh, in_specs=P(("outer", "inner")), out_specs=P(("outer", "inner"))))
    out = np.asarray(fn(inputs)).reshape(8, 640)
    exact = np.asarray(inputs).sum(0)
    assert np.max(np.abs(out[5] - exact)) < 8 * 2 * float(jnp.max(jnp.abs(inputs))) / 255 * 2
    for replica in out[1:]:
        np.testing.assert_array_equal(replica, out[0])


@pytest.mark.parametrize("shape", [(), (0,), (5, 0)], ids=str)
def test_empty_arrays_and_scalars_work(shape):
    x = jnp.full(shape, 1.5, jnp.float32)
    packet = cgx.quantize(x, NEAREST)
    np.testing.assert_array_equal(cgx.dequantize(packet, NEAREST, shape), x)
    summed = jax.pmap(lambda v: cgx.compressed_psum(v, "batch", codec=NEAREST),
                      axis_name="batch", devices=CPU[:2])(jnp.stack([x, x]))
    np.testing.assert_array_equal(summed[1], np.full(shape, 3.0, np.float32))


def test_jit_of_pmap_with_fresh_keys_bounded_in_flight():
    codec = cgx.Codec(bits=4, bucket_size=64)
    step = jax.pmap(lambda x, k: cgx.compressed_psum(x, "batch", codec=codec, key=k),
                    axis_name="batch", in_axes=(0, None), devices=jax.devices("cpu"))
    x = jnp.ones((8, 100)) * jnp.arange(100.0)
    results = []
    for i in range(5):  # wait on each step: see the rendezvous hazard in docs/design.md section 9
        results.append(np.asarray(jax.block_until_ready(step(x, jax.random.key(i)))))
    assert all(np.all(np.abs(r - 8 * np.arange(100.0)) <= 8 * 99 / 15 * 2 + 1e-3) for r in results)
    assert not np.array_equal(results[0], results[1])


def test_replicas_identical_after_1000_allreduce_steps():
    """SGD on per-device data with 2-bit stochastic all-reduce inside one program: if any
    replica decoded different bytes even once, its parameters would differ ever after."""
    codec = cgx.Codec(bits=2, bucket_size=64)
    data = jax.random.normal(jax.random.key(0), (8, 300))

    def run(x, key):
        def step(i, params):
            grads = params - x  # pulls each replica toward its own data
            reduced = cgx.compressed_pmean(grads, "batch", codec=codec,
                                           key=jax.random.fold_in(key, i))
            return params - 0.1 * reduced
        return jax.lax.fori_loop(0, 1000, step, jnp.zeros_like(x))

    params = jax.pmap(run, axis_name="batch", in_axes=(0, None), devices=CPU)(
        data, jax.random.key(1))
    params = np.asarray(params)
    for replica in params[1:]:
        np.testing.assert_array_equal(replica.view(np.uint32), params[0].view(np.uint32))
    # It converged to the mean of the data, within the 2-bit noise.
    assert np.max(np.abs(params[0] - np.asarray(data).mean(0))) < 0.5


def test_memory_does_not_grow_over_10000_calls_with_fresh_keys():
    codec = cgx.Codec(bits=4, bucket_size=64)
    step = jax.pmap(lambda x, k: cgx.compressed_psum(x, "batch", codec=codec, key=k),
                    axis_name="batch", in_axes=(0, None), devices=CPU[:2])
    x = jnp.ones((2, 1000)) * jnp.arange(1000.0)
    keys = jax.random.split(jax.random.key(0), 10_000)

    def max_rss_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    for i in range(500):  # warm up: compile, allocator pools
        step(x, keys[i]).block_until_ready()
    before = max_rss_mb()
    for i in range(500, 10_000):
        step(x, keys[i]).block_until_ready()  # one program in flight at a time
    growth = max_rss_mb() - before
    print(f"peak RSS growth over 9,500 calls: {growth:.1f} MB")
    assert growth < 64, growth


class TestBadArguments:
    codec = cgx.Codec(bits=4, bucket_size=64, rounding="nearest")

    def psum(self, **kwargs):
        return run_sharded(lambda x: cgx.compressed_psum(x, "batch", **kwargs),
                           jnp.ones((2, 64)), 2)

    def test_unknown_algorithm(self):
        with pytest.raises(ValueError, match=r"algorithm must be one of .*'ring2'"):
            self.psum(codec=self.codec, algorithm="ring2")

    def test_unknown_backend(self):
        with pytest.raises(ValueError, match=r"backend must be one of .*'cuda'"):
            self.psum(codec=self.codec, backend="cuda")

    def test_codec_and_policy_together(self):
        with pytest.raises(ValueError, match="codec= or policy="):
            self.psum(codec=self.codec, policy=cgx.LayerPolicy())

    def test_codec_of_wrong_type(self):
        with pytest.raises(TypeError, match="codec must be a cgx_jax.Codec"):
            self.psum(codec={"bits": 4})

    def test_stochastic_without_key(self):
        with pytest.raises(ValueError, match="pass key=.*rounding='nearest'"):
            self.psum(codec=cgx.Codec(bits=4, bucket_size=64))

    def test_key_of_wrong_type(self):
        with pytest.raises(TypeError, match="key must be a JAX PRNG key"):
            self.psum(codec=cgx.Codec(bits=4, bucket_size=64), key=123)

    def test_unbound_axis_name(self):
        with pytest.raises(ValueError, match="axis_name 'nope' is not bound"):
            run_sharded(lambda x: cgx.compressed_psum(x, "nope", codec=self.codec),
                        jnp.ones((2, 64)), 2)

    def test_outside_any_mapped_context(self):
        with pytest.raises(ValueError, match="axis_name 'batch' is not bound"):
            cgx.compressed_psum(jnp.ones(64), "batch", codec=self.codec)


# ---------------------------------------------------------------------------
# Public quantize / dequantize
# ---------------------------------------------------------------------------

# The public quantize/dequantize run on the CPU device, also on a machine with a GPU: the
# numpy model is the oracle of the CPU kernels.
cpu_default = pytest.mark.usefixtures("cpu_default_device")


def _pad_last(flat, bucket_size):
    extra = -flat.size % bucket_size
    return np.concatenate([flat, np.repeat(flat[-1:], extra)]) if flat.size else flat


@cpu_default
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bucket_size", [8, 64, 1024])
def test_public_quantize_dequantize_match_model(bucket_size, dtype):
    """cgx.quantize pads with the last value; the packet is the model's of that input."""
    rng = np.random.default_rng(bucket_size)
    for size in sorted({1, 7, bucket_size - 1, bucket_size, bucket_size + 1}):
        bits = 1 + size % 8
        codec = codec_of(bits, bucket_size, "nearest")
        xd, xf = as_dtype(rng.standard_normal(size) * 3, dtype)
        padded = _pad_last(xf, bucket_size)
        want = model.quantize_rows(padded[None], np.zeros(2, np.uint32), bits, bucket_size, False)
        packet = cgx.quantize(on_cpu(xd), codec)
        assert packet.shape == (wire_bytes(size, codec),)
        assert_bytes_equal(packet, want[0], f"size {size} {codec}")
        decoded = cgx.dequantize(packet, codec, (size,), dtype)
        assert_same_floats(decoded, model_decoded(want, codec, padded.size, dtype)[0, :size],
                           f"size {size} {codec}")


@cpu_default
def test_public_quantize_large_odd_size_matches_model():
    size, codec = (1 << 20) + 3, codec_of(4, 1024, "nearest")
    x = realistic(np.random.default_rng(1), 1, 1 << 20, 1024)[0]
    x = np.concatenate([x, [5.0, -5.0, 0.25]]).astype(np.float32)
    padded = _pad_last(x, 1024)
    want = model.quantize_rows(padded[None], np.zeros(2, np.uint32), 4, 1024, False)
    packet = cgx.quantize(on_cpu(x), codec)
    assert_bytes_equal(packet, want[0], "large public quantize")
    assert_same_floats(cgx.dequantize(packet, codec, x.shape),
                       model_decoded(want, codec, padded.size, F32)[0, :size], "large decode")


@cpu_default
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (1,), (7,), (3, 5, 7), (2, 1, 65)], ids=str)
def test_public_round_trip_shapes_and_dtypes(shape, dtype):
    codec = codec_of(8, 64, "stochastic")
    x = np.asarray(np.random.default_rng(12).standard_normal(shape), np.float32).astype(dtype)
    packet = cgx.quantize(x, codec, key=jax.random.key(0))
    size = int(np.prod(shape))
    assert packet.dtype == jnp.uint8 and packet.shape == (wire_bytes(size, codec),)
    for out_dtype in (F32, dtype):
        y = cgx.dequantize(packet, codec, shape, out_dtype)
        assert y.shape == shape and y.dtype == out_dtype
        xf = x.astype(np.float64)
        if size:
            unit = (xf.max() - xf.min()) / 255
            rel = 0 if out_dtype == F32 else 2.0**-8 if out_dtype == BF16 else 2.0**-11
            assert np.all(np.abs(np.asarray(y, np.float64) - xf) <= unit + rel * np.abs(xf) + 1e-6)


@cpu_default
def test_public_quantize_accepts_legacy_key_and_differs_by_key():
    codec, x = codec_of(2, 64, "stochastic"), np.linspace(-1, 1, 640, dtype=np.float32)
    a = np.asarray(cgx.quantize(x, codec, key=jax.random.PRNGKey(0)))
    b = np.asarray(cgx.quantize(x, codec, key=jax.random.PRNGKey(0)))
    c = np.asarray(cgx.quantize(x, codec, key=jax.random.PRNGKey(1)))
    np.testing.assert_array_equal(a, b)
    assert np.any(a != c)


@cpu_default
def test_stochastic_quantize_without_key_raises():
    with pytest.raises(ValueError, match="key"):
        cgx.quantize(np.ones(8, np.float32), codec_of(4, 8, "stochastic"))


@cpu_default
@pytest.mark.parametrize("x", [np.arange(8, dtype=np.int32), np.ones(8, bool),
                               np.ones(8, np.complex64)], ids=lambda x: str(x.dtype))
def test_quantize_of_non_float_raises_type_error(x):
    with pytest.raises(TypeError, match="dtype"):
        cgx.quantize(x, codec_of(4, 8, "nearest"))


@cpu_default
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
    cgx.dequantize(np.zeros(wire_bytes(100, codec), np.uint8), codec, (10, 10))  # fine
    with pytest.raises(ValueError, match="packets"):
        cgx.dequantize(packets, codec, (10, 10))
