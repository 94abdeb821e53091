"""Smoke test of examples/vit/train.py: a tiny ViT for a few steps, baseline and 4-bit CGX, on
the 8 simulated CPU devices that conftest.py sets up; and the CIFAR-10 reader on fake batches."""

import importlib.util
import json
import math
import os
import pickle
import sys

import numpy as np
import pytest

EXAMPLE_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "vit")


def load_example(name):
    path = os.path.join(EXAMPLE_DIR, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"vit_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_train_tiny_baseline_and_cgx(tmp_path):
    train = load_example("train")
    out = tmp_path / "metrics.json"
    metrics = train.main(["--tiny", "--steps", "6", "--mode", "baseline", "cgx",
                          "--quiet", "--json", str(out)])
    assert json.loads(out.read_text())["modes"] == ["baseline", "cgx"]
    assert metrics["devices"] >= 1 and metrics["parameters"] > 0
    runs = {r["mode"]: r for r in metrics["runs"]}
    assert set(runs) == {"baseline", "cgx"}
    keys = {"test_accuracy", "test_loss", "final_loss", "step_time_s", "bytes_per_step",
            "f32_bytes_per_step", "compression_vs_f32", "layer_bits", "loss_history",
            "eval_history", "steps", "seed", "policy"}
    for run in runs.values():
        assert keys <= set(run), keys - set(run)
        assert run["steps"] == 6 and len(run["loss_history"]) == 6
        assert all(math.isfinite(x) for x in run["loss_history"])
        assert math.isfinite(run["final_loss"]) and math.isfinite(run["test_loss"])
        assert 0.0 <= run["test_accuracy"] <= 1.0
    assert runs["baseline"]["compression_vs_f32"] == 1.0
    assert runs["cgx"]["compression_vs_f32"] > 1.0
    assert runs["cgx"]["bytes_per_step"] < runs["baseline"]["bytes_per_step"]
    assert min(runs["cgx"]["layer_bits"].values()) == 4
    assert set(metrics["summary"]) == {"baseline", "cgx"}


def test_cifar10_reader(tmp_path):
    data = load_example("data")
    with pytest.raises(SystemExit, match="data_batch_1.*test_batch"):
        data.load("cifar10", str(tmp_path))
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in data.CIFAR10_FILES:
        batch = {b"data": rng.integers(0, 256, (6, 3072), dtype=np.uint8),
                 b"labels": list(rng.integers(0, 10, 6))}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    ds = data.load("cifar10", str(tmp_path))  # finds the cifar-10-batches-py subfolder
    assert ds.x_train.shape == (30, 32, 32, 3) and ds.x_test.shape == (6, 32, 32, 3)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
    np.testing.assert_allclose(ds.x_train.mean(axis=(0, 1, 2)), 0.0, atol=1e-4)


def test_adaptive_mode_refits_the_policy_once(monkeypatch):
    train = load_example("train")
    calls = []

    def fake_fit_policy(grads, *, budget_bits, bucket_size, base, **kwargs):
        calls.append(grads)
        return train.cgx.LayerPolicy(default=train.cgx.Codec(8, bucket_size),
                                     min_size=base.min_size)

    monkeypatch.setattr(train.cgx, "fit_policy", fake_fit_policy, raising=False)
    metrics = train.main(["--tiny", "--steps", "4", "--adapt-after", "2", "--mode", "adaptive",
                          "--quiet"])
    (run,) = metrics["runs"]
    assert len(calls) == 1 and run["adapted_at_step"] == 2
    assert max(b for b in run["layer_bits"].values() if b < 32) == 8
    assert all(math.isfinite(x) for x in run["loss_history"])
