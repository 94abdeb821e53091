"""compressed_psum / compressed_pmean against lax.psum and numpy, inside pmap and shard_map."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import cgx_jax as cgx
from cgx_jax.collectives.transport import SWAP_PIECE_BYTES, exchange_rows, gather_packets
from conftest import cpu_mesh


def run_sharded(fn, stacked, num_devices, *args):
    """Runs fn(per_device_value, *args) under shard_map over `num_devices` CPU devices and
    returns the per-device outputs stacked on a new leading axis."""
    mesh = cpu_mesh(num_devices)
    mapped = jax.shard_map(
        lambda x, *a: jax.tree.map(lambda v: v[None], fn(jax.tree.map(lambda v: v[0], x), *a)),
        mesh=mesh, in_specs=(P("batch"),) + (P(),) * len(args), out_specs=P("batch"))
    out = jax.jit(mapped)(stacked, *args)
    return jax.block_until_ready(out)


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


CODECS = [
    cgx.Codec(bits=4, bucket_size=128, rounding="nearest"),
    cgx.Codec(bits=2, bucket_size=64, rounding="stochastic"),
    cgx.Codec(bits=8, bucket_size=1024, rounding="stochastic"),
]


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


def test_pmean_is_psum_divided_by_participants():
    codec = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")
    inputs = jax.random.normal(jax.random.key(5), (6, 500))
    tree = {"x": inputs, "n": jnp.full((6, 2), 3.0)}
    total = run_sharded(lambda t: cgx.compressed_psum(t, "batch", codec=codec), tree, 6)
    mean = run_sharded(lambda t: cgx.compressed_pmean(t, "batch", codec=codec), tree, 6)
    np.testing.assert_allclose(np.asarray(mean["x"]), np.asarray(total["x"]) / 6, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(mean["n"]), np.full((6, 2), 3.0))


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


def test_default_policy_keeps_small_and_1d_leaves_exact():
    tree = {"kernel": jnp.ones((8, 256, 128)) * jnp.arange(128), "bias": jnp.ones((8, 128)) * jnp.arange(128) / 4}
    out = run_sharded(
        lambda t, k: cgx.compressed_psum(t, "batch", key=k), tree, 8, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out["bias"][0]), 2.0 * np.arange(128, dtype=np.float32))
    assert not np.array_equal(np.asarray(out["kernel"][0]), np.asarray(tree["kernel"].sum(0)))


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


def test_psum_fallback_gather_for_older_jax_gives_the_same_bits_and_grads(monkeypatch):
    # jax releases without all_gather_invariant get a psum of zero-padded pieces instead.
    from cgx_jax.collectives import jax_compat
    codec = cgx.Codec(bits=4, bucket_size=64, rounding="nearest")
    weights = jnp.linspace(-1.0, 1.0, 384)
    inputs = jax.random.normal(jax.random.key(5), (4, 384))

    def value_and_grad(v):
        reduce = functools.partial(cgx.compressed_psum, axis_name="batch", codec=codec)
        return reduce(v), jax.grad(lambda u: jnp.sum(reduce(u) * weights))(v)

    want = run_sharded(value_and_grad, inputs, 4)
    monkeypatch.setattr(jax_compat, "_jax_all_gather_invariant", None)
    got = run_sharded(value_and_grad, inputs, 4)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(got[1]), np.broadcast_to(weights, (4, 384)))


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


@pytest.mark.parametrize("num_devices", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("row_bytes", [8, 1000, 1_200_001])
def test_exchange_rows_is_an_all_to_all_bitwise(num_devices, row_bytes):
    """SRA's exchange in rounds (on CPU across processes: N-1 ppermute shift rounds, the swap
    round of an even N in pieces once a row reaches 2 x SWAP_PIECE_BYTES, unevenly split
    here; forced here in one process) returns what a tiled all_to_all returns, byte for
    byte, own row included."""
    if row_bytes > 1000 and num_devices not in (2, 4):
        pytest.skip("the pieces only exist for a swap round (even N); 2 and 4 cover it")
    assert row_bytes <= 1000 or row_bytes // SWAP_PIECE_BYTES == 2  # two pieces, uneven
    n = num_devices
    rows = np.random.default_rng(row_bytes + n).integers(0, 256, (n, n, row_bytes), np.uint8)
    ours = run_sharded(lambda r: exchange_rows(r, "batch", lax.axis_index("batch"), n,
                                               in_rounds=True), rows, n)
    theirs = run_sharded(lambda r: lax.all_to_all(r, "batch", 0, 0, tiled=True), rows, n)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    np.testing.assert_array_equal(np.asarray(ours)[:, 0], rows[0])  # row k is from k


def test_exchange_rows_over_a_tuple_of_mesh_axes_is_an_all_to_all():
    """With axis_name a tuple of mesh axes (one group of 2 x 4 devices, as the benchmark's
    ("proc", "dev")), the shift rounds use the same participant order as all_to_all."""
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("a", "b"))
    axes = ("a", "b")
    rows = np.random.default_rng(7).integers(0, 256, (8, 8, 1_100_000), np.uint8)

    def run(fn):
        mapped = jax.shard_map(lambda r: fn(r[0])[None], mesh=mesh, in_specs=P(axes),
                               out_specs=P(axes))
        return np.asarray(jax.jit(mapped)(rows))

    ours = run(lambda r: exchange_rows(r, axes, lax.axis_index(axes), 8, in_rounds=True))
    theirs = run(lambda r: lax.all_to_all(r, axes, 0, 0, tiled=True))
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("num_devices", [2, 3])
def test_gather_packets_is_an_all_gather_bitwise_and_invariant(num_devices):
    """The packet gather in pieces (on CPU across processes between 2 participants; forced
    here, 2 uneven pieces) equals a plain all_gather, and its result is typed invariant:
    out_specs=P() accepts it under shard_map's type check."""
    n = num_devices
    packets = np.random.default_rng(n).integers(0, 256, (n, 1_200_001), np.uint8)
    mesh = cpu_mesh(n)

    def run(fn, out_specs):
        return np.asarray(jax.jit(jax.shard_map(lambda p: fn(p[0]), mesh=mesh,
                                                in_specs=P("batch"), out_specs=out_specs))(packets))

    ours = run(lambda p: gather_packets(p, "batch", n, in_pieces=True), P())
    theirs = run(lambda p: lax.all_gather(p, "batch")[None], P("batch"))
    np.testing.assert_array_equal(ours, theirs[0])
    np.testing.assert_array_equal(ours, packets)


def test_one_process_keeps_the_plain_collectives():
    """Devices of one process (no Gloo) get one all_to_all / all_gather, not rounds."""
    def count(fn, shape):
        mapped = jax.shard_map(fn, mesh=cpu_mesh(2), in_specs=P("batch"), out_specs=P("batch"),
                               check_vma=False)
        hlo = jax.jit(mapped).lower(np.zeros(shape, np.uint8)).compile().as_text()
        return {op: hlo.count(f" {op}(") for op in ("all-to-all", "collective-permute",
                                                      "all-gather")}

    def exchange(**kw):  # per device: rows [2, m]
        return lambda r: exchange_rows(r, "batch", lax.axis_index("batch"), 2, **kw)

    def gather(**kw):  # per device: one packet
        return lambda p: gather_packets(p[0], "batch", 2, **kw)[None]

    rows, packets = (4, 1_200_001), (2, 1_200_001)
    assert count(exchange(), rows) == {"all-to-all": 1, "collective-permute": 0,
                                       "all-gather": 0}
    assert count(exchange(in_rounds=True), rows)["collective-permute"] == 2
    assert count(gather(), packets)["all-gather"] == 1
    assert count(gather(in_pieces=True), packets)["all-gather"] == 2
