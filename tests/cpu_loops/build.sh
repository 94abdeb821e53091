#!/usr/bin/env bash
# Builds tests/cpu_loops/loops_check.cc with the bucket loops compiled as CMakeLists.txt
# compiles them: every variant for the compiler's target (generic everywhere; AVX2 and
# AVX-512 on x86-64). Usage: build.sh OUTPUT [CXX [extra flags...]], e.g.
#   bash tests/cpu_loops/build.sh /tmp/loops_check
#   bash tests/cpu_loops/build.sh /tmp/loops_check_arm aarch64-linux-gnu-g++ -static
set -euo pipefail
out=$1
cxx=${2:-g++}
shift $(( $# > 1 ? 2 : 1 ))
root=$(cd "$(dirname "$0")/../.." && pwd)
flags=(-O3 -ffp-contract=off -std=c++17 -I"$root/xla_ffi" -I"$root/xla_ffi/cpu")
# The variants and their flags, read from CMakeLists.txt so the two cannot drift apart.
variants=("isa_generic|")
if [[ $("$cxx" -dumpmachine) == x86_64* ]]; then
  while IFS= read -r line; do variants+=("$line"); done < <(
    sed -n 's/.*"\(isa_avx[0-9]*\)\\;\([^"]*\)".*/\1|\2/p' "$root/CMakeLists.txt")
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
objects=()
for variant in "${variants[@]}"; do
  isa=${variant%%|*}
  read -r -a isa_flags <<< "${variant#*|}"
  "$cxx" "${flags[@]}" "${isa_flags[@]}" -DCGX_ISA="$isa" -c "$root/xla_ffi/cpu/bucket_loops.cc" \
    -o "$tmp/$isa.o" &
  objects+=("$tmp/$isa.o")
done
wait
"$cxx" "${flags[@]}" "$@" "$root/tests/cpu_loops/loops_check.cc" "${objects[@]}" -o "$out"
