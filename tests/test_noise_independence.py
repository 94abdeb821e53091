"""Stochastic rounding's noise is independent wherever docs/design.md section 6 says it is:
across participants, across the inner participants of a hierarchical reduction, across SRA's
two phases, across the ring's hops, across fused groups, across the segments of one group
and across training steps.

Replicas being identical and errors staying within their worst-case bounds cannot see a
shared noise stream: N participants rounding with the same noise still give identical
replicas and bounded errors, but their errors add up coherently instead of averaging out,
which is what stochastic rounding is for. These tests look at second moments instead.

The inputs are identical on every participant and periodic with the period of the
algorithm's smallest split (chunk, inner piece), every bucket holding 0 and 1, so each
element's error distribution is known and errors that should be independent can be summed
and compared:

- ``Q1 = sum(err**2)``: coherent errors over the participants that reduce the same element
  make it grow (with the same noise, N errors add up to N times one error, not sqrt(N));
- ``Q2 = sum_j (sum_blocks err_block[j])**2``: correlated errors between blocks (chunks of
  SRA encoded by one participant in both phases, ring hops, inner pieces) make it grow.

The error's sum is also checked against zero (stochastic rounding through a whole algorithm
stays unbiased). The reference is a numpy simulation of the same algorithm, built from the
numpy model of the codec (tests/numpy_model.py) with fresh, independent noise for every
encode. Both sides compute with the same f32 operations on the same values, so the
expectations of Q1 and Q2 agree exactly when the library's noise is independent; the test
computes the standard error of each statistic from its terms and allows 5 of them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_model as model
import pytest
from helpers import cpu_mesh, run_2d, run_sharded
from jax.sharding import PartitionSpec as P

import cgx_jax as cgx
from cgx_jax._src.fusion import OWN_SEGMENT_MIN_VALUES

BITS, BUCKET = 2, 128
CODEC = cgx.Codec(bits=BITS, bucket_size=BUCKET, rounding="stochastic")
N = 8
Z_LIMIT = 5.0


# ---------------------------------------------------------------------------
# Inputs and the independent-noise simulation
# ---------------------------------------------------------------------------

def unit_range_block(length, seed):
    """f32 values in [0, 1), every bucket holding an exact 0 and 1 so that every bucket's
    range (and the range of every partial sum of copies) is known exactly."""
    rng = np.random.default_rng(seed)
    x = rng.random(length).astype(np.float32).reshape(-1, BUCKET)
    x[:, 3], x[:, 77] = 0.0, 1.0
    return x.reshape(-1)


def roundtrip(x, rng):
    """Quantize and decode ``x`` with the codec's f32 arithmetic and fresh uniform noise."""
    values = x.reshape(-1, BUCKET)
    mn, mx = model._bucket_min_max(values)
    mn, unit, inv = model.make_scale(mn, mx, np.ones(len(values), bool), BITS)
    u = (rng.integers(0, 2**24, values.shape) * 2.0**-24).astype(np.float32)
    levels = model.encode_levels(values, mn[:, None], inv[:, None], u, BITS)
    return model.decode_levels(levels, mn[:, None], unit[:, None]).reshape(-1)


def simulate(x, num_participants, algorithm, rng):
    """The sum over ``num_participants`` participants all holding ``x``, computed as the
    algorithm computes it (same operations, same peer order), every encode with its own noise."""
    if algorithm == "allgather":
        total = np.zeros_like(x)
        for _ in range(num_participants):
            total = total + roundtrip(x, rng)
        return total
    chunks = x.reshape(num_participants, -1)
    out = []
    for index, own in enumerate(chunks):
        if algorithm == "sra":  # N-1 peers' encodes and the raw own chunk, then re-encoded
            total = np.zeros_like(own)
            for peer in range(num_participants):
                total = total + (own if peer == index else roundtrip(own, rng))
            out.append(roundtrip(total, rng))
        else:  # ring: encoded raw, then N-1 hops of decode + own raw chunk + encode
            value = roundtrip(own, rng)
            for _ in range(num_participants - 1):
                value = roundtrip((np.zeros_like(own) + value) + own, rng)
            out.append(value)
    return np.concatenate(out)


def statistics(error, blocks):
    """(Q1, Q2) of an error vector split into ``blocks`` equal blocks, with the terms whose
    spread gives each statistic's standard error."""
    q1_terms = error**2
    q2_terms = error.reshape(blocks, -1).sum(0) ** 2
    return (q1_terms.sum(), q1_terms), (q2_terms.sum(), q2_terms)


def z_score(got, want):
    """How many standard errors apart two sums of independent terms are."""
    (got_sum, got_terms), (want_sum, want_terms) = got, want
    variance = len(got_terms) * got_terms.var() + len(want_terms) * want_terms.var()
    return (got_sum - want_sum) / np.sqrt(variance)


def assert_independent(library_error, simulated_error, blocks):
    # Unbiased first: the errors' sum is within Z_LIMIT standard errors of zero.
    bias_z = library_error.sum() / np.sqrt(len(library_error) * library_error.var())
    assert abs(bias_z) < Z_LIMIT, f"the error's mean is {bias_z:.1f} standard errors off zero"
    got, want = statistics(library_error, blocks), statistics(simulated_error, blocks)
    z1, z2 = z_score(got[0], want[0]), z_score(got[1], want[1])
    ratios = got[0][0] / want[0][0], got[1][0] / want[1][0]
    message = f"Q1 ratio {ratios[0]:.3f} (z {z1:.1f}), Q2 ratio {ratios[1]:.3f} (z {z2:.1f})"
    assert abs(z1) < Z_LIMIT and abs(z2) < Z_LIMIT, message


def run_flat(x, algorithm, key):
    """compressed_psum over N devices that all hold ``x``; device 0's result."""
    out = np.asarray(run_sharded(
        lambda v, k: cgx.compressed_psum(v, "batch", codec=CODEC, key=k, algorithm=algorithm),
        jnp.tile(jnp.asarray(x), (N, 1)), N, key))
    np.testing.assert_array_equal(out, np.broadcast_to(out[0], out.shape))
    return out[0].astype(np.float64)


# ---------------------------------------------------------------------------
# Participants: the mean of N independent encodes has 1/N the variance of one
# ---------------------------------------------------------------------------

def test_mean_error_variance_is_one_over_n_of_one_participants():
    # All-gather: every participant encodes x once and everyone averages the N decodes, so
    # with independent noise the variance of the mean's error is sigma^2 / N, where sigma^2
    # = unit^2 f (1 - f) is one stochastic rounding's variance (f: the fractional level).
    x = unit_range_block(N * 4096, seed=1)
    mean = run_flat(x, "allgather", jax.random.key(3)) / N
    error = mean - x.astype(np.float64)
    unit = 1.0 / (2**BITS - 1)
    fraction = np.modf(x.astype(np.float64) / unit)[0]
    one_participant = unit**2 * fraction * (1 - fraction)
    ratio = (error**2).sum() / one_participant.sum()
    # Standard error of sum(error^2): the terms are independent; their variance is bounded
    # by the fourth moment of a mean of N bounded errors, estimated here from the terms.
    standard_error = np.sqrt(len(error) * (error**2).var()) / one_participant.sum()
    assert abs(ratio - 1 / N) < Z_LIMIT * standard_error, (ratio, 1 / N, standard_error)
    assert standard_error < 0.1 / N  # the test can tell 1/N from 1 by a wide margin


@pytest.mark.parametrize("algorithm", ["allgather", "sra", "ring"])
def test_flat_algorithms_match_independent_noise(algorithm):
    # Q1 sees participants sharing noise; Q2 (blocks = SRA/ring chunks) sees one
    # participant's noise reused across SRA's phases or the ring's hops, whose encodes of
    # the (identical) chunks would then move together.
    x = np.tile(unit_range_block(32768, seed=2), N)
    library = run_flat(x, algorithm, jax.random.key(5)) - N * x.astype(np.float64)
    rng = np.random.default_rng(6)
    simulated = simulate(x, N, algorithm, rng).astype(np.float64) - N * x.astype(np.float64)
    assert_independent(library, simulated, blocks=N)


@pytest.mark.parametrize("outer, inner", [(2, 4), (4, 2)])
def test_hierarchical_inner_participants_draw_their_own_noise(outer, inner):
    # The inner participants each reduce one piece over the outer axis; identical pieces
    # encoded with one noise stream would give identical errors (Q2 over pieces and chunks).
    chunk = 1024
    x = np.tile(unit_range_block(chunk, seed=3), outer * inner)
    out = np.asarray(run_2d(
        lambda v, k: cgx.compressed_psum(v, "outer", inner_axis_name="inner", codec=CODEC,
                                         key=k, algorithm="sra"),
        jnp.tile(jnp.asarray(x), (outer * inner, 1)), outer, inner, jax.random.key(7)))
    np.testing.assert_array_equal(out, np.broadcast_to(out[0], out.shape))
    exact = outer * inner * x.astype(np.float64)
    rng = np.random.default_rng(8)
    pieces = (np.float32(inner) * x).reshape(inner, -1)  # the exact inner sums
    simulated = np.concatenate([simulate(piece, outer, "sra", rng) for piece in pieces])
    assert_independent(out[0] - exact, simulated - exact, blocks=outer * inner)
    # The chunks are alike, so two devices sharing a noise index (o + i instead of
    # o * inner + i) re-encode two of them with the same noise: those chunks' errors would
    # correlate (measured 0.52-0.58); independent noise leaves every pair near 0 (at most
    # 0.06-0.09 here).
    chunks = (out[0] - exact).reshape(outer * inner, -1)
    correlations = np.corrcoef(chunks)[np.triu_indices(outer * inner, 1)]
    assert np.abs(correlations).max() < 0.25


# ---------------------------------------------------------------------------
# Fused groups and training steps
# ---------------------------------------------------------------------------

def test_fused_groups_draw_their_own_noise():
    # Two identical leaves in two groups (bucket sizes 128 and 256: every 256-bucket holds
    # a 0 and a 1 as well, so both see the same units and fractional levels): with one noise
    # stream their errors would be equal; independent, they are uncorrelated.
    x = unit_range_block(N * 2048, seed=4).reshape(64, -1)
    policy = cgx.LayerPolicy(default=CODEC, min_size=0,
                             overrides={"b": cgx.Codec(bits=BITS, bucket_size=2 * BUCKET,
                                                       rounding="stochastic")})
    tree = {"a": jnp.tile(jnp.asarray(x)[None], (N, 1, 1))}
    tree["b"] = tree["a"]
    out = run_sharded(lambda t, k: cgx.compressed_psum(t, "batch", policy=policy, key=k),
                      tree, N, jax.random.key(9))
    errors = [np.asarray(out[name][0], np.float64).ravel() - N * x.ravel() for name in "ab"]
    assert_uncorrelated(*errors)


def test_segments_of_one_group_draw_their_own_noise():
    # Two identical leaves large enough to be segments of their own (fusion.py) in one
    # group: with one noise stream their errors would be equal; independent, uncorrelated.
    x = unit_range_block(OWN_SEGMENT_MIN_VALUES, seed=6).reshape(512, -1)
    tree = {"a": jnp.tile(jnp.asarray(x)[None], (N, 1, 1))}
    tree["b"] = tree["a"]
    policy = cgx.LayerPolicy(default=CODEC, min_size=0)
    out = run_sharded(lambda t, k: cgx.compressed_psum(t, "batch", policy=policy, key=k),
                      tree, N, jax.random.key(10))
    errors = [np.asarray(out[name][0], np.float64).ravel() - N * x.ravel() for name in "ab"]
    assert_uncorrelated(*errors)


def test_consecutive_steps_of_the_transform_draw_fresh_noise():
    # The transform splits its key every step: the same gradient reduced at two steps has
    # errors that are uncorrelated.
    x = unit_range_block(N * 2048, seed=5).reshape(64, -1)
    tx = cgx.compressed_allreduce("batch", policy=cgx.LayerPolicy(default=CODEC, min_size=0))
    mesh = cpu_mesh(N)
    state = cgx.shard_state(tx.init({"w": jnp.zeros(x.shape)}), mesh, "batch")
    specs = cgx.state_specs(state, "batch")

    def two_steps(g, state):
        first, state = tx.update(g, state)
        second, state = tx.update(g, state)
        return first, second

    f = jax.jit(jax.shard_map(two_steps, mesh=mesh, in_specs=(P(), specs),
                              out_specs=(P(), P()), check_vma=False))
    first, second = f({"w": jnp.asarray(x)}, state)
    errors = [np.asarray(step["w"], np.float64).ravel() - x.ravel() for step in (first, second)]
    assert_uncorrelated(*errors)


def assert_uncorrelated(a, b):
    # Pearson correlation of n independent pairs has standard error about 1/sqrt(n).
    correlation = np.corrcoef(a, b)[0, 1]
    assert abs(correlation) < Z_LIMIT / np.sqrt(len(a)), correlation
    assert np.abs(a).max() > 0 and np.abs(b).max() > 0
