"""policy.py: LayerPolicy on real Flax parameter trees, Linen and NNX (docs/design.md section
7): the default keeps vectors and small matrices exact, exclude and overrides, an override
matching nothing lists the paths, hashing and validation; summary's table; and the default
policy inside compressed_psum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import run_sharded
from models import LinenBlock

import cgx_jax as cgx
from cgx_jax._src.policy import path_name


def linen_params():
    return LinenBlock().init(jax.random.key(0), jnp.ones((1, 64)))["params"]


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(64, 256, rngs=rngs)
        self.norm = nnx.LayerNorm(256, rngs=rngs)
        self.fc2 = nnx.Linear(256, 10, rngs=rngs)


def nnx_params():
    return nnx.state(NnxMLP(nnx.Rngs(0)), nnx.Param)


def resolved_paths(policy, tree):
    codecs = policy.resolve(tree)
    flat = jax.tree_util.tree_flatten_with_path(codecs, is_leaf=lambda c: c is None)[0]
    return {path_name(p): c for p, c in flat}


def test_linen_default_policy_keeps_vectors_and_small_matrices_exact():
    params = linen_params()
    codecs = resolved_paths(cgx.LayerPolicy(min_size=4096), params)
    assert codecs["qkv/kernel"] == cgx.Codec()  # 64 x 192 = 12288 values
    assert codecs["fc1/kernel"] == cgx.Codec() and codecs["fc2/kernel"] == cgx.Codec()
    assert codecs["proj/kernel"] == cgx.Codec()  # 64 x 64: exactly min_size is compressed
    assert codecs["head/kernel"] is None  # 640 values < min_size
    assert all(codecs[p] is None for p in codecs if p.endswith(("bias", "scale")))


def test_linen_exclude_and_overrides():
    params = linen_params()
    eight = cgx.Codec(bits=8, bucket_size=256)
    policy = cgx.LayerPolicy(min_size=0, exclude=(r"^qkv/",), overrides={r"head/kernel": eight,
                                                                          r"fc2/kernel": None})
    codecs = resolved_paths(policy, params)
    assert codecs["qkv/kernel"] is None
    assert codecs["head/kernel"] == eight
    assert codecs["fc2/kernel"] is None
    assert codecs["fc1/kernel"] == cgx.Codec()
    assert codecs["norm1/scale"] is None  # 1-D leaves stay exact at min_size=0 too


def test_nnx_state_paths():
    codecs = resolved_paths(cgx.LayerPolicy(min_size=4096), nnx_params())
    kernels = {p: c for p, c in codecs.items() if p.endswith("kernel")}
    assert set(kernels) == {"fc1/kernel", "fc2/kernel"}, codecs.keys()
    assert kernels["fc1/kernel"] == cgx.Codec() and kernels["fc2/kernel"] is None


def test_override_matching_nothing_lists_the_paths():
    policy = cgx.LayerPolicy(overrides={r"decoder/.*": cgx.Codec(bits=2)})
    with pytest.raises(ValueError,
                       match=r"override regex 'decoder/\.\*' matches no leaf.*fc1/kernel"):
        policy.resolve(linen_params())


def test_policy_is_hashable_and_validated():
    a = cgx.LayerPolicy(overrides={"x": cgx.Codec(bits=2)}, exclude=["bias"])
    b = cgx.LayerPolicy(overrides={"x": cgx.Codec(bits=2)}, exclude=("bias",))
    assert a == b and hash(a) == hash(b)
    with pytest.raises(ValueError, match="invalid regex '\\('"):
        cgx.LayerPolicy(exclude=("(",))
    with pytest.raises(TypeError, match="overrides\\['x'\\] must be a Codec or None"):
        cgx.LayerPolicy(overrides={"x": 4})
    with pytest.raises(ValueError, match="min_size must be a non-negative int"):
        cgx.LayerPolicy(min_size=-1)


def test_summary_table():
    params = linen_params()
    table = cgx.summary(cgx.LayerPolicy(min_size=4096), params)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["path", "shape", "codec"]
    qkv = next(line for line in lines if line.startswith("qkv/kernel"))
    assert "4 bit/128 stochastic" in qkv and str(cgx.wire_bytes(64 * 192, cgx.Codec())) in qkv
    total = lines[-1].split()
    f32 = sum(4 * x.size for x in jax.tree.leaves(params))
    assert total[0] == "total" and int(total[2]) == f32
    assert float(total[3].rstrip("x")) > 3.0  # most bytes are in compressed matrices


def test_default_policy_keeps_small_and_1d_leaves_exact():
    tree = {"kernel": jnp.ones((8, 256, 128)) * jnp.arange(128),
            "bias": jnp.ones((8, 128)) * jnp.arange(128) / 4}
    out = run_sharded(
        lambda t, k: cgx.compressed_psum(t, "batch", key=k), tree, 8, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out["bias"][0]),
                                  2.0 * np.arange(128, dtype=np.float32))
    assert not np.array_equal(np.asarray(out["kernel"][0]), np.asarray(tree["kernel"].sum(0)))


def test_rule_order_every_overlapping_pair():
    # docs/design.md section 7: non-floating -> overrides (first match) -> exclude ->
    # min_ndim/min_size -> default. Each pair of rules that can both match one leaf, with
    # the documented winner.
    c8, c2 = cgx.Codec(bits=8), cgx.Codec(bits=2)
    tree = {"head": {"kernel": jnp.zeros((256, 256)), "bias": jnp.zeros(256)},
            "steps": jnp.zeros((256, 256), jnp.int32),
            "body": {"kernel": jnp.zeros((256, 256)), "small": jnp.zeros((8, 8))}}
    policy = cgx.LayerPolicy(default=cgx.Codec(bits=4), exclude=("head", "body/kernel"),
                             overrides={"head/kernel": c8, "head": c2, "steps": c8})
    got = resolved_paths(policy, tree)
    assert got["head/kernel"] == c8        # override beats exclude, first override wins
    assert got["head/bias"] == c2          # override beats the 1-D rule and exclude
    assert got["steps"] is None            # non-floating beats an override
    assert got["body/kernel"] is None      # exclude beats the default
    assert got["body/small"] is None       # min_size beats the default
    small_override = cgx.LayerPolicy(overrides={"body/small": c8})
    assert resolved_paths(small_override, tree)["body/small"] == c8  # override beats min_size
    exclude_small = cgx.LayerPolicy(min_size=0, min_ndim=0, exclude=("body/small",))
    assert resolved_paths(exclude_small, tree)["body/small"] is None
