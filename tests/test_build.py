"""The build says what it builds and how to skip the CUDA module (a user's first install
compiles for minutes; pip shows these lines with ``-v``): CMake's configure step run here
against this checkout."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(
    not (ROOT / "CMakeLists.txt").is_file() or shutil.which("cmake") is None,
    reason="needs the source tree and cmake")


def configure(tmp_path, cuda: str) -> str:
    done = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"), f"-DCGX_JAX_CUDA={cuda}",
         f"-DPython_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_cpu_only_build_says_so(tmp_path):
    assert "cgx_jax: CGX_JAX_CUDA=OFF, building the CPU module only" in configure(tmp_path,
                                                                                 "OFF")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_build_says_how_to_skip_it(tmp_path):
    out = configure(tmp_path, "AUTO")
    assert "building the CPU module and the CUDA module _cgx_cuda" in out
    assert "CGX_JAX_CUDA=OFF skips it" in out
