#!/usr/bin/env bash
# ThreadSanitizer run of the multi-threaded stress test (tests/test_threads.cpp): many
# threads, each with its own batch of caches, shared read-only input and CPU detection.
#   scripts/tsan.sh [build dir, default build-tsan]
# Exits non-zero on any reported data race or test failure.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-tsan}
mkdir -p "$dir"
cxx=${CXX_TSAN:-clang++}
eigen=$(pkg-config --cflags eigen3 2>/dev/null || echo -I/usr/include/eigen3)
# Catch2's main is compiled once; the test itself with the same flags.
flags=(-std=c++20 -O1 -g -fno-omit-frame-pointer -fsanitize=thread -DFMT_HEADER_ONLY=1 -Iinclude -Itests $eigen)
"$cxx" "${flags[@]}" -c tests/main.cpp -o "$dir/catch_main.o"
"$cxx" "${flags[@]}" tests/test_threads.cpp "$dir/catch_main.o" -o "$dir/kvevict_test_threads_tsan" -pthread
TSAN_OPTIONS="halt_on_error=1 abort_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}" \
  "$dir/kvevict_test_threads_tsan"
