#!/usr/bin/env bash
# Build the kernel harness and run it: natively (x86-64: the AVX2 and AVX-512 sets; aarch64: NEON)
# and, on other machines with an aarch64 cross compiler and qemu-user, the NEON set under
# user-mode emulation.
#   tests/native_kernels/run.sh [native|aarch64|all] [harness options: --quick, --set=NAME]
# Exit status: 0 every check ran passed, 1 a build or a check failed, 77 nothing was checked
# (a tool is missing or the CPU has no SIMD set; the reason is printed). `all` skips a part it
# cannot run, says why, and fails only on a failure.
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
# each kernel file with its flags from CMakeLists.txt, at -O2 rather than -O3 (with -ffp-contract=off
# the results do not depend on the level); warnings for the harness and the NEON file
std=(-std=c++20 -O2 -I"$src")
warn=(-Wall -Wextra)
host="$(uname -m)"

build() { "$@" || { echo "FAILED to build: $*"; exit 1; }; }
# object files compiled side by side (most of a run's time; the avx512 file alone is half),
# then `compiled` waits for them all: a failed one fails the run
pending=()
compile() { build "$@" & pending+=($!); }
compiled() { local j; for j in "${pending[@]}"; do wait "$j" || exit 1; done; pending=(); }
# the harness's own status: 0 passed, 1 failed, 77 no kernel set to check here
run() { local rc=0; "$@" || rc=$?; [ "$rc" = 0 ] || [ "$rc" = 77 ] || rc=1; return "$rc"; }

native() {
  local cxx="${CXX:-g++}" extra=()
  if ! command -v "$cxx" >/dev/null; then
    echo "SKIPPED native: no C++ compiler ($cxx; set CXX)"
    return 77
  fi
  [ "${SANITIZE:-0}" = 1 ] && extra=(-fsanitize=address,undefined -fno-omit-frame-pointer -g)
  case "$host" in
    x86_64|amd64)
      compile "$cxx" "${std[@]}" "${extra[@]}" -c "$src/kernels_scalar.cpp" -o "$out/scalar.o"
      compile "$cxx" "${std[@]}" "${extra[@]}" -mavx2 -mfma -mf16c -ffp-contract=off -c "$src/kernels_avx2.cpp" -o "$out/avx2.o"
      compile "$cxx" "${std[@]}" "${extra[@]}" -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c \
        -ffp-contract=off -c "$src/kernels_avx512.cpp" -o "$out/avx512.o"
      compile "$cxx" "${std[@]}" "${warn[@]}" "${extra[@]}" -c "$here/harness.cpp" -o "$out/harness.o"
      compile "$cxx" "${std[@]}" "${warn[@]}" "${extra[@]}" -c "$src/pool.cpp" -o "$out/pool.o"
      compiled
      build "$cxx" "${extra[@]}" -pthread "$out/harness.o" "$out/pool.o" "$out/scalar.o" "$out/avx2.o" "$out/avx512.o" -o "$out/native"
      ;;
    aarch64|arm64)
      compile "$cxx" "${std[@]}" "${extra[@]}" -c "$src/kernels_scalar.cpp" -o "$out/scalar.o"
      compile "$cxx" "${std[@]}" "${warn[@]}" "${extra[@]}" -ffp-contract=off -c "$src/kernels_neon.cpp" -o "$out/neon.o"
      compile "$cxx" "${std[@]}" "${warn[@]}" "${extra[@]}" -c "$here/harness.cpp" -o "$out/harness.o"
      compile "$cxx" "${std[@]}" "${warn[@]}" "${extra[@]}" -c "$src/pool.cpp" -o "$out/pool.o"
      compiled
      build "$cxx" "${extra[@]}" -pthread "$out/harness.o" "$out/pool.o" "$out/scalar.o" "$out/neon.o" -o "$out/native"
      ;;
    *)
      echo "SKIPPED native: no SIMD kernel set for $host"
      return 77
      ;;
  esac
  echo "== native ($host)"
  run "$out/native" "$@"
}

aarch64() {
  local cxx="${CROSS_CXX:-aarch64-linux-gnu-g++}" qemu="${QEMU:-qemu-aarch64}" missing=()
  local flags=(${CROSS_FLAGS:--march=armv8-a})
  command -v "$cxx" >/dev/null || missing+=("$cxx")
  command -v "$qemu" >/dev/null || missing+=("$qemu")
  if [ ${#missing[@]} -gt 0 ]; then
    echo "SKIPPED aarch64 (NEON under emulation): ${missing[*]} not found" \
      "(Debian/Ubuntu: apt-get install g++-aarch64-linux-gnu qemu-user)"
    return 77
  fi
  compile "$cxx" "${std[@]}" "${flags[@]}" -c "$src/kernels_scalar.cpp" -o "$out/scalar-a64.o"
  compile "$cxx" "${std[@]}" "${warn[@]}" "${flags[@]}" -ffp-contract=off -c "$src/kernels_neon.cpp" -o "$out/neon-a64.o"
  compile "$cxx" "${std[@]}" "${warn[@]}" "${flags[@]}" -c "$here/harness.cpp" -o "$out/harness-a64.o"
  compile "$cxx" "${std[@]}" "${warn[@]}" "${flags[@]}" -c "$src/pool.cpp" -o "$out/pool-a64.o"
  compiled
  build "$cxx" -static -pthread "$out/harness-a64.o" "$out/pool-a64.o" "$out/scalar-a64.o" "$out/neon-a64.o" -o "$out/aarch64"
  echo "== aarch64 under $qemu -cpu ${QEMU_CPU:-cortex-a53} (built with ${flags[*]})"
  run "$qemu" -cpu "${QEMU_CPU:-cortex-a53}" "$out/aarch64" "$@"
}

status=0 ran=0
part() {  # one part: a skip is said and does not count, a failure does
  local rc=0
  "$@" || rc=$?
  [ "$rc" = 77 ] && return 0
  ran=1
  [ "$rc" = 0 ] || status=1
}
case "$what" in
  native|aarch64) part "$what" "$@" ;;
  all)
    part native "$@"
    case "$host" in
      aarch64|arm64) echo "aarch64: the native run checked the NEON set" ;;
      *) part aarch64 "$@" ;;
    esac
    ;;
  *) echo "usage: $0 [native|aarch64|all] [--quick] [--set=NAME]" >&2; exit 2 ;;
esac
[ "$ran" = 1 ] || exit 77
exit "$status"
