"""cgx_jax/_src/reduction.py: the plan of a compressed all-reduce, checked without running anything
(shapes only, sizes worked out by hand from docs/design.md section 6), and the plan's
agreement with what the run packs."""

import jax
import jax.numpy as jnp
import numpy as np

import cgx_jax as cgx
from cgx_jax._src import fusion
from cgx_jax._src.reduction import Segment, plan_reduction

FOUR = cgx.Codec(bits=4, bucket_size=64)
EIGHT = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")
BIG = 1 << 18  # fusion.OWN_SEGMENT_MIN_VALUES


def shapes(*shape_list, dtype=jnp.float32):
    return [jax.ShapeDtypeStruct(shape, dtype) for shape in shape_list]


# A large leaf, an exact bias, two small layers, a large leaf one value past whole chunks,
# a leaf of another codec, an empty leaf.
LEAVES = shapes((BIG,), (10,), (100,), (3, 50), (BIG + 1,), (5000,), (0, 4))
CODECS = [FOUR, None, FOUR, FOUR, FOUR, EIGHT, FOUR]


def test_sra_plan_by_hand():
    """SRA over 4: chunks of whole 64-value buckets, so segments pad to 256. Leaves of 2^18
    values or more that fall short only within their last chunk travel alone, read in place
    (size: the leaf's values; length: padded to 256); the others are packed
    bucket-aligned (100 -> 128, 150 -> 192: 320 -> 512). Codec groups in first-seen order,
    an empty leaf is exact, and all segments share one set of collectives."""
    plan = plan_reduction(LEAVES, CODECS, algorithm="sra", num_participants=4)
    assert plan.exact == (1, 6)
    assert plan.segments == (
        Segment(FOUR, (0,), 0, 256, BIG, BIG),
        Segment(FOUR, (4,), 0, 256, BIG + 1, BIG + 256),
        Segment(FOUR, (2, 3), 0, 256, 512, 512),
        # The other group's only leaf: short only within its last chunk, so read in place.
        Segment(EIGHT, (5,), 1, 256, 5000, 5120),
    )
    assert plan.batches == [(0, 1, 2, 3)]
    assert plan.rows == 4 and plan.divisor == 1


def test_ring_and_hierarchical_plans_take_one_buffer_per_codec():
    """The ring and the hierarchical reduction run each group as one padded buffer, one set
    of collectives each; the hierarchical multiple is inner size times the outer one."""
    ring = plan_reduction(LEAVES, CODECS, algorithm="ring", num_participants=4)
    packed = 262144 + 128 + 192 + 262208  # every FOUR leaf bucket-aligned, in order
    assert ring.segments == (
        Segment(FOUR, (0, 2, 3, 4), 0, 256, 524800, 524800),  # packed, padded to 256
        Segment(EIGHT, (5,), 1, 256, 5120, 5120),
    )
    assert packed <= 524800 < packed + 256
    assert ring.batches == [(0,), (1,)]
    tiered = plan_reduction(LEAVES[5:6], [EIGHT], algorithm="allgather", num_participants=2,
                            inner_size=4, mean=True)
    assert tiered.segments == (Segment(EIGHT, (0,), 0, 256, 5120, 5120),)  # copied, padded
    assert tiered.rows is None and tiered.divisor == 8


def test_wire_settings_tell_plans_apart():
    """What the processes compare: equal for equal plans, different when a shape, a dtype, a
    codec or the algorithm differs."""
    def settings(leaves=LEAVES, codecs=CODECS, algorithm="sra"):
        return plan_reduction(leaves, codecs, algorithm=algorithm,
                              num_participants=4).wire_settings()

    assert settings() == settings()
    assert settings() != settings(leaves=shapes((BIG,), (11,), *[leaf.shape for leaf in
                                                                   LEAVES[2:]]))
    assert settings() != settings(codecs=[EIGHT, *CODECS[1:]])
    assert settings() != settings(algorithm="allgather")
    # One process's exact bias in bf16, the other's in f32: nothing else in the plan differs.
    bf16_bias = [LEAVES[0], jax.ShapeDtypeStruct(LEAVES[1].shape, jnp.bfloat16), *LEAVES[2:]]
    assert settings() != settings(leaves=bf16_bias)


def test_plan_matches_what_the_run_packs():
    """Each segment's size and length are those of the buffer fusion.pack makes of its
    leaves (run_plan asserts the same on every call)."""
    for algorithm, n in (("sra", 4), ("allgather", 2), ("ring", 3)):
        plan = plan_reduction(LEAVES, CODECS, algorithm=algorithm, num_participants=n)
        for segment in plan.segments:
            leaves = [jnp.zeros(LEAVES[i].shape) for i in segment.leaves]
            buf, length = fusion.pack(leaves, segment.codec.bucket_size, segment.multiple,
                                      plan.rows)
            assert (buf.size, length) == (segment.size, segment.length), (algorithm, segment)
            assert length % segment.multiple == 0
    assert np.all([s.length >= s.size for s in plan.segments])
