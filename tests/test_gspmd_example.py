"""Smoke test of examples/gspmd_nnx.py: the Flax GSPMD-guide model trained with nnx.jit and
nnx.Optimizer, exact and through cgx.value_and_grad (with and without error feedback), on
a 2x4 (data x model) mesh of the simulated CPU devices conftest.py sets up."""

import math

from helpers import load_script


def load_example():
    return load_script("examples/gspmd_nnx.py", "gspmd_nnx_example")


def test_exact_and_cgx_train_alike_on_a_data_and_model_mesh():
    """2x4: data-parallel over 2 participants, the weights sharded over 4 model devices (the
    8x1 mesh is the plain data-parallel case tests/test_data_parallel.py covers)."""
    # width 128: the stacked (2, 128, 128) kernels are compressed by the default policy.
    results = load_example().main(["--steps", "8", "--width", "128", "--batch", "32",
                                   "--meshes", "2x4"])
    assert [(r["mesh"], r["mode"]) for r in results] == [
        ("2x4", mode) for mode in ("exact", "cgx", "cgx-ef")]
    exact = next(r["test_loss"] for r in results if r["mode"] == "exact")
    for r in results:
        assert math.isfinite(r["test_loss"]) and r["ms"] > 0
        assert r["test_loss"] < 0.95  # it learns: the teacher's targets have unit variance
        if r["mode"] != "exact":  # compressed, so not identical, but nearly as good (4 bits
            assert r["test_loss"] != exact  # add about 1% after 8 steps)
            assert abs(r["test_loss"] - exact) < 0.03 * exact, r
