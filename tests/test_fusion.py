"""Fusion into segments (cgx_jax/_src/fusion.py, docs/design.md section 6): with SRA and
all-gather every leaf of at least ``OWN_SEGMENT_MIN_VALUES`` values is a segment of its own
(one short of whole chunks within its last chunk is padded by the kernels) and the other
leaves are packed into one more; all segments share the
algorithm's collectives. The reference is a numpy simulation of each algorithm per segment,
built from the numpy model of the codec (tests/numpy_model.py) with nearest rounding, compared
bit for bit: it sees which chunk (and so which participant's raw values) every bucket lands in.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import numpy_model as model
import pytest
from helpers import cpu_mesh, run_sharded

import cgx_jax as cgx
from cgx_jax._src import fusion
from cgx_jax._src.api import reduce_tree_with_residual
from cgx_jax._src.fusion import OWN_SEGMENT_MIN_VALUES, fits_short_row, split_segments

NOTHING_COMPRESSED = "no leaf is compressed"  # the default policy keeps these trees exact

CODEC = cgx.Codec(bits=3, bucket_size=64, rounding="nearest")
POLICY = cgx.LayerPolicy(default=CODEC, min_size=0)
LARGE = OWN_SEGMENT_MIN_VALUES


def test_split_segments_at_the_threshold():
    m = 4096
    sizes = [LARGE - m, LARGE, 5, 3 * LARGE, 0, LARGE + 1]
    assert split_segments(sizes, m, rows=4) == [[1], [3], [5], [0, 2, 4]]
    assert split_segments([LARGE, LARGE], m, rows=4) == [[0], [1]]
    assert split_segments([5, 7], m, rows=4) == [[0, 1]]
    assert split_segments(sizes, m, rows=None) == [[0, 1, 2, 3, 4, 5]]
    # Short of whole chunks only within the last of the rows: the kernels pad it in place.
    assert fits_short_row(4 * LARGE - 1, 4 * LARGE, 4)
    assert not fits_short_row(LARGE + 1, 2 * LARGE, 4)  # 3/4 of a chunk short: packed
    assert split_segments([LARGE + 1, 2 * LARGE], 2 * LARGE, rows=4) == [[1], [0]]
    assert split_segments([LARGE + 1], 2 * LARGE, rows=1) == [[0]]  # all-gather: one row


# ---------------------------------------------------------------------------
# The numpy reference
# ---------------------------------------------------------------------------

def pad_repeating(flat, multiple):
    extra = -flat.size % multiple
    return np.concatenate([flat, np.repeat(flat[-1:], extra)]) if extra else flat


def packed(leaves, multiple):
    """One participant's segment as the design describes it: each leaf f32, padded to whole
    buckets, concatenated, padded to ``multiple``; the last value repeats."""
    pieces = [pad_repeating(np.asarray(leaf, np.float32).ravel(), CODEC.bucket_size)
              for leaf in leaves]
    return pad_repeating(np.concatenate(pieces), multiple)


def reference_sum(segment_rows, algorithm):
    """The algorithm's sum of one segment, ``segment_rows [N, length]`` (participant p's
    padded segment in row p), with nearest rounding, and each participant's local error."""
    n, length = segment_rows.shape
    bits, bucket = CODEC.bits, CODEC.bucket_size
    seed = np.zeros(2, np.uint32)
    if algorithm == "allgather":
        packets = model.quantize_rows(segment_rows, seed, bits, bucket, False)
        _, total = model.reduce_requantize(packets, None, 0, seed, bits, bucket, False, length)
        errors = segment_rows - model.dequantize_rows(packets, bits, bucket, length)
        return total, errors
    chunks = segment_rows.reshape(n, n, -1)  # [participant, chunk, values]
    width = chunks.shape[2]
    decoded = []
    errors = np.zeros_like(chunks)
    for c in range(n):
        peers = model.quantize_rows(chunks[:, c], seed, bits, bucket, False)
        packet, _ = model.reduce_requantize(peers, chunks[c, c], c, seed, bits, bucket, False,
                                            width)
        decoded.append(model.dequantize_rows(packet[None], bits, bucket, width)[0])
        residual = chunks[:, c] - model.dequantize_rows(peers, bits, bucket, width)
        residual[c] = 0.0  # the owner adds its chunk raw
        errors[:, c] = residual
    return np.concatenate(decoded), errors.reshape(n, -1)


def reference_tree(stacked, algorithm, segments):
    """Per leaf name: (the sum, cast to the leaf's dtype; the local errors ``[N, ...]``)."""
    names = sorted(stacked)
    n = stacked[names[0]].shape[0]
    multiple = CODEC.bucket_size * (n if algorithm == "sra" else 1)
    out = {}
    for segment in segments:
        members = [names[i] for i in segment]
        rows = np.stack([packed([stacked[m][p] for m in members], multiple) for p in range(n)])
        total, errors = reference_sum(rows, algorithm)
        offset = 0
        for m in members:
            shape, size = stacked[m].shape[1:], int(np.prod(stacked[m].shape[1:]))
            value = total[offset:offset + size].reshape(shape).astype(stacked[m].dtype)
            out[m] = (value, errors[:, offset:offset + size].reshape((n,) + shape))
            offset += len(pad_repeating(np.zeros(size), CODEC.bucket_size))
    return out


def model_tree(num_devices):
    """Two large leaves, a large bf16 leaf, a large leaf needing padding (a segment of its
    own, padded by the kernels) and two small ones (packed together)."""
    rng = np.random.default_rng(num_devices)
    shapes = {"big": (512, 520), "big2": (512, LARGE // 512), "half": (640, 480),
              "odd": (513, 517), "small": (300, 7), "small2": (64, 64)}
    tree = {name: rng.normal(size=(num_devices,) + shape).astype(np.float32)
            for name, shape in shapes.items()}
    tree["half"] = tree["half"].astype(ml_dtypes.bfloat16)
    return tree


# Leaves in sorted order: big, big2, half, odd, small, small2. With 3 participants only
# half is a whole number of SRA's chunks (3 x 64 values): big, big2 and odd are short
# within their last chunk, which the kernels pad.
@pytest.mark.parametrize("algorithm,num_devices,segments", [
    ("sra", 4, [[0], [1], [2], [3], [4, 5]]),
    ("sra", 3, [[0], [1], [2], [3], [4, 5]]),
    ("allgather", 2, [[0], [1], [2], [3], [4, 5]]),
])
def test_segments_match_numpy_reference_bitwise(algorithm, num_devices, segments):
    stacked = model_tree(num_devices)
    got, residual = run_sharded(
        lambda t: reduce_tree_with_residual(t, "batch", policy=POLICY, algorithm=algorithm),
        jax.tree.map(jnp.asarray, stacked), num_devices)
    want = reference_tree(stacked, algorithm, segments)
    for name, (value, errors) in want.items():
        assert got[name].dtype == stacked[name].dtype and got[name].shape == stacked[name].shape
        for device in range(num_devices):
            np.testing.assert_array_equal(np.asarray(got[name][device]), value, err_msg=name)
        np.testing.assert_array_equal(np.asarray(residual[name]), errors, err_msg=name)
    # The layout is visible to the reference: packing every leaf into one buffer gives
    # other bytes (buckets land in other participants' chunks).
    if algorithm == "sra":
        one_buffer = reference_tree(stacked, algorithm, [[0, 1, 2, 3, 4, 5]])
        assert not np.array_equal(one_buffer["big2"][0], want["big2"][0])


def test_ring_and_hierarchical_keep_one_buffer():
    stacked = model_tree(4)
    got = run_sharded(lambda t: cgx.compressed_psum(t, "batch", policy=POLICY, algorithm="ring"),
                      jax.tree.map(jnp.asarray, stacked), 4)
    flat = run_sharded(
        lambda t: cgx.compressed_psum(t, "batch", codec=CODEC, algorithm="ring"),
        jnp.asarray(np.stack([packed([stacked[m][p] for m in sorted(stacked)], 4 * 64)
                              for p in range(4)])), 4)
    start = len(pad_repeating(stacked["big"][0].ravel(), 64))  # big2 follows big
    np.testing.assert_array_equal(np.asarray(got["big2"][0]),
                                  np.asarray(flat[0])[start:start + LARGE].reshape(512, -1))


@pytest.mark.parametrize("mean", [False, True])
def test_grad_through_segments_is_a_psum(mean):
    stacked = {name: jnp.asarray(v.astype(np.float32)) for name, v in model_tree(4).items()}

    def grads(reduce):
        def loss(t):
            out = reduce(t)
            return sum(jnp.sum(v * (i + 1)) for i, v in enumerate(jax.tree.leaves(out)))
        return run_sharded(jax.grad(loss), stacked, 4)

    if mean:  # the kernels scale the sum; the tangent is the exact pmean's
        got = grads(lambda t: cgx.compressed_pmean(t, "batch", policy=POLICY))
        want = grads(lambda t: jax.lax.pmean(t, "batch"))
    else:
        got = grads(lambda t: cgx.compressed_psum(t, "batch", policy=POLICY))
        want = grads(lambda t: jax.lax.psum(t, "batch"))
    for name in stacked:
        assert got[name].shape == want[name].shape
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# ---------------------------------------------------------------------------
# Exact leaves: small ones share one buffer per dtype (fusion.reduce_exact)
# ---------------------------------------------------------------------------

def exact_tree(num_devices, rng):
    """Leaves the default policy keeps exact, of three dtypes and one above the fusing limit."""
    def draw(shape, dtype):
        values = rng.standard_normal((num_devices, *shape)) * 10 ** rng.uniform(-3, 3)
        return jnp.asarray(values.astype(dtype) if dtype != np.int32
                           else rng.integers(-1000, 1000, (num_devices, *shape), np.int32))
    return {"norm": {"scale": draw((384,), np.float32), "bias": draw((384,), np.float32)},
            "head_bias": draw((10,), np.float32), "scalar": draw((), np.float32),
            "embed_bias": draw((3, 7), ml_dtypes.bfloat16),
            "ln_bf16": draw((64,), ml_dtypes.bfloat16),
            "step": draw((), np.int32), "counts": draw((5,), np.int32),
            "big_exact": draw((fusion.EXACT_FUSE_MAX_VALUES,), np.float32)}


@pytest.fixture(params=[True, False], ids=["fused", "unfused"])
def exact_fusion(request, monkeypatch):
    """Both ways exact leaves travel: fused (across CPU processes) and one operand each."""
    monkeypatch.setattr(fusion, "exact_fusion_pays", lambda: request.param)
    return request.param


@pytest.mark.parametrize("mean", [False, True])
def test_exact_leaves_fused_match_psum_bitwise(mean, exact_fusion):
    tree = exact_tree(4, np.random.default_rng(7))
    reduce = cgx.compressed_pmean if mean else cgx.compressed_psum
    with pytest.warns(UserWarning, match=NOTHING_COMPRESSED):  # default policy: all exact
        got = run_sharded(lambda t: reduce(t, "batch"), tree, 4)
    want = run_sharded(lambda t: jax.tree.map(
        lambda v: (jax.lax.pmean if mean else jax.lax.psum)(v, "batch"), t), tree, 4)
    for path, value in jax.tree_util.tree_leaves_with_path(want):
        leaf = got
        for key in path:
            leaf = leaf[key.key]
        assert leaf.dtype == value.dtype and leaf.shape == value.shape, path
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(value), err_msg=str(path))


def test_exact_leaves_travel_as_one_operand_per_dtype_across_cpu_processes(exact_fusion):
    """Fused (across CPU processes, where XLA:CPU runs each operand as its own collective):
    one operand per dtype plus one per leaf above the limit, not one per leaf. Unfused (one
    process, GPUs: no latency per operand, and each unpacked leaf would be a copy kernel to
    compile): one operand per leaf."""
    tree = jax.tree.map(lambda v: v[0], exact_tree(1, np.random.default_rng(0)))
    mesh = cpu_mesh(4)
    f = jax.jit(jax.shard_map(lambda t: cgx.compressed_psum(t, "batch"), mesh=mesh,
                              in_specs=jax.sharding.PartitionSpec(),
                              out_specs=jax.sharding.PartitionSpec(), check_vma=False))
    # JAX lowers each operand as its own all_reduce: f32, bf16 and int32 buffers and the large
    # f32 leaf alone, against 9 for the 9 leaves.
    with pytest.warns(UserWarning, match=NOTHING_COMPRESSED):
        assert f.lower(tree).as_text().count("stablehlo.all_reduce") == (4 if exact_fusion
                                                                          else 9)


def test_exact_leaves_are_fused_only_across_cpu_processes():
    assert not fusion.exact_fusion_pays()  # this test process: one process, 8 CPU devices


def test_exact_fusion_keeps_each_leafs_varying_axes(exact_fusion):
    """Under shard_map with check_vma, a leaf varying over fewer mesh axes than another is not
    fused with it, so its sum keeps its type (invariant over the axes it did not vary over)."""
    mesh = cpu_mesh(4, ("batch", "model"), (2, 2))
    P = jax.sharding.PartitionSpec

    def step(a, b):
        out = cgx.compressed_psum({"a": a[0], "b": b[0]}, "batch")
        return out["a"][None], out["b"][None]

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("batch"), P(("batch", "model"))),
                              out_specs=(P(), P("model"))))
    with pytest.warns(UserWarning, match=NOTHING_COMPRESSED):
        a, b = f(jnp.arange(2 * 5.0).reshape(2, 5), jnp.arange(4 * 3.0).reshape(4, 3))
    np.testing.assert_array_equal(a[0], [5.0, 7.0, 9.0, 11.0, 13.0])
    np.testing.assert_array_equal(b[:, :], [[6.0, 8.0, 10.0], [12.0, 14.0, 16.0]])


GROUP_CODECS = {"w2": cgx.Codec(bits=2, bucket_size=128, rounding="nearest"),
                "w8": cgx.Codec(bits=8, bucket_size=256, rounding="nearest"), "w4": CODEC}


def groups_tree(num_devices, rng):
    """Leaves for three codec groups (GROUP_CODECS), one of them bf16 and one large enough
    to be a segment of its own."""
    return {"w2": rng.normal(size=(num_devices, 300, 7)).astype(np.float32),
            "w8": rng.normal(size=(num_devices, 512, LARGE // 512)).astype(np.float32),
            "w4": rng.normal(size=(num_devices, 27, 37)).astype(ml_dtypes.bfloat16)}


@pytest.mark.parametrize("algorithm", ["sra", "allgather", "ring"])
def test_codec_groups_share_the_collectives_and_keep_their_bytes(algorithm):
    """Leaves of different codecs (an adaptive policy's bit widths) travel in one set of SRA
    or all-gather collectives, each group's bytes as when it is reduced alone."""
    stacked = jax.tree.map(jnp.asarray, groups_tree(4, np.random.default_rng(5)))
    policy = cgx.LayerPolicy(min_size=0, overrides={f"^{k}$": c for k, c in GROUP_CODECS.items()})
    got = run_sharded(lambda t: cgx.compressed_pmean(t, "batch", policy=policy,
                                                     algorithm=algorithm), stacked, 4)
    for name, codec in GROUP_CODECS.items():
        alone = run_sharded(lambda v: cgx.compressed_pmean(v, "batch", codec=codec,
                                                           algorithm=algorithm), stacked[name], 4)
        assert got[name].dtype == stacked[name].dtype
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(alone), err_msg=name)

    def lowered(tree, policy):
        f = jax.jit(jax.shard_map(lambda t: cgx.compressed_psum(t, "batch", policy=policy,
                                                                algorithm=algorithm),
                                  mesh=cpu_mesh(4), in_specs=jax.sharding.PartitionSpec(),
                                  out_specs=jax.sharding.PartitionSpec(), check_vma=False))
        text = f.lower(jax.tree.map(lambda v: v[0], tree)).as_text()
        return sum(text.count(f"stablehlo.{op}") for op in ("all_to_all", "all_gather",
                                                             "collective_permute"))

    one_group = lowered({"w4": stacked["w4"]}, POLICY)
    # SRA and all-gather: one set of collectives for the three groups; the ring: one each.
    assert lowered(stacked, policy) == (3 * one_group if algorithm == "ring" else one_group)
