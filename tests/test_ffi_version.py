"""The compiled modules against the running jaxlib's XLA FFI API version (docs/design.md
section 3): a module built for a newer API than the running jaxlib's gets a clear error on
first use, naming both versions and the fix, instead of XLA's INVALID_ARGUMENT."""

import re
import types

import jaxlib
import pytest

from cgx_jax import _cgx_cpu
from cgx_jax.backends import ffi

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


def test_registration_checks_the_version_first(monkeypatch):
    monkeypatch.setattr(ffi, "running_ffi_api_version", lambda: (0, 0))
    ffi._register.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="built against XLA FFI API"):
            ffi._register()
    finally:
        monkeypatch.undo()
        ffi._register.cache_clear()
        ffi._register()


def test_unreadable_headers_skip_the_check(monkeypatch, tmp_path):
    monkeypatch.setattr(ffi.jax.ffi, "include_dir", lambda: str(tmp_path))
    assert ffi.running_ffi_api_version() is None
    ffi.check_ffi_api_version(_cgx_cpu)
