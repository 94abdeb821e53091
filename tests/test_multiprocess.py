"""compressed_psum across real processes (``python -m cgx_jax.launch``, jax.distributed on
127.0.0.1, CPU collectives through Gloo) equals the single-process result on simulated
devices bitwise, for every algorithm; a failing process stops the launch quickly."""

import io
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import multiprocess_worker as worker
from cgx_jax import launch as launcher
from cgx_jax import netem

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "multiprocess_worker.py")


def launch(num_processes, devices_per_process, out_dir, mode, timeout=120, extra=()):
    command = [sys.executable, "-m", "cgx_jax.launch", "-n", str(num_processes),
               "--devices-per-process", str(devices_per_process), "--timeout", str(timeout - 10),
               "--grace", "2", *extra, "--", sys.executable, WORKER, str(out_dir), mode]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the launcher sets the device count of each process
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return done, time.monotonic() - start


def gather(out_dir, num_processes):
    """{name: [devices, ...]} merged from every rank's own rows; each row written once."""
    merged, owners = {}, {}
    for rank in range(num_processes):
        with np.load(os.path.join(out_dir, f"rank{rank}.npz")) as data:
            for name in data.files:
                if name.endswith("_mask"):
                    continue
                rows, mine = data[name], data[f"{name}_mask"]
                if name not in merged:
                    merged[name] = np.full_like(rows, np.nan)
                    owners[name] = np.zeros(len(mine), int)
                merged[name][mine] = rows[mine]
                owners[name] += mine
    for name, count in owners.items():
        assert np.all(count == 1), (name, count)
    return merged


def single_process(num_devices, hierarchical_outer=None):
    devices = jax.devices("cpu")[:num_devices]
    results = dict(worker.compute(worker.flat_mesh(devices), False))
    if hierarchical_outer:
        results.update(worker.compute(worker.hier_mesh(devices, hierarchical_outer), True))
    return {name: np.asarray(value, np.float32) for name, value in results.items()}


def assert_bitwise_equal(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        np.testing.assert_array_equal(got[name].view(np.uint32), want[name].view(np.uint32),
                                      err_msg=name)
        for row in got[name][1:]:  # replicas identical within the multi-process run too
            np.testing.assert_array_equal(row.view(np.uint32), got[name][0].view(np.uint32))


@pytest.mark.parametrize("num_processes, devices_per_process", [(2, 1), (4, 1), (2, 2)],
                         ids=["2x1", "4x1", "2x2"])
def test_processes_match_single_process_bitwise(tmp_path, num_processes, devices_per_process):
    hierarchical = devices_per_process > 1
    done, _ = launch(num_processes, devices_per_process, tmp_path,
                     "hier" if hierarchical else "flat")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in range(num_processes):
        assert f"[rank {rank}] process {rank}: wrote" in done.stdout
    got = gather(tmp_path, num_processes)
    want = single_process(num_processes * devices_per_process,
                          num_processes if hierarchical else None)
    expected = {"sra", "allgather", "ring", "tree_half", "tree_count"}
    if hierarchical:
        expected |= {"hier_sra", "hier_allgather", "hier_ring"}
    assert set(want) == expected
    assert_bitwise_equal(got, want)
    # Compression did something, and the algorithms differ from each other.
    x = worker.inputs(num_processes * devices_per_process)[0]
    assert np.max(np.abs(got["sra"][0] - x.sum(0))) > 0
    assert not np.array_equal(got["sra"], got["ring"])


def test_hierarchical_large_pieces_across_processes(tmp_path):
    """Regression: XLA:CPU's multi-process reduce-scatter returns wrong values for multi-MiB
    pieces in some calls (jax-ml/jax#40830); the hierarchical reduction must not use it there.
    Every row of every call equals the single-process result bitwise."""
    done, _ = launch(2, 2, tmp_path, "hier_large", timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = {}
    for rank in range(2):
        with open(os.path.join(tmp_path, f"rank{rank}.json")) as f:
            for call, rows in json.load(f).items():
                got.setdefault(call, {}).update(rows)
    want = worker.compute_large(worker.hier_mesh(jax.devices("cpu")[:4], 2))
    assert len(want) == worker.LARGE_CALLS and all(len(rows) == 4 for rows in want.values())
    assert got == want


def test_failing_process_stops_the_launch(tmp_path):
    done, seconds = launch(2, 1, tmp_path, "fail", timeout=60)
    assert done.returncode != 0
    assert "rank 1 failed with exit code 1" in done.stderr, done.stderr[-3000:]
    assert "[rank 1] RuntimeError: rank 1 fails on purpose" in done.stderr
    # Stopped at once: without the launcher's exit-on-exception hook rank 1 waits in JAX's
    # shutdown barrier and the launch ends only after a 30 s coordination timeout.
    assert seconds < 25, seconds


def test_launcher_environment_prefix_and_timeout():
    script = ('echo "id=$CGX_JAX_PROCESS_ID n=$CGX_JAX_NUM_PROCESSES at=$CGX_JAX_COORDINATOR '
              'flags=$XLA_FLAGS"; echo oops >&2; '
              'if [ "$CGX_JAX_PROCESS_ID" = 1 ]; then trap "" TERM; sleep 30; fi')
    command = [sys.executable, "-m", "cgx_jax.launch", "-n", "3", "--devices-per-process", "2",
               "--timeout", "2", "--grace", "0.5", "--", "bash", "-c", script]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert done.returncode == 124
    assert time.monotonic() - start < 15  # SIGKILL after the grace period, not sleep 30
    for rank in range(3):
        assert (f"[rank {rank}] id={rank} n=3 at=127.0.0.1:" in done.stdout
                and "--xla_force_host_platform_device_count=2" in done.stdout)
        assert f"[rank {rank}] oops" in done.stderr
    assert "timed out after 2 s; ranks still running: [1]" in done.stderr


# ---------------------------------------------------------------------------------- --link
NETNS_PREFIX = "cgxtl"  # not the launcher's default, so a launch running meanwhile is safe
LINK_ARGS = ("--link", "1gbit", "--netns-prefix", NETNS_PREFIX, "--subnet", "10.213.78")
needs_netns = pytest.mark.skipif(not netem.can_shape()[0],
                                 reason=f"network namespaces unavailable: {netem.can_shape()[1]}")


def link_namespaces():
    return netem.namespaces(NETNS_PREFIX)


@needs_netns
def test_link_runs_each_process_in_its_namespace_bitwise(tmp_path):
    assert not link_namespaces(), f"stale namespaces: {link_namespaces()}"
    done, _ = launch(2, 1, tmp_path, "flat", extra=LINK_ARGS)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"network namespaces {NETNS_PREFIX}0.., 1gbit links; coordinator 10.213.78.1:" in (
        done.stderr)
    assert_bitwise_equal(gather(tmp_path, 2), single_process(2))
    assert not link_namespaces()


@needs_netns
def test_link_process_sees_its_own_address():
    done = subprocess.run(
        [sys.executable, "-m", "cgx_jax.launch", "-n", "2", *LINK_ARGS, "--",
         "sh", "-c", "getent hosts $(hostname)"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for rank in range(2):  # Gloo binds to what the host name resolves to
        assert f"[rank {rank}] 10.213.78.{rank + 1} " in done.stdout
    assert not link_namespaces()


@needs_netns
def test_link_sigterm_stops_processes_and_removes_network():
    process = subprocess.Popen(
        [sys.executable, "-m", "cgx_jax.launch", "-n", "2", "--grace", "1", *LINK_ARGS, "--",
         "sleep", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(link_namespaces()) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(link_namespaces()) == 3  # two ranks and the hub
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert "interrupted; stopping all processes" in stderr
    assert not link_namespaces()


def test_link_without_namespaces_runs_unshaped_and_says_so(monkeypatch):
    monkeypatch.setattr(netem, "can_shape", lambda: (False, "not root"))
    out, err = io.StringIO(), io.StringIO()
    code = launcher.launch([sys.executable, "-c", "print('hi')"], 2, link="1gbit",
                           stdout=out, stderr=err)
    assert code == 0
    assert "cannot emulate a 1gbit link (not root); running UNSHAPED on loopback" in (
        err.getvalue())
    assert "[rank 0] hi" in out.getvalue() and "[rank 1] hi" in out.getvalue()


@pytest.mark.parametrize("args, message", [
    (["--link", "fast"], "link rate must look like 1gbit"),
    (["--link", "1gbit", "--netns-prefix", "a b"], "--netns-prefix must be a letter"),
    (["--link", "1gbit", "--subnet", "10.1"], "--subnet must be three octets"),
])
def test_link_bad_arguments(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        launcher.main(["-n", "2", *args, "--", "true"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
