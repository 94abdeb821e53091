"""collectives/transport.py and collectives/jax_compat.py (docs/design.md sections 4 and 5):
exchange_rows in rounds (shift rounds, the swap round in pieces) is a tiled all_to_all, and
gather_packets in pieces an all_gather, byte for byte, also over a tuple of mesh axes; the
rounds are forced here in one process, where by default the plain collectives stay; and the
psum fallback of jax_compat.gather_invariant, for jax releases without all_gather_invariant,
gives the same bits and gradients.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cpu_mesh, run_sharded
from jax import lax
from jax.sharding import PartitionSpec as P

import cgx_jax as cgx
from cgx_jax._src.collectives import jax_compat
from cgx_jax._src.collectives.transport import (
    SWAP_PIECE_BYTES,
    exact_reduce_scatter,
    exchange_rows,
    gather_packets,
)


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


def test_the_hierarchical_reduction_on_cpu_has_no_xla_reduce_scatter():
    """XLA:CPU's multi-process reduce-scatter intermittently returns wrong values for
    multi-MiB pieces (jax-ml/jax#40830), so on CPU the inner stage of the hierarchical
    reduction is a psum and a slice (transport.exact_reduce_scatter): its compiled program
    holds no reduce-scatter, and the stage equals lax.psum_scatter. (test_multiprocess.py
    runs it across processes on 32 MiB pieces, bitwise against one process.)"""
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]).reshape(4, 2), ("outer", "inner"))
    spec = P(("outer", "inner"))
    codec = cgx.Codec(bits=4, bucket_size=512)

    def hierarchical(x):
        return cgx.compressed_psum(x[0], "outer", inner_axis_name="inner", codec=codec,
                                   key=jax.random.key(0))[None]

    def stage(fn):
        return jax.jit(jax.shard_map(lambda x: fn(x[0])[None], mesh=mesh, in_specs=spec,
                                     out_specs=spec))

    x = np.random.default_rng(3).normal(size=(8, 1 << 16)).astype(np.float32)
    hlo = jax.jit(jax.shard_map(hierarchical, mesh=mesh, in_specs=spec, out_specs=spec)
                  ).lower(x).compile().as_text()
    assert " all-reduce(" in hlo and " reduce-scatter(" not in hlo
    ours = stage(lambda v: exact_reduce_scatter(v, "inner"))
    theirs = stage(lambda v: lax.psum_scatter(v, "inner", scatter_dimension=0, tiled=True))
    assert " reduce-scatter(" not in ours.lower(x).compile().as_text()
    np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(theirs(x)))


def test_psum_fallback_gather_for_older_jax_gives_the_same_bits_and_grads(monkeypatch):
    # jax releases without all_gather_invariant get a psum of zero-padded pieces instead.
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
