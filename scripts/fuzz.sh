#!/usr/bin/env bash
# Builds every libFuzzer target in fuzz/ with clang++ -fsanitize=fuzzer,address,undefined
# and runs each for a bounded time on its committed seed corpus (fuzz/corpus/<target>/,
# copied to a scratch corpus so CI runs do not grow the repository).
#   scripts/fuzz.sh [seconds per target, default 60] [target ...]
# KVEVICT_FUZZ_OPT (default -O1) is the optimisation level: .ci/run uses -O0, since its short
# runs are bounded by the build (a TU compiles ~3x faster at -O0); long runs keep -O1.
# Exits non-zero on the first crash, sanitizer report, leak, timeout or OOM; the
# reproducer is left in build-fuzz/<target>/ (crash-*, leak-*, timeout-*, oom-*).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(saved_state policy_ops llama2c_checkpoint safetensors xkv_profile paged_pool hf_checkpoint
           hf_tokenizer)
fi
cxx=${CXX_FUZZ:-clang++}
eigen=$(pkg-config --cflags eigen3 2>/dev/null || echo -I/usr/include/eigen3)
# No coverage counters in std / Eigen / fmt (fuzz/coverage_ignorelist.txt): sanitizers still
# check that code, but libFuzzer's per-execution feature bookkeeping only sees kvevict's.
flags=(-std=c++20 "${KVEVICT_FUZZ_OPT:--O1}" -gline-tables-only -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined
       -fno-sanitize-recover=all -fsanitize-coverage-ignorelist=fuzz/coverage_ignorelist.txt
       -DFMT_HEADER_ONLY=1 -Iinclude -Iexamples/llama2c -Iexamples/eval $eigen)
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
jobs=${KVEVICT_FUZZ_JOBS:-$(nproc)}
for t in "${targets[@]}"; do
  [ -f "fuzz/fuzz_$t.cpp" ] || { echo "fuzz.sh: no target fuzz/fuzz_$t.cpp" >&2; exit 2; }
  mkdir -p "build-fuzz/$t/corpus"
done

# Each target is one clang invocation on one core and libFuzzer runs on one core: both the
# builds and the runs go $jobs at a time (CI time is bounded by them).
build_one() {
  local t=$1 out=build-fuzz/$1
  "$cxx" "${flags[@]}" "fuzz/fuzz_$t.cpp" -o "$out/fuzz_$t" > "$out/build.log" 2>&1 ||
    { cat "$out/build.log" >&2; echo "fuzz.sh: building $t failed" >&2; return 1; }
  echo "== built $t"
}
run_one() {
  local t=$1 out=build-fuzz/$1
  [ -d "fuzz/corpus/$t" ] && cp -n fuzz/corpus/$t/* "$out/corpus/" 2>/dev/null || true
  # policy_ops touches thousands of coverage features per execution; libFuzzer's entropic
  # schedule spent ~45% of its time updating their frequencies (perf, docs/reliability.md):
  # it runs with the plain schedule, about 5x the executions per CPU second.
  local extra=()
  [ "$t" = policy_ops ] && extra=(-entropic=0)
  (cd "$out" && ./fuzz_$t -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
      -max_len=4096 -print_final_stats=1 "${extra[@]}" corpus > run.log 2>&1) || true
  echo "== $t ran ${secs}s"; tail -n 25 "$out/run.log"
  grep -q "Done [0-9]* runs" "$out/run.log" || { echo "fuzz.sh: $t failed" >&2; return 1; }
}
# Runs "$1 target" for every target, at most $jobs at once; each success leaves
# build-fuzz/<target>/<step>.ok, and the step fails unless every target left one.
in_parallel() {
  local step=$1 t
  for t in "${targets[@]}"; do rm -f "build-fuzz/$t/$step.ok"; done
  for t in "${targets[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
    { "$step" "$t" && touch "build-fuzz/$t/$step.ok"; } &
  done
  wait
  for t in "${targets[@]}"; do
    [ -f "build-fuzz/$t/$step.ok" ] || { echo "fuzz.sh: $step $t failed" >&2; return 1; }
  done
}
in_parallel build_one
in_parallel run_one
echo "fuzz.sh: all targets ran ${secs}s without findings"
