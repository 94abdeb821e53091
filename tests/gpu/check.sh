#!/usr/bin/env bash
# GPU check for a fresh, offline NVIDIA machine (docs/gpu.md records its results). Builds
# cgx_jax with the CUDA module, runs the GPU tests (CUDA against CPU bytes), the kernel
# benchmark on the GPU next to a device copy, and tests/gpu/step_overhead.py (compressed_psum
# on one GPU under pmap and shard_map, and the example ViT's training step with and without
# compression); then, with the time left, a CPU sanity subset and a memory check of the CUDA
# kernels under compute-sanitizer. Needs jax with its CUDA plugin, flax, optax, nanobind,
# scikit-build-core, cmake, ninja and pytest installed; no network.
#
#   bash tests/gpu/check.sh            # logs and JSON results go to $OUT (or /tmp)
#
# Every step has a timeout, and no step may run past DEADLINE seconds from the start. A
# failing build or test does not stop the later steps; the script exits non-zero at the end
# if any step failed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
RESULTS="${OUT:-/tmp}"
mkdir -p "$RESULTS"
DEADLINE=${CGX_CHECK_DEADLINE:-420}
FAILED=()
# Offline machine: pip must neither look for an index nor for a newer pip.
# The interpreter that has jax (python3 on the GPU machines, where `python` may be absent).
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

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
  timeout 15 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
    --format=csv || echo "nvidia-smi failed"
else
  echo "nvidia-smi: not found"
fi
if command -v nvcc >/dev/null; then
  timeout 15 nvcc --version | tail -n 2 || echo "nvcc --version failed"
else
  echo "nvcc: not found"
fi
"$PY" --version
nproc

# Expected (seconds): build 60, info 10, GPU tests 60, GPU kernels 40, step and psum 90;
# each limit is about twice that. A fixed build directory makes a rerun on the same machine
# incremental; nvcc compiles the CUDA architectures in parallel (CMakeLists.txt).
run_step "build (CGX_JAX_CUDA=ON pip install -e .)" 150 \
  env CGX_JAX_CUDA=ON "$PY" -m pip install --no-build-isolation --no-deps -e . \
  -Cbuild-dir="build/gpu-check-{wheel_tag}"

run_step "cgx_jax info" 30 "$PY" -c '
import jax, jaxlib, cgx_jax as cgx
print("jax", jax.__version__, "jaxlib", jaxlib.__version__)
print("has_cuda_support:", cgx.has_cuda_support())
print("jax.devices():", jax.devices())
import importlib.metadata as md
for name in ("jax-cuda13-plugin", "jax-cuda13-pjrt", "flax", "optax", "nanobind"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
'

run_step "GPU tests (tests/test_backends_cuda.py)" 120 \
  "$PY" -m pytest -o addopts="" -q tests/test_backends_cuda.py -rs --durations=5 \
  --junitxml="$RESULTS/gpu_tests.xml"

run_step "benchmark: kernels on the GPU" 90 \
  "$PY" -m cgx_jax.bench kernels --platform gpu --sizes 16M 64M 256M --bits 2 4 8 \
  --rounding stochastic nearest --json "$RESULTS/bench_gpu.json"

run_step "compressed_psum and the ViT step on one GPU (tests/gpu/step_overhead.py)" 180 \
  "$PY" tests/gpu/step_overhead.py --json "$RESULTS/step_overhead.json"

# With the time left: the CPU kernel tests on this machine's jax, and a memory check of the
# CUDA kernels (out-of-bounds accesses) on the small packet-window and reduction tests.
run_step "CPU kernel tests (subset)" 60 \
  "$PY" -m pytest -o addopts="" -q -x tests/test_backends_ffi.py tests/test_backends_pure_jax.py
if command -v compute-sanitizer >/dev/null; then
  run_step "compute-sanitizer memcheck (CUDA window and reduction tests)" 90 \
    env XLA_PYTHON_CLIENT_PREALLOCATE=false \
    compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$PY" -m pytest -o addopts="" -q -x tests/test_backends_cuda.py -k "windows or reduce_requantize"
fi

echo
echo "=== done in ${SECONDS}s; results in $RESULTS (gpu_tests.xml, bench_gpu.json, step_overhead.json) ==="
if [ "${#FAILED[@]}" -ne 0 ]; then
  printf 'FAILED: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "all steps passed"
