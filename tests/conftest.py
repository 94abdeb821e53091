"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402


def cpu_mesh(num_devices: int, axis_names=("batch",)) -> Mesh:
    """A mesh over the first ``num_devices`` CPU devices (on a GPU machine too)."""
    devices = np.array(jax.devices("cpu")[:num_devices])
    shape = (num_devices,) if len(axis_names) == 1 else (2, num_devices // 2)
    return Mesh(devices.reshape(shape), axis_names)


@pytest.fixture(scope="session")
def cpu_devices():
    devices = jax.devices("cpu")
    assert len(devices) >= 8, "tests need XLA_FLAGS=--xla_force_host_platform_device_count=8"
    return devices
