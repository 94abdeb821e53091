"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere; and the fixtures the
test modules share. Plain helpers are in helpers.py (meshes, codec comparisons, processes) and
models.py (the Flax model and training data)."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several test workers share a machine's one GPU: JAX's default of taking 75% of its
    # memory per process would leave the second worker none.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests that start processes (``starts_processes``: launches, benchmarks, builds) run
    first: each takes seconds to tens of seconds, and run last they leave one test worker
    busy while the other has nothing left to do."""
    items.sort(key=lambda item: item.get_closest_marker("starts_processes") is None)


@pytest.fixture(scope="session")
def cpu_devices():
    devices = jax.devices("cpu")
    assert len(devices) >= 8, "tests need XLA_FLAGS=--xla_force_host_platform_device_count=8"
    return devices


@pytest.fixture
def cpu_default_device():
    """Runs the test with the CPU device as JAX's default device, also on a machine with a GPU
    (the kernel tests compare CPU kernels with the numpy model)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield
