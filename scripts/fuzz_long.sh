#!/usr/bin/env bash
# One long libFuzzer run of a target already built by scripts/fuzz.sh (build-fuzz/<t>/fuzz_<t>),
# as recorded in docs/reliability.md: the binary is copied to build-fuzz/<t>/long/ (a rebuild
# does not disturb the run), the corpus there starts from the committed seeds
# (fuzz/corpus/<t>), and the run stops at 10^6 executions or after <seconds>.
#   scripts/fuzz_long.sh <target> [seconds, default 7200] [runs, default 1000000]
# Writes build-fuzz/<t>/long/run.log (libFuzzer's output, then /usr/bin/time's CPU seconds
# and wall time); crash-*/leak-*/timeout-*/oom-* reproducers stay in that directory.
# Runs in the foreground: put it in the background yourself (nice -n 19 ... &).
set -euo pipefail
cd "$(dirname "$0")/.."
t=$1
secs=${2:-7200}
runs=${3:-1000000}
src=build-fuzz/$t/fuzz_$t
[ -x "$src" ] || { echo "fuzz_long.sh: build $src first (scripts/fuzz.sh 1 $t)" >&2; exit 2; }
out=build-fuzz/$t/long
rm -rf "$out"
mkdir -p "$out/corpus"
cp "$src" "$out/"
[ -d "fuzz/corpus/$t" ] && cp fuzz/corpus/$t/* "$out/corpus/"
git rev-parse --short HEAD > "$out/commit"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# The same per-target schedule as scripts/fuzz.sh (policy_ops: -entropic=0).
extra=()
[ "$t" = policy_ops ] && extra=(-entropic=0)
cd "$out"
/usr/bin/time -f "cpu_user_s=%U cpu_sys_s=%S wall_s=%e max_rss_kb=%M" \
  ./fuzz_$t -runs="$runs" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
  -print_final_stats=1 "${extra[@]}" corpus > run.log 2>&1
