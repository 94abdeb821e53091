"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere; and the fixtures the
test modules share. Plain helpers are in helpers.py (meshes, codec comparisons, processes) and
models.py (the Flax model and training data)."""

import os
import shutil
import tempfile

# Most of the suite's time is XLA compiling small programs that then run for milliseconds, so
# the tests (and the processes they start, which inherit XLA_FLAGS) ask LLVM for less
# optimisation of the machine code: the same HLO, the same fusions and the same bits, compiled
# about 30% sooner. CGX_JAX_TEST_FULL_OPTIMIZATION=1 tests the code users' default flags give.
_FAST_COMPILE = ("" if os.environ.get("CGX_JAX_TEST_FULL_OPTIMIZATION") == "1" else
                 " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8" + _FAST_COMPILE
).strip()
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several test workers share a machine's one GPU: JAX's default of taking 75% of its
    # memory per process would leave the second worker none.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# One persistent compilation cache for the whole run, new and empty at its start (so a run
# times what a clean checkout takes): the test workers and the processes the tests start
# inherit it, and a program that several of them compile (the same training step in both
# ranks of a launch, or before and after a restart) is compiled once. Most of the suite's
# time is XLA compiling. The run's first process makes it and removes it at the end; set
# JAX_COMPILATION_CACHE_DIR to keep one between runs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
        prefix="cgx_jax_tests_xla_cache_")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
else:
    _OWN_CACHE = None

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests that start processes (``starts_processes``: launches, benchmarks, builds) run
    first: each takes seconds to tens of seconds, and run last they leave one test worker
    busy while the other has nothing left to do."""
    items.sort(key=lambda item: item.get_closest_marker("starts_processes") is None)


def pytest_unconfigure(config):
    if _OWN_CACHE and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


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
