#!/usr/bin/env bash
# Alternates bench/quant_unpack_probe.cpp built against the headers of several trees and
# prints, per format and n, the median over rounds of each tree's per-round medians:
#   bench/quant_unpack_probe.sh MODE ROUNDS TREE...      (MODE cache | mem)
# FREE_UNPACK=1 adds a build of the first tree's headers in which the AVX-512 Q4 span-order
# unpack (q_chunk_scaled's nibble broadcast, shift and VPERMPS) is replaced by its block table
# itself: the same FMAs, tables, reductions and memory traffic with the unpack free (wrong
# values: a bound, not a kernel). Q8 is unchanged in that build.
# FREE_Q8_SCALE=1 adds a build of the first tree's headers in which the AVX-512 Q8 chunk is
# not multiplied by its block scale (q_chunk_scaled returns q_chunk: the same loads, widening,
# converts, FMAs and traffic without the 16 VMULPS per row of the two passes; a bound, wrong
# values). Q4 is unchanged in that build.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mode=$1 rounds=$2
shift 2
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
tags=()
build() {  # tree tag
  g++ -std=gnu++20 -O3 -DNDEBUG -isystem /usr/include/eigen3 -I"$1/include" \
    "$here/quant_unpack_probe.cpp" -o "$out/probe_$2"
  tags+=("$2")
}
for tree in "$@"; do build "$tree" "$(basename "$tree")"; done
# patched TAG OLD NEW: the first tree's headers with OLD replaced by NEW in
# attention_quant.hpp (a scratch copy), built as TAG.
patched() {
  mkdir -p "$out/$1"
  cp -r "$first/include" "$out/$1/"
  python3 - "$out/$1/include/kvevict/kernels/attention_quant.hpp" "$2" "$3" <<'PY'
import sys
p, old, new = sys.argv[1:4]
s = open(p).read()
assert s.count(old) == 1, "not found once in attention_quant.hpp: " + old
open(p, "w").write(s.replace(old, new))
PY
  build "$out/$1" "$1"
}
first=$1
if [[ ${FREE_UNPACK:-0} == 1 ]]; then  # q_chunk_scaled's Q4 branch returns its block table
  p=$'  if constexpr (q4_span_order<D>) {\n    const std::uint8_t* p = q_codes_at<D>(row, e & ~std::size_t(31));'
  patched free_unpack "$p" "${p/\{/\{ (void)row; (void)e; return sc;}"
fi
if [[ ${FREE_Q8_SCALE:-0} == 1 ]]; then  # q_chunk_scaled's Q8 branch skips the scale multiply
  patched free_q8_scale $'  } else {\n    return vmul(q_chunk<D>(row, e), sc);' \
    $'  } else {\n    (void)sc;\n    return q_chunk<D>(row, e);'
fi
for r in $(seq "$rounds"); do
  for t in "${tags[@]}"; do "$out/probe_$t" "$mode" 15 | grep -E '^q[48] ' | sed "s/^/$t /"; done
done > "$out/rounds.txt"
python3 - "$out/rounds.txt" <<'PY'
import collections, statistics, sys
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    tag, fmt, n, hkv, *kv = line.split()
    d[(int(n.split("=")[1]), fmt, tag)].append({k: float(v) for k, v in (x.split("=") for x in kv)})
for (n, fmt, tag), v in sorted(d.items()):
    med = {k: statistics.median(x[k] for x in v) for k in v[0]}
    print(f"{fmt} n={n} {tag:12s} step {med['step_us']:9.1f} us  qk {med['qk_us']:9.1f}  pv {med['pv_us']:9.1f}  ({len(v)} rounds)")
PY
