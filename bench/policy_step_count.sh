#!/usr/bin/env bash
# Instructions per DecayedAttention::recommended() decode step (bench/policy_step_count.cpp
# under callgrind), for the headers of one or more source trees, so a change can be counted
# against main:  bench/policy_step_count.sh OLD_TREE NEW_TREE
# Builds the driver per tree with g++ -O3 (no -march, as a user including the headers would),
# runs it at n = 1K, 4K, 16K with Hkv = 8 for two step counts under callgrind, and prints
# (Ir(long) - Ir(short)) / (steps(long) - steps(short)) and the kept-rows checksum.
# POLICY=hashevict_query_b64 (etc., see policy_step_count.cpp) counts another policy's step;
# NS="1024" limits the sizes. Valgrind has no AVX-512: the kernels run their AVX2 bodies.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${OUT:-$(mktemp -d)}
for tree in "$@"; do
  tag=$(basename "$tree")
  g++ -std=c++20 -O3 -DNDEBUG -I/usr/include/eigen3 -I"$tree/include" -I"$here" \
    "$here/policy_step_count.cpp" -o "$out/count_$tag" -lfmt
done
policy=${POLICY:-decayed_recommended}
for n in ${NS:-1024 4096 16384}; do
  case $n in 1024) a=300 b=900 ;; 4096) a=100 b=300 ;; *) a=30 b=90 ;; esac
  for tree in "$@"; do
    tag=$(basename "$tree")
    ir=()
    for s in $a $b; do
      total=$(valgrind --tool=callgrind --callgrind-out-file="$out/cg_${tag}_${n}_$s" \
        "$out/count_$tag" "$n" 8 "$s" "$policy" 2>&1 | tee "$out/log_${tag}_${n}_$s" |
        sed -n 's/.*Collected : \([0-9]*\).*/\1/p')
      # the probability draws (ProbStream::refill, untimed in bench_policy_step) not counted
      draws=$(callgrind_annotate --inclusive=yes "$out/cg_${tag}_${n}_$s" 2>/dev/null |
        sed -n 's/^ *\([0-9,]*\) .*ProbStream::refill.*/\1/p' | head -1 | tr -d ,)
      ir+=("$((total - ${draws:-0}))")
    done
    sum=$(grep -o 'kept_checksum=[0-9a-f]*' "$out/log_${tag}_${n}_$b")
    echo "$tag $policy n=$n hkv=8 instructions_per_step=$(( (ir[1] - ir[0]) / (b - a) )) $sum"
  done
done
