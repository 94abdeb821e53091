"""collectives/: the algorithms, run through compressed_psum on simulated CPU devices
(docs/design.md section 4): SRA and all-gather within their two-quantization bound, the ring
within its hop bound, "auto", and the hierarchical reduction (inner_axis_name=) within the
outer algorithm's bound; bitwise-identical replicas, exact constant buckets, local errors that
add up to the total error, gradients that are lax.psum's (straight-through) for every
algorithm and backend, pytrees, pmap, and the hierarchical bad arguments. The transport
(exchange_rows, gather_packets) is tested in test_collectives_transport.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_2d, run_sharded
from jax import lax

import cgx_jax as cgx
from cgx_jax._src.api import reduce_tree_with_residual

# ---------------------------------------------------------------------------
# Error bounds
# ---------------------------------------------------------------------------

def per_step(codec):
    return 0.5 if codec.rounding == "nearest" else 1.0


def pad_rows(inputs, multiple):
    """Pads [N, L] rows to a multiple by repeating each row's last value (as the library)."""
    n = inputs.shape[1]
    padded = -(-n // multiple) * multiple
    return np.concatenate([inputs, np.repeat(inputs[:, -1:], padded - n, axis=1)], axis=1)


def bucket_units(values, codec):
    """Per-element unit (max-min)/(2^b-1) of each value's bucket; values [N, L], L % B == 0."""
    b = values.reshape(values.shape[0], -1, codec.bucket_size).astype(np.float64)
    unit = (b.max(-1) - b.min(-1)) / (2**codec.bits - 1)
    return np.repeat(unit, codec.bucket_size, axis=-1)


def error_bound(inputs, codec, algorithm):
    """Per-element bound on |compressed sum - exact sum| for inputs [N, L] (L % (N*B) == 0):
    each quantization errs by at most unit/2 (nearest) or one unit (stochastic); SRA
    quantizes the N-1 peer chunks, then the partial sum once more."""
    per_step = 0.5 if codec.rounding == "nearest" else 1.0
    units = bucket_units(inputs, codec)
    exact = inputs.astype(np.float64).sum(0)
    if algorithm == "allgather":
        first = per_step * units.sum(0)
        return first + 1e-5 * (np.abs(inputs).sum(0) + 1)
    first = per_step * units.sum(0)  # loose: the own chunk is not quantized at all
    sum_range = bucket_units((exact + 0 * first)[None], codec)[0] * (2**codec.bits - 1)
    second = per_step * (sum_range + 2 * bucket_units(first[None], codec)[0]
                         * (2**codec.bits - 1) + 2 * first) / (2**codec.bits - 1)
    return first + second + 1e-5 * (np.abs(inputs).sum(0) + 1)


def ring_bound(inputs, codec):
    """Per-element bound for the ring on padded inputs [N, L] (L % (N*B) == 0).

    Chunk c is encoded N times; the k-th encode holds the partial sum of contributors
    c+1, ..., c+k (mod N), and its bucket unit is at most the sum of their raw units
    (decoded values stay inside the encoded range). So the error is at most
    r * sum_k sum_{m<=k} u_{c+m} = r * sum_m (N-m+1) u_{c+m}, r = 1/2 (nearest) or 1.
    """
    num, length = inputs.shape
    units = bucket_units(inputs, codec)  # [N, L]
    chunk_of = np.arange(length) // (length // num)
    weights = np.zeros((num, length))
    for m in range(1, num + 1):  # contributor m of chunk c is participant (c + m) % N
        weights[(chunk_of + m) % num, np.arange(length)] = num - m + 1
    return (per_step(codec) * (weights * units).sum(0)
            + 1e-5 * num * (np.abs(inputs).sum(0) + 1))


CODECS = [  # of SRA and all-gather
    cgx.Codec(bits=4, bucket_size=128, rounding="nearest"),
    cgx.Codec(bits=2, bucket_size=64, rounding="stochastic"),
    cgx.Codec(bits=8, bucket_size=1024, rounding="stochastic"),
]
RING_CODECS = [
    cgx.Codec(bits=4, bucket_size=128, rounding="nearest"),
    cgx.Codec(bits=2, bucket_size=64, rounding="stochastic"),
]
RING_CODEC_IDS = [f"{c.bits}b{c.bucket_size}{c.rounding[0]}" for c in RING_CODECS]


def assert_replicas_identical(out):
    out = np.asarray(out)
    for replica in out[1:]:
        np.testing.assert_array_equal(replica.view(np.uint32), out[0].view(np.uint32))


# ---------------------------------------------------------------------------
# SRA and all-gather
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("num_devices", [1, 2, 3, 8])
@pytest.mark.parametrize("algorithm", ["sra", "allgather"])
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.bits}b{c.bucket_size}{c.rounding[0]}")
def test_psum_within_two_quantization_bound_and_replicas_identical(num_devices, algorithm, codec):
    n = 5 * 1024 + 37  # not a multiple of anything
    rng = np.random.default_rng(num_devices)
    inputs = rng.normal(size=(num_devices, n)).astype(np.float32)
    inputs[:, 100:300] *= 50  # buckets of very different scales
    out = np.asarray(run_sharded(
        lambda x, k: cgx.compressed_psum(x, "batch", codec=codec, key=k, algorithm=algorithm),
        jnp.asarray(inputs), num_devices, jax.random.key(7)))
    assert out.shape == (num_devices, n) and out.dtype == np.float32
    for replica in out[1:]:
        np.testing.assert_array_equal(replica.view(np.uint32), out[0].view(np.uint32))
    multiple = codec.bucket_size * (num_devices if algorithm == "sra" else 1)
    padded = -(-n // multiple) * multiple
    padded_inputs = np.concatenate(
        [inputs, np.repeat(inputs[:, -1:], padded - n, axis=1)], axis=1)
    bound = error_bound(padded_inputs, codec, algorithm)[:n]
    error = np.abs(out[0].astype(np.float64) - inputs.astype(np.float64).sum(0))
    assert np.all(error <= bound), f"max excess {np.max(error - bound)}"
    # Compression is doing something: not exact everywhere at low bits.
    if codec.bits <= 4 and num_devices > 1:
        assert np.max(error) > 0


@pytest.mark.parametrize("algorithm", ["sra", "allgather"])
def test_constant_buckets_are_exact(algorithm):
    codec = cgx.Codec(bits=2, bucket_size=64, rounding="stochastic")
    num_devices = 8
    per_bucket = np.arange(num_devices)[:, None, None] + np.arange(10)[None, :, None] * 3.0
    inputs = np.broadcast_to(per_bucket, (num_devices, 10, 64)).reshape(num_devices, -1)
    out = run_sharded(
        lambda x, k: cgx.compressed_psum(x, "batch", codec=codec, key=k, algorithm=algorithm),
        jnp.asarray(inputs, jnp.float32), num_devices, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(out[3]), inputs.sum(0).astype(np.float32))


# ---------------------------------------------------------------------------
# Ring
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("num_devices", [1, 2, 3, 8])
@pytest.mark.parametrize("codec", RING_CODECS, ids=RING_CODEC_IDS)
def test_ring_within_hop_bound_and_replicas_identical(num_devices, codec):
    n = 3 * 1024 + 41
    rng = np.random.default_rng(10 + num_devices)
    inputs = rng.normal(size=(num_devices, n)).astype(np.float32)
    inputs[:, 300:700] *= 40
    out = np.asarray(run_sharded(
        lambda x, k: cgx.compressed_psum(x, "batch", codec=codec, key=k, algorithm="ring"),
        jnp.asarray(inputs), num_devices, jax.random.key(3)))
    assert out.shape == (num_devices, n) and out.dtype == np.float32
    assert_replicas_identical(out)
    padded = pad_rows(inputs, codec.bucket_size * num_devices)
    bound = ring_bound(padded, codec)[:n]
    error = np.abs(out[0].astype(np.float64) - inputs.astype(np.float64).sum(0))
    assert np.all(error <= bound), f"max excess {np.max(error - bound)}"
    if num_devices > 1:
        assert np.max(error) > 0
    if num_devices == 8:  # the hop bound is looser than SRA's: more encodes of wider sums
        assert np.mean(bound) > np.mean(error_bound(padded, codec, "sra")[:n])


def test_ring_differs_from_sra_and_depends_on_the_key():
    codec = cgx.Codec(bits=3, bucket_size=64)
    inputs = jax.random.normal(jax.random.key(0), (4, 2048))
    run = lambda algorithm, seed: np.asarray(run_sharded(
        lambda x: cgx.compressed_psum(x, "batch", codec=codec, key=jax.random.key(seed),
                                      algorithm=algorithm), inputs, 4))
    ring = run("ring", 1)
    np.testing.assert_array_equal(run("ring", 1), ring)
    assert not np.array_equal(run("ring", 2), ring)
    assert not np.array_equal(run("sra", 1), ring)


def test_ring_pmap_matches_shard_map():
    codec = cgx.Codec(bits=4, bucket_size=256)
    inputs = jax.random.normal(jax.random.key(1), (8, 3000))
    psum = lambda x: cgx.compressed_psum(x, "batch", codec=codec, key=jax.random.key(5),
                                         algorithm="ring")
    via_pmap = jax.block_until_ready(
        jax.pmap(psum, axis_name="batch", devices=jax.devices("cpu"))(inputs))
    np.testing.assert_array_equal(np.asarray(via_pmap), np.asarray(run_sharded(psum, inputs, 8)))
    assert_replicas_identical(via_pmap)


def test_ring_pytree_and_pmean():
    codec = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")
    tree = {
        "w": jnp.linspace(-1, 1, 5 * 300).reshape(5, 30, 10),
        "half": jnp.linspace(0, 2, 5 * 100, dtype=jnp.bfloat16).reshape(5, 100),
        "count": jnp.arange(5 * 3, dtype=jnp.int32).reshape(5, 3),
        "empty": jnp.zeros((5, 0)),
    }
    total = run_sharded(lambda t: cgx.compressed_psum(t, "batch", codec=codec,
                                                      algorithm="ring"), tree, 5)
    mean = run_sharded(lambda t: cgx.compressed_pmean(t, "batch", codec=codec,
                                                      algorithm="ring"), tree, 5)
    assert jax.tree.structure(total) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(total), jax.tree.leaves(tree)):
        assert got.shape == want.shape and got.dtype == want.dtype
        exact = np.asarray(want, np.float64).sum(0)
        if want.dtype == jnp.int32:
            np.testing.assert_array_equal(np.asarray(got[2]), exact)
        elif want.size:
            # 5 encodes of ranges up to 5 * 2: r * 15 * unit of one input (8 bits).
            unit = 2 * np.max(np.abs(np.asarray(want, np.float64))) / 255
            tolerance = 0.5 * 15 * unit + 0.01 * np.abs(exact) + 1e-5
            assert np.all(np.abs(np.asarray(got[2], np.float64) - exact) <= tolerance)
    np.testing.assert_allclose(np.asarray(mean["w"]), np.asarray(total["w"]) / 5, rtol=1e-6)


def test_ring_local_errors_add_up_to_the_total_error():
    codec = cgx.Codec(bits=2, bucket_size=64)
    inputs = jax.random.normal(jax.random.key(4), (3, 64 * 3 * 4))
    out, residual = run_sharded(
        lambda x: reduce_tree_with_residual(x, "batch", codec=codec, key=jax.random.key(0),
                                        algorithm="ring", backend="ffi", mean=False),
        inputs, 3)
    exact = np.asarray(inputs, np.float64).sum(0)
    np.testing.assert_allclose(np.asarray(residual, np.float64).sum(0) + np.asarray(out[0]), exact,
                               atol=1e-4)
    assert np.max(np.abs(np.asarray(residual))) > 0.1


def test_grad_through_ring_is_a_psum():
    codec = cgx.Codec(bits=2, bucket_size=64, rounding="nearest")

    def loss(x):
        return jnp.sum(cgx.compressed_psum(x, "batch", codec=codec, algorithm="ring")
                       * jnp.arange(x.size))

    grads = jax.pmap(jax.grad(loss), axis_name="batch", devices=jax.devices("cpu")[:3])(
        jax.random.normal(jax.random.key(9), (3, 64)))
    np.testing.assert_array_equal(np.asarray(grads), np.broadcast_to(np.arange(64) * 3.0, (3, 64)))


# ---------------------------------------------------------------------------
# auto
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("num_devices, same_as", [(2, "allgather"), (3, "sra")])
def test_auto_is_allgather_for_two_and_sra_beyond(num_devices, same_as):
    codec = cgx.Codec(bits=4, bucket_size=64)
    inputs = jax.random.normal(jax.random.key(6), (num_devices, 1000))
    kwargs = lambda algorithm: {} if algorithm is None else {"algorithm": algorithm}
    run = lambda algorithm: np.asarray(run_sharded(
        lambda x: cgx.compressed_psum(x, "batch", codec=codec, key=jax.random.key(2),
                                      **kwargs(algorithm)), inputs, num_devices))
    np.testing.assert_array_equal(run("auto"), run(same_as))
    np.testing.assert_array_equal(run(None), run(same_as))  # "auto" is the default
    assert not np.array_equal(run("allgather"), run("sra"))  # the choice is visible


# ---------------------------------------------------------------------------
# Hierarchical
# ---------------------------------------------------------------------------

def hierarchical_bound(inputs, outer, inner, codec, algorithm):
    """The outer algorithm's bound applied to the exact inner sums (padded as the library)."""
    multiple = inner * codec.bucket_size * (1 if algorithm == "allgather" else outer)
    padded = pad_rows(inputs, multiple)
    inner_sums = padded.astype(np.float64).reshape(outer, inner, -1).sum(1)
    if algorithm == "ring":
        return ring_bound(inner_sums, codec)
    return error_bound(inner_sums, codec, algorithm)


@pytest.mark.parametrize("outer, inner", [(2, 4), (4, 2)])
@pytest.mark.parametrize("algorithm", ["sra", "allgather", "ring"])
def test_hierarchical_within_outer_bound_and_identical_everywhere(outer, inner, algorithm):
    codec = cgx.Codec(bits=3, bucket_size=64, rounding="stochastic")
    n = 2 * 1024 + 19
    rng = np.random.default_rng(outer)
    inputs = rng.normal(size=(8, n)).astype(np.float32)
    inputs[:, 50:250] *= 20
    out = np.asarray(run_2d(
        lambda x, k: cgx.compressed_psum(x, "outer", inner_axis_name="inner", codec=codec,
                                         key=k, algorithm=algorithm),
        jnp.asarray(inputs), outer, inner, jax.random.key(11)))
    assert out.shape == (8, n) and out.dtype == np.float32
    assert_replicas_identical(out)
    bound = hierarchical_bound(inputs, outer, inner, codec, algorithm)[:n]
    error = np.abs(out[0].astype(np.float64) - inputs.astype(np.float64).sum(0))
    assert np.all(error <= bound), f"max excess {np.max(error - bound)}"
    assert np.max(error) > 0


@pytest.mark.parametrize("outer, inner", [(2, 4), (4, 2)])
def test_hierarchical_is_outer_reduction_of_exact_inner_sums_bitwise(outer, inner):
    # Nearest rounding and all-gather quantize every bucket on its own, so the
    # hierarchical result must equal, bit for bit, a compressed_psum over the outer axis of
    # the same exact inner sums.
    codec = cgx.Codec(bits=4, bucket_size=64, rounding="nearest")
    inputs = jax.random.normal(jax.random.key(8), (8, inner * 64 * 5))

    def both(x):
        hierarchical = cgx.compressed_psum(x, "outer", inner_axis_name="inner", codec=codec,
                                           algorithm="allgather")
        sums = lax.all_gather(lax.psum_scatter(x, "inner", scatter_dimension=0, tiled=True),
                              "inner", axis=0, tiled=True)
        return hierarchical, cgx.compressed_psum(sums, "outer", codec=codec,
                                                 algorithm="allgather")

    hierarchical, reference = run_2d(both, inputs, outer, inner)
    np.testing.assert_array_equal(np.asarray(hierarchical), np.asarray(reference))
    assert not np.array_equal(np.asarray(hierarchical[0]), np.asarray(inputs).sum(0))


def test_hierarchical_pytree_pmean_and_exact_leaves():
    codec = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")
    tree = {"w": jax.random.normal(jax.random.key(1), (8, 40, 30)),
            "half": jnp.linspace(-3, 3, 8 * 200, dtype=jnp.float16).reshape(8, 200),
            "count": jnp.arange(8 * 4, dtype=jnp.int32).reshape(8, 4),
            "bias": jnp.arange(8 * 7, dtype=jnp.float32).reshape(8, 7)}
    policy = cgx.LayerPolicy(default=codec, min_size=0, exclude=("bias",))
    psum = lambda t: cgx.compressed_psum(t, "outer", inner_axis_name="inner", policy=policy)
    pmean = lambda t: cgx.compressed_pmean(t, "outer", inner_axis_name="inner", policy=policy)
    total, mean = run_2d(lambda t: (psum(t), pmean(t)), tree, 2, 4)
    assert jax.tree.structure(total) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(total), jax.tree.leaves(tree)):
        assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(total["count"][5]), np.asarray(tree["count"]).sum(0))
    np.testing.assert_array_equal(np.asarray(total["bias"][5]), np.asarray(tree["bias"]).sum(0))
    np.testing.assert_array_equal(np.asarray(mean["bias"][3]), np.asarray(tree["bias"]).mean(0))
    exact = np.asarray(tree["w"], np.float64).sum(0)
    # Two encodes (SRA, outer size 2) of ranges up to the inner sums' range.
    tolerance = 3 * np.ptp(np.asarray(tree["w"]).reshape(2, 4, -1).sum(1)) / 255 + 1e-4
    assert np.max(np.abs(np.asarray(total["w"][0]) - exact)) <= tolerance
    np.testing.assert_array_equal(np.asarray(mean["w"]), np.asarray(total["w"]) / np.float32(8))
    np.testing.assert_allclose(np.asarray(mean["half"], np.float32),
                               np.asarray(total["half"], np.float32) / 8, rtol=2e-3)


def test_hierarchical_grad_is_the_grad_of_a_psum_over_both_axes():
    codec = cgx.Codec(bits=2, bucket_size=64, rounding="nearest")

    def loss(x, psum):
        return jnp.sum(psum(x) * jnp.arange(x.size))

    compressed = lambda x: cgx.compressed_psum(x, "outer", inner_axis_name="inner", codec=codec)
    exact = lambda x: lax.psum(x, ("outer", "inner"))
    inputs = jax.random.normal(jax.random.key(3), (8, 64))
    grads = run_2d(lambda x: jax.grad(loss)(x, compressed), inputs, 4, 2)
    want = run_2d(lambda x: jax.grad(loss)(x, exact), inputs, 4, 2)
    np.testing.assert_array_equal(np.asarray(grads), np.asarray(want))
    assert np.any(np.asarray(want) != 0)


def test_hierarchical_ring_local_errors_add_up():
    codec = cgx.Codec(bits=2, bucket_size=64)
    inputs = jax.random.normal(jax.random.key(5), (8, 64 * 8 * 2))
    out, residual = run_2d(
        lambda x: reduce_tree_with_residual(x, "outer", codec=codec, key=jax.random.key(0),
                                        algorithm="ring", backend="ffi", mean=False,
                                        inner_axis_name="inner"), inputs, 4, 2)
    exact = np.asarray(inputs, np.float64).sum(0)
    np.testing.assert_allclose(np.asarray(residual, np.float64).sum(0) + np.asarray(out[0]), exact,
                               atol=1e-4)


# ---------------------------------------------------------------------------
# Gradients of every algorithm and backend
# ---------------------------------------------------------------------------

def test_grad_through_compressed_psum_is_a_psum():
    codec = cgx.Codec(bits=2, bucket_size=64, rounding="nearest")

    def loss(x):
        return jnp.sum(cgx.compressed_psum(x, "batch", codec=codec) * jnp.arange(x.size))

    inputs = jax.random.normal(jax.random.key(9), (4, 64))
    grads = jax.pmap(jax.grad(loss), axis_name="batch", devices=jax.devices("cpu")[:4])(inputs)
    np.testing.assert_array_equal(np.asarray(grads), np.broadcast_to(np.arange(64) * 4.0, (4, 64)))


@pytest.mark.parametrize("backend", ["ffi", "jax"])
@pytest.mark.parametrize("algorithm", ["sra", "allgather", "ring"])
def test_grad_under_shard_map_matches_psum_for_both_backends(backend, algorithm):
    # Each participant differentiates its own loss of the reduced value: as with lax.psum,
    # whose result is typed invariant, the gradient counts that loss once (a result typed
    # varying would transpose to a psum of the N equal cotangents: N times too large).
    codec = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")
    weights = jnp.linspace(-1.0, 1.0, 192)

    def grad_of(reduce):
        return lambda x: jax.grad(lambda v: jnp.sum(reduce(v) * weights))(x)

    inputs = jax.random.normal(jax.random.key(3), (3, 192))
    compressed = functools.partial(cgx.compressed_psum, axis_name="batch", codec=codec,
                                   algorithm=algorithm, backend=backend)
    got = run_sharded(grad_of(compressed), inputs, 3)
    want = run_sharded(grad_of(lambda v: jax.lax.psum(v, "batch")), inputs, 3)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(weights, (3, 192)))


# ---------------------------------------------------------------------------
# Bad arguments
# ---------------------------------------------------------------------------

class TestBadArguments:
    codec = cgx.Codec(bits=4, bucket_size=64, rounding="nearest")

    def run(self, axis_name, inner_axis_name):
        return run_2d(lambda x: cgx.compressed_psum(x, axis_name, codec=self.codec,
                                                    inner_axis_name=inner_axis_name),
                      jnp.ones((8, 64)), 2, 4)

    def test_unbound_inner_axis(self):
        with pytest.raises(ValueError, match="inner_axis_name 'nope' is not bound"):
            self.run("outer", "nope")

    def test_inner_axis_same_as_axis_name(self):
        with pytest.raises(ValueError, match="inner_axis_name 'outer' must differ from axis_name"):
            self.run("outer", "outer")

    def test_inner_axis_inside_axis_tuple(self):
        with pytest.raises(ValueError, match="must differ from axis_name"):
            self.run(("outer", "inner"), "inner")

    def test_unknown_algorithm_lists_ring_and_auto(self):
        with pytest.raises(ValueError, match=r"algorithm must be one of .*'ring'.*'auto'.*'tree'"):
            run_sharded(lambda x: cgx.compressed_psum(x, "batch", codec=self.codec,
                                                      algorithm="tree"), jnp.ones((2, 64)), 2)
