"""The compiled modules against the running jaxlib's XLA FFI API version (docs/design.md
section 3): a module built for a newer API than the running jaxlib's gets a clear error on
first use, naming both versions and the fix, instead of XLA's INVALID_ARGUMENT."""

import re
import types

import jaxlib
import pytest

from cgx_jax import _cgx_cpu
from cgx_jax._src.backends import ffi

# FFI API versions of released jaxlibs, read from the c_api.h each wheel ships.
KNOWN = {"0.7.0": (0, 1), "0.7.2": (0, 1), "0.9.0": (0, 2), "0.10.2": (0, 3)}


def test_the_running_version_is_read_from_jaxlibs_headers():
    running = ffi.running_ffi_api_version()
    assert running is not None and running[0] == 0 and running[1] >= 1
    if jaxlib.__version__ in KNOWN:
        assert running == KNOWN[jaxlib.__version__]


def test_the_installed_module_runs_on_the_running_jaxlib():
    built = tuple(_cgx_cpu.ffi_api_version())
    assert built <= ffi.running_ffi_api_version(), built
    ffi.check_ffi_api_version(_cgx_cpu)  # no error


@pytest.mark.parametrize("running", [(0, 0), (0, 1), (0, 2)])
def test_a_module_newer_than_jaxlib_is_refused_by_name(monkeypatch, running):
    module = types.SimpleNamespace(__name__="cgx_jax._cgx_cpu", ffi_api_version=lambda: (0, 2))
    monkeypatch.setattr(ffi, "running_ffi_api_version", lambda: running)
    if running >= (0, 2):
        ffi.check_ffi_api_version(module)
        return
    message = (rf"cgx_jax._cgx_cpu was built against XLA FFI API 0\.2, but the running "
               rf"jaxlib {re.escape(jaxlib.__version__)} has API 0\.{running[1]}.*"
               rf"pip install -U jax jaxlib.*--no-build-isolation")
    with pytest.raises(RuntimeError, match=message):
        ffi.check_ffi_api_version(module)


def assert_registration_refused(monkeypatch, message):
    """Registering anew (with the monkeypatched versions) raises ``message``; the real
    registration is restored after."""
    ffi._register.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=message):
            ffi._register()
    finally:
        monkeypatch.undo()
        ffi._register.cache_clear()
        ffi._register()


def test_registration_checks_the_version_first(monkeypatch):
    monkeypatch.setattr(ffi, "running_ffi_api_version", lambda: (0, 0))
    assert_registration_refused(monkeypatch, "built against XLA FFI API")


def test_unreadable_headers_skip_the_check(monkeypatch, tmp_path):
    monkeypatch.setattr(ffi.jax.ffi, "include_dir", lambda: str(tmp_path))
    assert ffi.running_ffi_api_version() is None
    ffi.check_ffi_api_version(_cgx_cpu)


# The CUDA module against JAX's CUDA plugin and the driver (docs/install.md, "The CUDA module").
def _cuda_module(runtime, driver):
    return types.SimpleNamespace(__name__="cgx_jax._cgx_cuda", ffi_api_version=lambda: (0, 1),
                                 cuda_versions=lambda: (runtime, driver),
                                 registrations=lambda: {})


@pytest.mark.parametrize("runtime, driver, jax_runtime, refused", [
    (13000, 13000, 13020, None),             # same major as JAX's plugin, driver new enough
    (12080, 13000, 12030, None),             # an older minor than JAX's: the same major
    (13000, 0, None, None),                  # no driver and no plugin (a CPU machine)
    (13000, 13000, 12080, "but JAX runs CUDA 12.8"),
    (12080, 12080, 13000, "but JAX runs CUDA 13.0"),
    (13000, 12080, None, "but the installed NVIDIA driver supports CUDA 12.8 at most"),
])
def test_the_cuda_module_is_checked_against_jax_and_the_driver(monkeypatch, runtime, driver,
                                                               jax_runtime, refused):
    from cgx_jax._src.collectives import jax_compat
    monkeypatch.setattr(jax_compat, "jax_cuda_runtime_version", lambda: jax_runtime)
    module = _cuda_module(runtime, driver)
    if refused is None:
        ffi.check_cuda_versions(module)
        return
    built = f"{runtime // 1000}.{runtime % 1000 // 10}"
    with pytest.raises(RuntimeError, match=(
            rf"CUDA module was built with CUDA {re.escape(built)}, {refused}.*"
            rf"jax\[cuda{runtime // 1000}\].*CGX_JAX_CUDA=ON.*backend='jax'")):
        ffi.check_cuda_versions(module)


def test_registration_on_a_gpu_refuses_a_cuda_module_of_another_major(monkeypatch):
    from cgx_jax._src.collectives import jax_compat
    monkeypatch.setattr(jax_compat, "jax_cuda_runtime_version", lambda: 12080)
    monkeypatch.setattr(ffi, "_jax_has_gpu", lambda: True)
    monkeypatch.setattr(ffi, "_import_cuda_module", lambda: _cuda_module(13000, 13000))
    assert_registration_refused(monkeypatch, "built with CUDA 13.0, but JAX runs CUDA 12.8")


@pytest.mark.skipif(not ffi.has_cuda_support(), reason="this build has no CUDA module")
def test_the_built_cuda_module_reports_its_versions():
    from cgx_jax import _cgx_cuda
    runtime, driver = _cgx_cuda.cuda_versions()
    assert runtime >= 11000 and runtime % 10 == 0, runtime
    assert driver >= 0
    assert tuple(_cgx_cuda.ffi_api_version()) <= ffi.running_ffi_api_version()
    if not ffi._jax_has_gpu():
        ffi.check_cuda_versions(_cgx_cuda)  # no driver, no plugin here: nothing to refuse
