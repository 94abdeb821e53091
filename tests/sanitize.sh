#!/usr/bin/env bash
# Runs the kernel tests against a build of the CPU kernels with AddressSanitizer and
# UndefinedBehaviorSanitizer (CMake option CGX_JAX_SANITIZE=ON), so an access outside a
# buffer or undefined behaviour aborts the run. It reinstalls cgx_jax (editable) with the
# sanitizers, runs the tests with the sanitizer runtimes preloaded into Python, and
# reinstalls the normal build on exit, also after a failure.
#
#   bash tests/sanitize.sh            # needs gcc's libasan/libubsan; takes a few minutes
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

restore() {
  echo "=== reinstalling the normal build ==="
  env -u LD_PRELOAD CGX_JAX_SANITIZE=OFF pip install --no-build-isolation --no-deps -q -e . \
    -Cbuild-dir="build/{wheel_tag}"
}
trap restore EXIT

echo "=== building with CGX_JAX_SANITIZE=ON ==="
CGX_JAX_SANITIZE=ON CGX_JAX_CUDA=OFF pip install --no-build-isolation --no-deps -q -e . \
  -Cbuild-dir="build/sanitize-{wheel_tag}"

echo "=== kernel tests under ASan + UBSan ==="
# Python itself is not instrumented: preload the runtimes, and skip leak checking (the
# interpreter keeps memory alive at exit by design). The test of the process's peak memory is
# left out: ASan's quarantine keeps freed memory, so the peak grows by design.
LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  python -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/test_backends_ffi_fuzz.py tests/test_backends_ffi.py tests/test_backends_pure_jax.py \
    tests/test_api.py tests/test_collectives.py tests/test_collectives_transport.py \
    --deselect tests/test_api.py::test_memory_does_not_grow_over_10000_calls_with_fresh_keys \
    "$@"
