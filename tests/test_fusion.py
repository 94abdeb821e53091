"""Fusion into segments (cgx_jax/fusion.py, docs/design.md section 6): with SRA and
all-gather every leaf of at least ``OWN_SEGMENT_MIN_VALUES`` values is a segment of its own
(one short of whole chunks within its last chunk is padded by the kernels) and the other
leaves are packed into one more; all segments share the
algorithm's collectives. The reference is a numpy simulation of each algorithm per segment, built from
the numpy model of the codec (tests/numpy_model.py) with nearest rounding, compared bit for
bit: it sees which chunk (and so which participant's raw values) every bucket lands in.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import cgx_jax as cgx
import numpy_model as model
from cgx_jax.api import reduce_tree
from cgx_jax.fusion import OWN_SEGMENT_MIN_VALUES, fits_short_row, split_segments
from helpers import run_sharded

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
        lost = chunks[:, c] - model.dequantize_rows(peers, bits, bucket, width)
        lost[c] = 0.0  # the owner adds its chunk raw
        errors[:, c] = lost
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
    got, lost = run_sharded(
        lambda t: reduce_tree(t, "batch", policy=POLICY, algorithm=algorithm, local_error=True),
        jax.tree.map(jnp.asarray, stacked), num_devices)
    want = reference_tree(stacked, algorithm, segments)
    for name, (value, errors) in want.items():
        assert got[name].dtype == stacked[name].dtype and got[name].shape == stacked[name].shape
        for device in range(num_devices):
            np.testing.assert_array_equal(np.asarray(got[name][device]), value, err_msg=name)
        np.testing.assert_array_equal(np.asarray(lost[name]), errors, err_msg=name)
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


def test_grad_through_segments_is_a_psum():
    stacked = {name: jnp.asarray(v.astype(np.float32)) for name, v in model_tree(4).items()}

    def grads(reduce):
        def loss(t):
            out = reduce(t)
            return sum(jnp.sum(v * (i + 1)) for i, v in enumerate(jax.tree.leaves(out)))
        return run_sharded(jax.grad(loss), stacked, 4)

    got = grads(lambda t: cgx.compressed_psum(t, "batch", policy=POLICY))
    want = grads(lambda t: jax.lax.psum(t, "batch"))
    for name in stacked:
        assert got[name].shape == want[name].shape
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
