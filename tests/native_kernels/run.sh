#!/usr/bin/env bash
# Build the kernel harness and run it: natively (x86-64: the AVX2 and AVX-512 sets) and, with
# an aarch64 cross compiler and qemu-user, the NEON set under user-mode emulation.
#   tests/native_kernels/run.sh [native|aarch64|all] [harness options: --quick, --set=NAME]
# Environment: CXX (native compiler, g++), CROSS_CXX (aarch64-linux-gnu-g++), QEMU
# (qemu-aarch64), CROSS_FLAGS (default -march=armv8-a: the baseline every aarch64 CPU has),
# QEMU_CPU (default cortex-a53: an ARMv8.0 core, so an instruction past the baseline traps),
# SANITIZE=1 (native: also AddressSanitizer and UBSan).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="$here/../../turbospark_core/_native/qmm"
what="${1:-all}"
[ $# -gt 0 ] && shift
out="$(mktemp -d "${TMPDIR:-/tmp}/turbospark-kernels.XXXXXX")"
trap 'rm -rf "$out"' EXIT
# the flags CMakeLists.txt compiles each kernel file with (warnings: the harness and the NEON file)
std=(-std=c++20 -O2 -I"$src")
warn=(-Wall -Wextra)
status=0

native() {
  local cxx="${CXX:-g++}" extra=()
  [ "${SANITIZE:-0}" = 1 ] && extra=(-fsanitize=address,undefined -fno-omit-frame-pointer -g)
  case "$(uname -m)" in
    x86_64|amd64)
      "$cxx" "${std[@]}" "${extra[@]}" -c "$src/kernels_scalar.cpp" -o "$out/scalar.o"
      "$cxx" "${std[@]}" "${extra[@]}" -mavx2 -mfma -mf16c -ffp-contract=off -c "$src/kernels_avx2.cpp" -o "$out/avx2.o"
      "$cxx" "${std[@]}" "${extra[@]}" -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c \
        -ffp-contract=off -c "$src/kernels_avx512.cpp" -o "$out/avx512.o"
      "$cxx" "${std[@]}" "${warn[@]}" "${extra[@]}" "$here/harness.cpp" "$out/scalar.o" "$out/avx2.o" "$out/avx512.o" -o "$out/native"
      ;;
    aarch64|arm64)
      "$cxx" "${std[@]}" "${extra[@]}" -c "$src/kernels_scalar.cpp" -o "$out/scalar.o"
      "$cxx" "${std[@]}" "${warn[@]}" "${extra[@]}" -ffp-contract=off -c "$src/kernels_neon.cpp" -o "$out/neon.o"
      "$cxx" "${std[@]}" "${warn[@]}" "${extra[@]}" "$here/harness.cpp" "$out/scalar.o" "$out/neon.o" -o "$out/native"
      ;;
    *) echo "native: no SIMD kernel set for $(uname -m)"; return 0 ;;
  esac
  echo "== native ($(uname -m))"
  "$out/native" "$@" || status=1
}

aarch64() {
  local cxx="${CROSS_CXX:-aarch64-linux-gnu-g++}" qemu="${QEMU:-qemu-aarch64}"
  local flags=(${CROSS_FLAGS:--march=armv8-a})
  if ! command -v "$cxx" >/dev/null || ! command -v "$qemu" >/dev/null; then
    echo "aarch64: needs $cxx and $qemu (Debian: apt-get install g++-aarch64-linux-gnu qemu-user)"
    return 2
  fi
  "$cxx" "${std[@]}" "${flags[@]}" -c "$src/kernels_scalar.cpp" -o "$out/scalar-a64.o"
  "$cxx" "${std[@]}" "${warn[@]}" "${flags[@]}" -ffp-contract=off -c "$src/kernels_neon.cpp" -o "$out/neon-a64.o"
  "$cxx" "${std[@]}" "${warn[@]}" "${flags[@]}" -static "$here/harness.cpp" "$out/scalar-a64.o" "$out/neon-a64.o" -o "$out/aarch64"
  echo "== aarch64 under $qemu -cpu ${QEMU_CPU:-cortex-a53} (built with ${flags[*]})"
  "$qemu" -cpu "${QEMU_CPU:-cortex-a53}" "$out/aarch64" "$@" || status=1
}

case "$what" in
  native) native "$@" ;;
  aarch64) aarch64 "$@" || status=$? ;;
  all) native "$@"; aarch64 "$@" || status=$? ;;
  *) echo "usage: $0 [native|aarch64|all] [--quick] [--set=NAME]" >&2; exit 2 ;;
esac
exit "$status"
