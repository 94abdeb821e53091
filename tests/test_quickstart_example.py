"""examples/quickstart.py: the plain JAX step and its one-line cgx port train the same MLP on
the same batches on the simulated CPU devices conftest.py sets up."""

import math

import jax
from helpers import load_script

import cgx_jax as cgx


def test_the_quickstart_trains_with_compressed_gradients_as_the_plain_step(capsys):
    quickstart = load_script("examples/quickstart.py", "quickstart_example")
    result = quickstart.main(["--steps", "40", "--batch", "64"])
    exact, compressed = result["losses"]["exact"], result["losses"]["cgx"]
    assert len(exact) == len(compressed) == 40
    # The same initial parameters and first batch: the per-participant mean of the loss is
    # the global one, up to the order of the sums.
    assert math.isclose(exact[0], compressed[0], rel_tol=1e-5)
    assert exact[-1] < 0.9 * exact[0] and compressed[-1] < 0.9 * compressed[0]  # both learn
    assert abs(compressed[-1] / exact[-1] - 1) < 0.03, (compressed[-1], exact[-1])
    params = quickstart.init(jax.random.key(0))
    assert result["wire_bytes"] == cgx.tree_wire_bytes(cgx.LayerPolicy(), params)
    assert result["f32_bytes"] == 4 * sum(p.size for p in jax.tree.leaves(params))
    assert result["wire_bytes"] < result["f32_bytes"] / 5  # two of three kernels compressed
    printed = capsys.readouterr().out
    assert "1/w    (512, 512)  4 bit/128 stochastic" in printed and "exact  loss" in printed
