#!/usr/bin/env bash
# Builds everything (library tests, examples, benchmarks) and runs every test with CTest.
#   scripts/test.sh             Release build in build/ (KVEVICT_QUICK_BUILD=ON, as .ci/run
#                               sets it: benchmarks at -O0, examples and tests at -O1)
#   scripts/test.sh --sanitize  clang build with -fsanitize=address,undefined in build-asan/
#     at -O0 (a test TU compiles ~3x faster than at -O1, which is what bounds CI time; ASan
#     reports at least as much at -O0), except the few tests whose running time dominates
#     at -O0 (KVEVICT_TEST_O1 below: -O1, as before). Left out of this pass, since the
#     Release pass runs them and they add no sanitizer coverage: the kernels-library copies
#     of tests (the same sources compiled once more), the consumer builds (they build
#     outside the sanitizer) and the per-KVEVICT_ISA reruns of the kernel tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
jobs=$(nproc)
# Ninja (scripts/install-deps.sh installs ninja-build) for a new build dir: no make
# recursion or per-target dependency-scan processes, and one global job queue. A build dir
# already configured keeps its generator (CMake refuses to switch one).
gen() {
  if [ ! -f "$1/CMakeCache.txt" ] && command -v ninja > /dev/null; then echo "-GNinja"; fi
}
if [ "${1:-}" = "--sanitize" ]; then
  dir=build-asan
  # lld (install-deps.sh) links an ASan+UBSan test binary in ~0.8 CPU-s against GNU ld's
  # ~2.2 (docs/benchmarks.md, "CI build time, stop 43"); GNU ld without it.
  lld=(); command -v ld.lld > /dev/null && lld=(-DCMAKE_EXE_LINKER_FLAGS=-fuse-ld=lld)
  cmake -S . -B "$dir" $(gen "$dir") "${lld[@]}" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_CXX_FLAGS_DEBUG="-gline-tables-only" \
    -DCMAKE_CXX_FLAGS="-O0 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all" \
    -DKVEVICT_BUILD_BENCH=OFF -DKVEVICT_BUILD_EXAMPLES=OFF \
    -DKVEVICT_BUILD_KERNELS_LIBRARY=OFF -DKVEVICT_TEST_CONSUMERS=OFF -DKVEVICT_TEST_ISA_RERUNS=OFF \
    -DKVEVICT_TEST_O1="buzz;eval_runner;kernels_attention;kernels_select;hash_evict;reference_exact;paged"
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
else
  dir=build
  # KVEVICT_QUICK_BUILD=ON (.ci/run): benchmarks at -O0, examples and tests at -O1 (CMakeLists.txt);
  # passed on every run so a cached ON never outlives the variable.
  cmake -S . -B "$dir" $(gen "$dir") -DCMAKE_BUILD_TYPE=Release -DKVEVICT_QUICK_BUILD="${KVEVICT_QUICK_BUILD:-OFF}"
fi
cmake --build "$dir" -j "$jobs"
ctest --test-dir "$dir" --output-on-failure -j "$jobs"
