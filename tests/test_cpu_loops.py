"""The CPU bucket loops outside Python (tests/cpu_loops, docs/design.md section 3).

- Every instruction-set variant this CPU runs writes the same bytes (a C++ driver hashes
  everything the loops write over inputs that take every code path).
- aarch64 (Graviton, Grace): the loops cross-compiled with Debian's aarch64 compiler and run
  under qemu-user write the same bytes as on x86-64, and the handler file compiles there.
- No instruction that is slow on a common server CPU is in the built module: pext/pdep
  (microcoded on AMD Zen 1/Zen+/Zen 2, tens to hundreds of cycles) and vector gathers (slow
  on AMD before Zen 3).
Each test skips where its tools (a C++ compiler, the cross compiler, qemu, objdump) are missing.
"""

import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.starts_processes  # run first (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "tests" / "cpu_loops" / "build.sh"
CROSS = "aarch64-linux-gnu-g++"


def build_driver(out: Path, *compiler_and_flags: str) -> Path:
    subprocess.run(["bash", str(BUILD), str(out), *compiler_and_flags], check=True,
                   capture_output=True, text=True, timeout=600)
    return out


def digests(command: list[str]) -> dict[str, str]:
    out = subprocess.run(command + ["digest"], check=True, capture_output=True, text=True,
                         timeout=600).stdout
    return dict(line.split() for line in out.splitlines())


@pytest.fixture(scope="module")
def native_digests(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build the loop driver")
    driver = build_driver(tmp_path_factory.mktemp("native") / "loops_check")
    return digests([str(driver)])


def test_every_variant_this_cpu_runs_writes_the_same_bytes(native_digests):
    assert "isa_generic" in native_digests
    assert len(set(native_digests.values())) == 1, native_digests


@pytest.mark.skipif(platform.machine() != "x86_64", reason="compares with the x86-64 build")
@pytest.mark.skipif(shutil.which(CROSS) is None or shutil.which("qemu-aarch64") is None,
                    reason=f"needs {CROSS} and qemu-aarch64 (apt-get install "
                           "g++-aarch64-linux-gnu qemu-user)")
def test_aarch64_loops_write_the_same_bytes_as_x86_64(native_digests, tmp_path):
    driver = build_driver(tmp_path / "loops_check_aarch64", CROSS, "-static")
    arm = digests(["qemu-aarch64", str(driver)])
    assert list(arm) == ["isa_generic"]  # NEON is aarch64's baseline: one variant
    assert arm["isa_generic"] == native_digests["isa_generic"]


@pytest.mark.skipif(shutil.which(CROSS) is None, reason=f"needs {CROSS}")
def test_cpu_handlers_compile_for_aarch64(tmp_path):
    import jax.ffi

    nanobind = pytest.importorskip("nanobind")
    nb = Path(nanobind.include_dir())
    subprocess.run(
        [CROSS, "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-w",
         f"-I{ROOT / 'xla_ffi'}", f"-I{ROOT / 'xla_ffi' / 'cpu'}",
         "-isystem", jax.ffi.include_dir(), f"-I{nb}",
         f"-I{nb.parent / 'ext' / 'robin_map' / 'include'}",
         f"-I{sysconfig.get_paths()['include']}",
         "-c", str(ROOT / "xla_ffi" / "cpu" / "cpu_kernels.cc"), "-o", str(tmp_path / "k.o")],
        check=True, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 instructions")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_no_pext_pdep_or_gathers_in_the_built_module():
    from cgx_jax import _cgx_cpu

    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", _cgx_cpu.__file__],
                             check=True, capture_output=True, text=True, timeout=600).stdout
    assert len(listing) > 10_000  # a real disassembly, not an empty one
    mnemonics = [line.split("\t")[-1].split(" ")[0] for line in listing.splitlines()]
    found = [m for m in mnemonics if m in ("pext", "pdep") or "gather" in m]
    assert not found, ("pext/pdep are microcoded on AMD Zen 1/Zen+/Zen 2 (tens to hundreds "
                       "of cycles) and gathers are slow on AMD before Zen 3; pack with shifts "
                       f"and load contiguously instead (bucket_loops.cc): {sorted(set(found))}")
