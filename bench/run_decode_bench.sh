#!/usr/bin/env bash
# Builds bench_decode (Release; no -march for the library and the benchmark TU, -march=native
# only for bench/decode_native.cpp), runs it in ONE process with repetitions, and writes
#   bench/results/decode.json   (Google Benchmark JSON, aggregates)
#   docs/benchmarks.md          (the "Decode step" section between the decode markers)
#   docs/img/decode_ratios.svg
# Usage: bench/run_decode_bench.sh [extra benchmark flags]
#   REPS=5 BUILD_DIR=build-bench-decode JOBS=2 REPORT_ONLY=1 (re-render from the JSON)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build-bench-decode}
reps=${REPS:-5}
json=$root/bench/results/decode.json
mkdir -p "$root/bench/results" "$root/docs/img"
if [[ "${REPORT_ONLY:-0}" != 1 ]]; then
  if [[ ! -f "$build/CMakeCache.txt" ]]; then
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_TESTS=OFF \
          -DKVEVICT_BUILD_EXAMPLES=OFF >/dev/null
  fi
  cmake --build "$build" -j"${JOBS:-2}" --target bench_decode
  "$build/bench/bench_decode" --benchmark_repetitions="$reps" \
    --benchmark_report_aggregates_only=true --benchmark_enable_random_interleaving=true \
    --benchmark_out="$json" --benchmark_out_format=json "$@"
fi
cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")
python3 "$root/bench/decode_report.py" "$json" "$root/docs/benchmarks.md" \
  "$root/docs/img/decode_ratios.svg" "$("$cxx" --version | head -1)"
