"""examples/cookbook.py: a Training-Cookbook-style step (explicit mesh axes, FSDP kernels,
annotated activations, hand-written Adam) ported to cgx in three marked lines, checked against
the original step (jax.value_and_grad) on the simulated CPU devices conftest.py sets up."""

import math
import os

import jax
import jax.numpy as jnp
from helpers import load_script
from jax.sharding import PartitionSpec as P

import cgx_jax as cgx
from cgx_jax.bench import text_lm

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "cookbook.py")


def load_example():
    return load_script("examples/cookbook.py", "cookbook_example")


def test_one_cgx_step_is_the_original_step_compressed(cpu_devices):
    """The same parameters, batch and Adam state: the cgx step's gradients keep every
    parameter's layout, type and structure, and are the original's within the 4-bit error;
    only u8 crosses the devices in any large collective; the updated parameters stay where
    the original puts them."""
    cookbook = load_example()
    mesh = jax.make_mesh((8,), ("fsdp",), devices=cpu_devices[:8])
    with jax.set_mesh(mesh):
        params = cookbook.init(jax.random.key(0), 128, 1, 32, cookbook.Specs())
        opt_state = jax.tree.map(jnp.zeros_like, (params, params))
        corpus = text_lm.corpus(max_train_bytes=200_000)
        windows = jax.device_put(text_lm.train_batch(corpus.train, 0, 16, 32, 0), P("fsdp"))
        out = {}
        for use_cgx in (False, True):
            step = cookbook.make_step(use_cgx, heads=2, lr=1e-3)
            hlo = step.lower(params, opt_state, windows, jnp.int32(0)).compile().as_text()
            out[use_cgx] = step(params, opt_state, windows, jnp.int32(0)), hlo
    (new_exact, _, loss_exact, exact), hlo_exact = out[False]
    (new_cgx, _, loss_cgx, grads), hlo_cgx = out[True]
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert abs(float(loss_cgx) - float(loss_exact)) < 0.01 * float(loss_exact)  # 8-bit weights
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, p), g, e, n in zip(flat, jax.tree.leaves(grads), jax.tree.leaves(exact),
                                  jax.tree.leaves(new_cgx)):
        name = jax.tree_util.keystr(path)
        assert g.dtype == e.dtype == p.dtype and g.shape == p.shape, name
        assert g.sharding.spec == e.sharding.spec == p.sharding.spec, name
        assert n.sharding.spec == p.sharding.spec, name
        error = float(jnp.linalg.norm(g - e) / jnp.linalg.norm(e))
        # One draw of 4-bit noise on a small batch; the embedding's gradient is mostly zero
        # rows (bytes the batch lacks), which decode nonzero (docs/performance.md).
        assert error < (1.0 if name == "['embed']" else 0.5), (name, error)
        assert error > 0 or p.ndim == 1, name  # compressed matrices differ; vectors go exact
    kernels = [p.size for p in jax.tree.leaves(params) if p.sharding.spec == P("fsdp", None)]
    assert len(kernels) == 5  # qkv, proj, up, down, out: FSDP
    # Larger than any f32 leaf the default policy keeps exact (the norms; the position
    # table of this short context has 4,096 values).
    large = 4 * cgx.LayerPolicy().min_size
    for hlo, want in ((hlo_exact, {"f32"}), (hlo_cgx, {"u8"})):
        found = cookbook.collectives(hlo)
        assert {dtype for _, dtype, size in found if size > large} == want, found
    assert cookbook.collective_bytes(hlo_cgx).get("u8", 0) > 0


def test_the_port_is_three_marked_lines_and_both_modes_learn():
    cookbook = load_example()
    with open(EXAMPLE) as f:
        assert sum(line.rstrip().endswith("# cgx") for line in f) == 3
    results = cookbook.main(["--steps", "10", "--batch", "16", "--length", "32", "--depth", "1",
                             "--heads", "2", "--eval-windows", "32"])
    assert set(results) == {"exact", "cgx"}
    for mode, r in results.items():
        assert math.isfinite(r["loss"]) and r["loss"] < math.log(256), (mode, r)  # it learns
        assert r["layouts"] and r["ms"] > 0, (mode, r)
    assert abs(results["cgx"]["loss"] / results["exact"]["loss"] - 1) < 0.03, results
