"""The link model (does compression pay here?): ``fit_profile`` recovers the costs that
generated a set of timings, ``cgx.estimate`` adds them up per leaf as a numpy reference
does, and says plainly when compression does not pay and why; ``python -m cgx_jax.bench
link`` measures and writes a profile across real processes."""

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cgx_jax as cgx
from cgx_jax._src.codec import Codec, wire_bytes
from cgx_jax._src.link_model import PAYS_FRACTION, LinkProfile, default_policies, fit_profile

TRUE = dict(exact_latency=2e-3, seconds_per_byte=8e-9, compressed_latency=5e-3,
            seconds_per_wire_byte=9e-9, seconds_per_value=1.5e-9, seconds_per_leaf=5e-3)


def timings(noise=0.0, seed=0):
    """Rows as ``bench allreduce`` writes them, from TRUE's lines (times relative noise)."""
    rng = np.random.default_rng(seed)
    jitter = lambda: 1 + noise * rng.standard_normal()  # noqa: E731
    rows = []
    for n in (1 << 18, 1 << 20, 1 << 22, 1 << 24):
        rows.append(dict(method="psum f32", elements=n, bits=32, seconds=(
            TRUE["exact_latency"] + TRUE["seconds_per_byte"] * 4 * n) * jitter()))
        rows.append(dict(method="psum f32", elements=n, bits=32, leaves=80, seconds=(
            TRUE["exact_latency"] + TRUE["seconds_per_byte"] * 4 * n
            + TRUE["seconds_per_leaf"] * 79) * jitter()))
        rows.append(dict(method="psum bf16", elements=n, bits=16, seconds=1.0))  # ignored
        rows.append(dict(method="cgx auto 4b", elements=n, bits=4, leaves=80, seconds=9.0))
        for bits in (2, 4, 8):
            wire = wire_bytes(n, Codec(bits=bits, bucket_size=1024))
            rows.append(dict(method=f"cgx auto {bits}b", elements=n, bits=bits, seconds=(
                TRUE["compressed_latency"] + TRUE["seconds_per_wire_byte"] * wire
                + TRUE["seconds_per_value"] * n) * jitter()))
    return rows


def test_fit_recovers_the_costs_that_made_the_timings():
    """(The many-leaf cgx rows, 9 s each, must be left out of the compressed line.)"""
    profile = fit_profile(timings(), processes=4, bucket_size=1024)
    for name, value in TRUE.items():
        assert getattr(profile, name) == pytest.approx(value, rel=1e-6), name
    # With 3% noise per measurement the network and kernel terms stay apart.
    noisy = fit_profile(timings(noise=0.03), processes=4, bucket_size=1024)
    assert noisy.seconds_per_byte == pytest.approx(TRUE["seconds_per_byte"], rel=0.1)
    assert noisy.seconds_per_wire_byte == pytest.approx(TRUE["seconds_per_wire_byte"], rel=0.2)
    assert noisy.seconds_per_value == pytest.approx(TRUE["seconds_per_value"], rel=0.2)
    assert noisy.seconds_per_leaf == pytest.approx(TRUE["seconds_per_leaf"], rel=0.2)


def test_fit_never_gives_a_negative_cost():
    # No latency at all, and noise: the least-squares intercept would come out negative.
    rows = [dict(method="psum f32", elements=n, bits=32, seconds=4e-9 * n * f)
            for n, f in ((1 << 20, 1.05), (1 << 22, 0.99), (1 << 24, 1.0))]
    rows += [dict(method=f"cgx auto {b}b", elements=n, bits=b, seconds=1e-9 * n * b / 8)
             for n in (1 << 20, 1 << 22) for b in (2, 8)]
    profile = fit_profile(rows, processes=2, bucket_size=1024)
    assert min(profile.exact_latency, profile.compressed_latency, profile.seconds_per_value,
               profile.seconds_per_wire_byte, profile.seconds_per_byte) >= 0
    # The negative terms are the ones dropped, and the rest refitted: the costs that made
    # the rows come back (1 ns per byte either way, nothing per value, next to no latency;
    # measured 0.25 ms for the exact line's noise, against its 4-67 ms rows).
    assert profile.exact_latency < 1e-3 and profile.compressed_latency < 1e-4
    assert profile.seconds_per_byte == pytest.approx(1e-9, rel=0.05)
    assert profile.seconds_per_wire_byte == pytest.approx(1e-9, rel=0.05)
    assert profile.seconds_per_value < 1e-11


def test_fit_refuses_too_few_measurements():
    rows = [r for r in timings() if r["elements"] == 1 << 20]
    with pytest.raises(ValueError, match="two sizes"):
        fit_profile(rows, processes=4, bucket_size=1024)


def reference_seconds(profile, tree, policy):
    """The compressed all-reduce's prediction worked out leaf by leaf in plain Python: one
    compressed latency per distinct codec (a fused buffer each), one exact psum."""
    wire = values = exact_bytes = 0
    codecs = set()
    for name, leaf in zip(cgx.leaf_paths(tree), jax.tree.leaves(tree)):
        n = math.prod(leaf.shape)
        codec = policy.codec_for(name, leaf)
        if codec is None:
            exact_bytes += 4 * n
        else:
            wire += wire_bytes(n, codec)
            values += n
            codecs.add(codec)
    seconds = 0.0
    if values:
        seconds += (profile.compressed_latency * len(codecs)
                    + profile.seconds_per_wire_byte * wire
                    + profile.seconds_per_value * values)
    if exact_bytes:
        seconds += profile.exact_latency + profile.seconds_per_byte * exact_bytes
    return seconds, wire + exact_bytes


MLP = {f"layer{i}": {"kernel": jax.ShapeDtypeStruct((a, b), jnp.float32),
                     "bias": jax.ShapeDtypeStruct((b,), jnp.float32)}
       for i, (a, b) in enumerate(zip((784, 2048, 2048, 2048), (2048, 2048, 2048, 10)))}


def test_estimate_adds_up_every_leaf_per_policy():
    profile = LinkProfile(processes=4, **TRUE)
    fitted = cgx.LayerPolicy(default=cgx.Codec(bits=3), overrides=((r"layer0", cgx.Codec(8)),))
    e = cgx.estimate(MLP, profile, policies={**default_policies(), "fit": fitted})
    f32 = sum(4 * math.prod(leaf.shape) for leaf in jax.tree.leaves(MLP))
    assert e.f32_bytes == f32
    # lax.psum of the tree: one all-reduce per leaf (8 leaves)
    assert e.exact_seconds == pytest.approx(TRUE["exact_latency"] + 8e-9 * f32 + 7 * 5e-3)
    policies = {**default_policies(), "fit": fitted}
    assert [p.name for p in e.policies] == list(policies)
    for row in e.policies:
        seconds, wire = reference_seconds(profile, MLP, policies[row.name])
        assert row.seconds == pytest.approx(seconds, rel=1e-12), row.name
        assert row.wire_bytes == wire, row.name
        assert row.saving == pytest.approx(e.exact_seconds - seconds, rel=1e-12)
    assert e.best.name == "2 bits" and e.pays
    text = str(e)
    assert "compression pays: 2 bits saves" in text and "exact (f32 psum)" in text


def test_estimate_takes_a_model_as_value_and_grad_does():
    """A model with leaves that carry no gradient (a Python float, a function, an integer
    array) gets the estimate of its floating arrays alone, to the byte and second."""
    profile = LinkProfile(processes=4, **TRUE)
    model = {"mlp": MLP, "scale": 0.5, "act": jnp.tanh,
             "step": jax.ShapeDtypeStruct((1000,), jnp.int32)}
    got, want = cgx.estimate(model, profile), cgx.estimate(MLP, profile)
    assert got.f32_bytes == want.f32_bytes
    assert got.exact_seconds == want.exact_seconds
    assert got.policies == want.policies


@pytest.mark.parametrize("tree, kwargs, message", [
    ({}, {}, "tree has no floating array leaf"),
    ({"n": jnp.arange(4), "act": jnp.tanh}, {}, r"leaves: \['ArrayImpl'\]"),
    (MLP, {"step_seconds": -1}, "step_seconds must be .* got -1"),
    (MLP, {"step_seconds": float("nan")}, "step_seconds must be .* got nan"),
    (MLP, {"step_seconds": "0.1"}, "step_seconds must be .* got '0.1'"),
])
def test_estimate_refuses_what_it_cannot_estimate(tree, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cgx.estimate(tree, LinkProfile(processes=4, **TRUE), **kwargs)


def test_estimate_says_when_the_link_is_fast_next_to_the_kernels():
    # 10x the link speed, kernels as slow: fewer bytes no longer make up for the encoding.
    fast = LinkProfile(processes=4, exact_latency=2e-3, seconds_per_byte=0.1e-9,
                       compressed_latency=5e-3, seconds_per_wire_byte=0.1e-9,
                       seconds_per_value=1.5e-9)
    e = cgx.estimate(MLP, fast)
    assert not e.pays and e.best.saving < PAYS_FRACTION * e.exact_seconds
    assert "will not pay" in e.advice and "link is fast next to the kernels" in e.advice


def test_estimate_says_when_the_model_is_too_small():
    small = {"conv": jnp.zeros((3, 3, 32, 64)), "dense": jnp.zeros((1600, 10)),
             "bias": jnp.zeros(64)}
    # (A backend that combines all-reduces: no per-leaf cost for the exact psum to save.)
    e = cgx.estimate(small, LinkProfile(processes=4, **{**TRUE, "seconds_per_leaf": 0.0}))
    assert not e.pays
    assert "will not pay" in e.advice and "model is small" in e.advice


def test_estimate_says_when_the_step_is_mostly_compute():
    profile = LinkProfile(processes=4, **TRUE)
    assert cgx.estimate(MLP, profile).pays  # the all-reduce alone shrinks a lot...
    e = cgx.estimate(MLP, profile, step_seconds=30.0)  # ...but next to 30 s of compute
    assert not e.pays and e.best.saving > 0.5 * e.exact_seconds
    assert "will not pay" in e.advice and "the step is mostly compute" in e.advice


def test_estimate_takes_a_saved_profile_and_refuses_bad_policies(tmp_path):
    path = str(tmp_path / "link.json")
    LinkProfile(processes=4, **TRUE).save(path, link="1gbit", measurements=[])
    assert cgx.LinkProfile.load(path) == LinkProfile(processes=4, **TRUE)
    e = cgx.estimate(MLP, path, step_seconds=0.1)
    assert e.pays and "of a" in e.advice  # the saving as a share of the whole step
    with pytest.raises(TypeError, match=r"policies\['x'\] must be a cgx_jax.LayerPolicy"):
        cgx.estimate(MLP, path, policies={"x": cgx.Codec()})
    with pytest.raises(ValueError, match="at least one"):
        cgx.estimate(MLP, path, policies={})


@pytest.mark.starts_processes
def test_bench_link_writes_a_profile_across_processes(tmp_path):
    """Two processes on loopback, small sizes: a profile the link model loads, with the
    measurements it was fitted to, all costs non-negative."""
    out = str(tmp_path / "link_{link}.json")
    done = subprocess.run(
        [sys.executable, "-m", "cgx_jax.bench", "link", "--processes", "2", "--link", "none",
         "--sizes", "16K", "64K", "--repeats", "2", "--out", out, "--timeout", "240"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "link profile: 2 processes, link none" in done.stdout
    with open(out.format(link="none")) as f:
        saved = json.load(f)
    methods = {r["method"] for r in saved["measurements"]}
    assert {"psum f32", "cgx auto 2b", "cgx auto 4b", "cgx auto 8b"} <= methods
    profile = cgx.LinkProfile.load(out.format(link="none"))
    assert profile.processes == 2
    assert min(profile.exact_latency, profile.seconds_per_byte, profile.compressed_latency,
               profile.seconds_per_wire_byte, profile.seconds_per_value) >= 0
    assert profile.exact_latency + profile.seconds_per_byte > 0
