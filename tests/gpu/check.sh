#!/usr/bin/env bash
# GPU check for a fresh, offline NVIDIA machine (issue: CUDA kernels). Builds cgx_jax with
# the CUDA module, runs the GPU tests and a CPU sanity subset, then the kernel benchmark on
# the GPU and, for comparison, on the CPU. Needs jax with its CUDA plugin, nanobind,
# scikit-build-core, cmake, ninja and pytest installed; no network.
#
#   bash tests/gpu/check.sh            # JSON results go to $OUT (or /tmp)
#
# Every step has a timeout, and no step may run past DEADLINE seconds from the start, so
# the whole script ends within 8 minutes. A failing build or test does not stop the
# benchmarks; the script exits non-zero at the end if any step failed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
RESULTS="${OUT:-/tmp}"
mkdir -p "$RESULTS"
DEADLINE=460
FAILED=()
# Offline machine: pip must neither look for an index nor for a newer pip.
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# run_step NAME SECONDS COMMAND...: runs the command under `timeout` (SECONDS, or less when
# the deadline is nearer), prints its wall time, and records a failure or a timeout
# (exit status 124) instead of exiting.
run_step() {
  local name="$1" limit="$2"
  shift 2
  local left=$((DEADLINE - SECONDS))
  echo
  if [ "$left" -lt 10 ]; then
    echo "=== $name: SKIPPED, no time left ==="
    FAILED+=("$name (skipped: no time left)")
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit}s) ==="
  local start=$SECONDS status=0
  timeout --kill-after=5 "$limit" "$@" || status=$?
  local took=$((SECONDS - start))
  if [ "$status" -eq 0 ]; then
    echo "=== $name: ok in ${took}s ==="
  else
    [ "$status" -eq 124 ] && echo "=== $name: TIMED OUT after ${took}s ===" \
                          || echo "=== $name: FAILED (exit $status) after ${took}s ==="
    FAILED+=("$name (exit $status)")
  fi
}

echo "=== machine ==="
if command -v nvidia-smi >/dev/null; then
  timeout 15 nvidia-smi -L || echo "nvidia-smi -L failed"
else
  echo "nvidia-smi: not found"
fi
if command -v nvcc >/dev/null; then
  timeout 15 nvcc --version | tail -n 2 || echo "nvcc --version failed"
else
  echo "nvcc: not found"
fi
python --version

# Budget (seconds): build 180, info 30, GPU tests 90, CPU subset 60, GPU bench 45,
# CPU bench 30 (435; the deadline caps the sum at 460). A fixed build directory makes a
# rerun on the same machine incremental.
run_step "build (CGX_JAX_CUDA=ON pip install -e .)" 180 \
  env CGX_JAX_CUDA=ON pip install --no-build-isolation --no-deps -e . \
  -Cbuild-dir="build/gpu-check-{wheel_tag}"

run_step "cgx_jax info" 30 python -c '
import jax, jaxlib, cgx_jax as cgx
print("jax", jax.__version__, "jaxlib", jaxlib.__version__)
print("has_cuda_support:", cgx.has_cuda_support())
print("jax.devices():", jax.devices())
'

run_step "GPU tests (tests/test_backends_cuda.py)" 90 \
  python -m pytest -q tests/test_backends_cuda.py -rs

# Sanity subset of the CPU kernel tests (FFI kernels and jnp backend), without the large inputs.
kernel_files=(tests/test_backends_ffi.py tests/test_backends_pure_jax.py)
kernel_tests=(python -m pytest -q -x "${kernel_files[@]}" -k "not large")
if ! timeout 30 python -m pytest -q --collect-only "${kernel_files[@]}" -k "not large" \
    >/dev/null 2>&1; then
  kernel_tests=(python -m pytest -q -x "${kernel_files[@]}")  # the filter selected nothing
fi
run_step "CPU kernel tests (subset)" 60 "${kernel_tests[@]}"

run_step "benchmark: kernels on the GPU" 45 \
  python -m cgx_jax.bench kernels --platform gpu --json "$RESULTS/bench_gpu.json"
run_step "benchmark: kernels on the CPU (4M elements)" 30 \
  python -m cgx_jax.bench kernels --platform cpu --sizes 4194304 --json "$RESULTS/bench_cpu.json"

echo
echo "=== done in ${SECONDS}s; JSON in $RESULTS (bench_gpu.json, bench_cpu.json) ==="
if [ "${#FAILED[@]}" -ne 0 ]; then
  printf 'FAILED: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "all steps passed"
