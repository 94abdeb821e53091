"""Smoke test of examples/vit/train.py: a tiny ViT for a few steps, baseline and 4-bit CGX, on
the 8 simulated CPU devices that conftest.py sets up; the CIFAR-10 reader on fake batches; and
a run across two processes that a killed rank interrupts, restarted by the launcher and
resumed from its checkpoints bit for bit."""

import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers import load_script
from processes import launcher_env

EXAMPLE_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "vit")


def load_example(name):
    return load_script(f"examples/vit/{name}.py", f"vit_example_{name}")


def test_train_tiny_in_the_data_parallel_and_fsdp_modes(tmp_path):
    """--mode baseline cgx fsdp-exact fsdp in one run: every metric of every mode. cgx
    sends fewer bytes than the baseline. --mode fsdp-exact (the parameters and Adam state
    split by rows over the devices, gathered by lax.all_gather) has the baseline's losses
    (the same sums, up to float reassociation); --mode fsdp (gathered 8-bit, gradients
    4-bit) is close to them, with fewer bytes."""
    train = load_example("train")
    out = tmp_path / "metrics.json"
    modes = ["baseline", "cgx", "fsdp-exact", "fsdp"]
    metrics = train.main(["--tiny", "--steps", "6", "--mode", *modes, "--quiet", "--json",
                          str(out)])
    assert json.loads(out.read_text())["modes"] == modes
    assert metrics["devices"] >= 1 and metrics["parameters"] > 0
    runs = {r["mode"]: r for r in metrics["runs"]}
    assert set(runs) == set(modes) == set(metrics["summary"])
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
    np.testing.assert_allclose(runs["fsdp-exact"]["loss_history"],
                               runs["baseline"]["loss_history"], rtol=1e-5)
    np.testing.assert_allclose(runs["fsdp"]["loss_history"],
                               runs["baseline"]["loss_history"], rtol=0.05)
    assert runs["fsdp-exact"]["bytes_per_step"] == 2 * runs["baseline"]["bytes_per_step"]
    assert runs["fsdp"]["bytes_per_step"] < runs["fsdp-exact"]["bytes_per_step"] / 2


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


# ---------------------------------------------------------------------------
# Checkpoints and restarts across processes (python -m cgx_jax.launch --max-restarts)
# ---------------------------------------------------------------------------

TRAIN = os.path.join(EXAMPLE_DIR, "train.py")
RESTART_STEPS, CHECKPOINT_EVERY = 45, 15


def _launch_training(checkpoints):
    env = launcher_env()
    command = [sys.executable, "-m", "cgx_jax.launch", "-n", "2", "--devices-per-process", "2",
               "--timeout", "300", "--max-restarts", "1", "--",
               sys.executable, TRAIN, "--tiny", "--steps", str(RESTART_STEPS), "--mode", "cgx",
               "--error-feedback", "--shift", "1", "--quiet",
               "--checkpoint-every", str(CHECKPOINT_EVERY), "--checkpoint-dir", str(checkpoints)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _rank_pid(marker: str, rank: int) -> int | None:
    """The pid of the launched process of ``rank`` in its first attempt whose command line
    holds ``marker`` (this test's checkpoint folder: other tests may launch meanwhile)."""
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except (OSError, ValueError):
            continue
        if (env.get(b"CGX_JAX_PROCESS_ID") == str(rank).encode()
                and env.get(b"CGX_JAX_RESTART_COUNT") == b"0"):
            return int(name)
    return None


def read_checkpoint(folder):
    """An Orbax checkpoint folder of the example as numpy: {leaf path: array} of its state
    (every array whole, whatever devices wrote it) and its host state."""
    import jax
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(folder / "state").item_metadata.tree
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state = checkpointer.restore(folder / "state", args=ocp.args.PyTreeRestore(
        restore_args=jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=one_device), tree)))
    with open(folder / "host" / "metadata") as f:
        host = json.load(f)
    return {jax.tree_util.keystr(path): np.asarray(v)
            for path, v in jax.tree_util.tree_leaves_with_path(state)}, host


def assert_bitwise_equal(got, expected):
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert value.dtype == got[key].dtype, key
        assert value.shape == got[key].shape, key
        assert value.tobytes() == got[key].tobytes(), key


def _finished_steps(folder) -> list[int]:
    """The steps of the checkpoints Orbax has finished in ``folder`` (it writes each into a
    temporary folder and renames it once every process is done)."""
    return sorted(int(p.name[5:]) for p in folder.glob("step_*") if p.name[5:].isdigit())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.starts_processes
def test_a_killed_rank_restarts_and_resumes_bit_for_bit(tmp_path):
    """Two processes of two devices train with 4-bit error feedback under --max-restarts 1,
    checkpointing every CHECKPOINT_EVERY steps. Once the second checkpoint exists both ranks
    are frozen (SIGSTOP), the newest checkpoint is moved aside as the reference, and rank 1 is
    killed (SIGKILL). Both ranks start again, resume from the checkpoint before it, and
    write that step again: bitwise the reference that the uninterrupted ranks wrote
    (parameters, optimizer state with every device's residual and the noise key, the data's
    place, the augmentation's generator (--shift 1) and the loss history)."""
    checkpoints = tmp_path / "run"
    launched = _launch_training(checkpoints)
    try:
        deadline = time.monotonic() + 240
        while 2 * CHECKPOINT_EVERY not in _finished_steps(checkpoints):
            assert launched.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        pids = [_rank_pid(str(checkpoints), rank) for rank in (0, 1)]
        assert None not in pids
        for pid in pids:  # frozen, so no checkpoint appears after the one set aside
            os.kill(pid, signal.SIGSTOP)
        newest = _finished_steps(checkpoints)[-1]
        assert CHECKPOINT_EVERY < newest < RESTART_STEPS
        reference = tmp_path / "reference"
        shutil.move(checkpoints / f"step_{newest:08d}", reference)
        os.kill(pids[1], signal.SIGKILL)
        os.kill(pids[0], signal.SIGCONT)  # blocked on its dead peer until the launcher stops it
        out, err = launched.communicate(timeout=300)
    finally:
        launched.kill()
    assert launched.returncode == 0, err[-3000:]
    assert "rank 1 failed with signal SIGKILL" in err, err[-3000:]
    assert "restarting all 2 processes (restart 1 of 1)" in err
    resumed = {int(s) for s in re.findall(r"resumed from the checkpoint of step (\d+)", out)}
    assert resumed == {newest - CHECKPOINT_EVERY}, out[-3000:]
    assert out.count("(restart 1)") == 2  # both ranks resumed

    (expected, expected_host), (got, got_host) = (
        read_checkpoint(reference), read_checkpoint(checkpoints / f"step_{newest:08d}"))
    residuals = [k for k in expected if "['residual']" in k]
    assert residuals and all(expected[k].shape[0] == 4 for k in residuals)  # one per device
    assert any(not np.array_equal(expected[k][0], expected[k][3]) for k in residuals)
    assert "[1][0]['rng_key']" in expected  # the noise key
    assert_bitwise_equal(got, expected)
    assert got_host == expected_host and len(got_host["losses"]) == newest
    assert RESTART_STEPS in _finished_steps(checkpoints)  # and it trained to the end


def test_an_fsdp_run_resumes_from_its_orbax_checkpoint_bit_for_bit(tmp_path, capsys):
    """--mode fsdp (cgx.value_and_grad on row-sharded parameters) checkpointing every 3
    steps: a run that finds only the checkpoint of step 3 resumes from it and ends bitwise
    where the whole run ended: parameters, Adam state and losses. Its checkpoint holds the
    split leaves and their Adam state sharded by rows over the devices, the others
    replicated."""
    import orbax.checkpoint as ocp

    train = load_example("train")
    argv = ["--tiny", "--steps", "6", "--mode", "fsdp", "--quiet", "--checkpoint-every", "3",
            "--checkpoint-dir"]
    train.main(argv + [str(tmp_path / "whole")])
    shutil.copytree(tmp_path / "whole" / "step_00000003", tmp_path / "resumed" / "step_00000003")
    train.main(argv + [str(tmp_path / "resumed")])
    assert "resumed from the checkpoint of step 3" in capsys.readouterr().out

    final = "step_00000006"
    (expected, expected_host), (got, got_host) = (read_checkpoint(tmp_path / "whole" / final),
                                                  read_checkpoint(tmp_path / "resumed" / final))
    assert_bitwise_equal(got, expected)
    assert got_host == expected_host and len(got_host["losses"]) == 6

    tree = ocp.PyTreeCheckpointer().metadata(tmp_path / "resumed" / final / "state")
    specs = {jax.tree_util.keystr(path): tuple(leaf.sharding.partition_spec)
             for path, leaf in jax.tree_util.tree_leaves_with_path(tree.item_metadata.tree)}
    fc1 = "['blocks']['0']['mlp']['fc1']['kernel']['value']"
    assert specs["[0]" + fc1] == ("batch",)  # 32 rows over 8 devices
    assert specs["[1][1][0]['mu']" + fc1] == specs["[1][1][0]['nu']" + fc1] == ("batch",)
    assert specs["[0]['head']['fc2']['bias']['value']"] == ()  # 10 values: replicated
