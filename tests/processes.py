"""Helpers of the tests that start real processes (``python -m cgx_jax.launch`` running
tests/multiprocess_worker.py) and build network namespaces (root only; docs/design.md
section 9). Kept apart from helpers.py so only these tests probe for namespaces."""

import os
import subprocess
import sys
import time

import jax
import multiprocess_worker as worker
import numpy as np
import pytest

from cgx_jax._src import netem

# ---------------------------------------------------------------------------
# Real processes: python -m cgx_jax.launch running multiprocess_worker.py
# ---------------------------------------------------------------------------


def launcher_env() -> dict:
    """The environment for a command that starts its processes through cgx's launcher (``python
    -m cgx_jax.launch``, the benchmarks): this one's, ``XLA_FLAGS`` included, since the launcher
    replaces the device count in it with each process's own and keeps the rest (the suite's
    compile flags, tests/conftest.py)."""
    return dict(os.environ)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(TESTS_DIR, "multiprocess_worker.py")


def launch_worker(num_processes, devices_per_process, out_dir, mode, timeout=120, extra=()):
    """Runs multiprocess_worker.py in MODE under ``python -m cgx_jax.launch``; returns the
    completed process and the seconds it took."""
    command = [sys.executable, "-m", "cgx_jax.launch", "-n", str(num_processes),
               "--devices-per-process", str(devices_per_process), "--timeout", str(timeout - 10),
               "--grace", "2", *extra, "--", sys.executable, WORKER, str(out_dir), mode]
    env = launcher_env()
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return done, time.monotonic() - start


def gather_results(out_dir, num_processes):
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


# ---------------------------------------------------------------------------
# Network namespaces (root only)
# ---------------------------------------------------------------------------

needs_netns = pytest.mark.skipif(not netem.can_shape()[0],
                                 reason=f"network namespaces unavailable: {netem.can_shape()[1]}")

# Every test that builds network namespaces names its own prefix and subnet (none of them a
# benchmark's or the launcher's default), so tests that the xdist workers run side by side,
# and a benchmark running meanwhile, never share one.
