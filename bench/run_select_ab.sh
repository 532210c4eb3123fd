#!/usr/bin/env bash
# Small-k float top-k, two include trees interleaved in one process (bench/select_ab/ab.cpp):
# A = $A_INCLUDE (default: main's tree in a worktree), B = this tree's include/. ROUNDS rounds.
# Usage: A_INCLUDE=/path/to/main/include [ROUNDS=3] bench/run_select_ab.sh [n]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
a_inc=${A_INCLUDE:?set A_INCLUDE to the baseline tree include/ directory}
tmp=$(mktemp -d)
cxx=${CXX:-g++}
"$cxx" -std=c++20 -O3 -DNDEBUG -c -DVARIANT_NS=kv_a -DVARIANT_FN=topk_A -I"$a_inc" "$root/bench/select_ab/tu.cpp" -o "$tmp/a.o"
"$cxx" -std=c++20 -O3 -DNDEBUG -c -DVARIANT_NS=kv_b -DVARIANT_FN=topk_B -I"$root/include" "$root/bench/select_ab/tu.cpp" -o "$tmp/b.o"
"$cxx" -std=c++20 -O2 "$root/bench/select_ab/ab.cpp" "$tmp/a.o" "$tmp/b.o" -o "$tmp/ab"
grep -m1 "model name" /proc/cpuinfo
for r in $(seq "${ROUNDS:-3}"); do
  echo "== round $r $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  "$tmp/ab" "$@"
done
echo "== done $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
rm -rf "$tmp"
