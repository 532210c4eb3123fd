#!/usr/bin/env bash
# Compile cost of kvevict's headers: CPU time (user + sys) of `g++ -std=c++20 -O2 -c` on
# small translation units, median of N runs, runs interleaved across cases and trees so
# that load on the (shared) machine hits every figure alike.
#
# usage: bench/compile_time.sh [-n RUNS] [-x CXX] [-c CASE,CASE...] [LABEL=TREE ...]
#   TREE is a kvevict source root (holding include/ and README.md); several trees are
#   timed in one run, e.g. before/after a change:
#     git worktree add /tmp/cc-base main
#     bench/compile_time.sh -n 5 base=/tmp/cc-base new=.
#   Default: this checkout alone.
#
# Cases (one TU each):
#   kvevict.hpp     #include <kvevict/kvevict.hpp> alone
#   readme          README.md's usage example (between the usage-example markers, as
#                   tests/consumers.cmake extracts it)
#   h2o_trio        cache.hpp + attention.hpp + policies/h2o.hpp
#   hash_evict      policies/hash_evict.hpp alone
#   eigen_core      <Eigen/Core> alone (anchor: what any Eigen user already pays)
#   fmt_format      <fmt/format.h> alone, header-only mode (anchor for the fmt dependency)
# Flags are what the kvevict CMake target gives a consumer: -std=c++20, Eigen's include
# dir, FMT_HEADER_ONLY=1 (fmt::fmt-header-only); no -march.
set -euo pipefail

runs=3
cxx=${CXX:-g++}
cases=(kvevict.hpp readme h2o_trio hash_evict eigen_core fmt_format)
while getopts "n:x:c:" opt; do
  case $opt in
    n) runs=$OPTARG ;;
    x) cxx=$OPTARG ;;
    c) IFS=, read -r -a cases <<< "$OPTARG" ;;
    *) echo "usage: $0 [-n RUNS] [-x CXX] [-c CASE,CASE...] [LABEL=TREE ...]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ "$runs" -ge 1 ] || { echo "runs must be >= 1" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
trees=("$@")
[ ${#trees[@]} -gt 0 ] || trees=("this=$here")

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

write_cases() {  # $1 = tree root, $2 = output dir
  local root=$1 out=$2
  mkdir -p "$out"
  printf '#include <kvevict/kvevict.hpp>\n' > "$out/kvevict.hpp.cpp"
  printf '#include <kvevict/cache.hpp>\n#include <kvevict/attention.hpp>\n#include <kvevict/policies/h2o.hpp>\n' \
    > "$out/h2o_trio.cpp"
  printf '#include <kvevict/policies/hash_evict.hpp>\n' > "$out/hash_evict.cpp"
  printf '#include <Eigen/Core>\n' > "$out/eigen_core.cpp"
  printf '#include <fmt/format.h>\n' > "$out/fmt_format.cpp"
  # The README example: the ```cpp block between the markers.
  awk '/<!-- usage-example-begin -->/{inside=1; next}
       /<!-- usage-example-end -->/{inside=0}
       inside && /^```cpp/{code=1; next}
       inside && code && /^```/{code=0; next}
       inside && code {print}' "$root/README.md" > "$out/readme.cpp"
  [ -s "$out/readme.cpp" ] || { echo "no usage example in $root/README.md" >&2; exit 2; }
}

cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
echo "CPU: $cpu ($(nproc) logical CPUs); load average: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "compiler: $($cxx --version | head -1)"
echo "command per case: $cxx -std=c++20 -O2 -I<tree>/include -I/usr/include/eigen3 -DFMT_HEADER_ONLY=1 -c case.cpp -o /dev/null"
echo "median of $runs runs, CPU time (user+sys) in seconds, runs interleaved"

labels=()
for t in "${trees[@]}"; do
  label=${t%%=*}; root=${t#*=}
  [ "$label" != "$t" ] || { echo "tree must be LABEL=PATH: $t" >&2; exit 2; }
  [ -d "$root/include/kvevict" ] || { echo "$root has no include/kvevict" >&2; exit 2; }
  labels+=("$label")
  echo "$(cd "$root" && pwd)" > "$work/$label.root"
  write_cases "$root" "$work/$label"
done

for ((r = 0; r < runs; ++r)); do
  for c in "${cases[@]}"; do
    for label in "${labels[@]}"; do
      root=$(cat "$work/$label.root")
      src="$work/$label/$c.cpp"
      if ! /usr/bin/time -f "%U %S" -o "$work/t" \
           "$cxx" -std=c++20 -O2 -I"$root/include" -I/usr/include/eigen3 -DFMT_HEADER_ONLY=1 \
           -c "$src" -o /dev/null 2> "$work/err"; then
        echo "compile failed: $label $c" >&2; cat "$work/err" >&2; exit 1
      fi
      awk '{printf "%.3f\n", $1 + $2}' "$work/t" >> "$work/$label.$c.times"
    done
  done
done

median() { sort -g "$1" | awk '{v[NR]=$1} END {if (NR % 2) print v[(NR+1)/2]; else printf "%.3f\n", (v[NR/2]+v[NR/2+1])/2}'; }
header="| case |"; rule="|---|"
for label in "${labels[@]}"; do header+=" $label (s) |"; rule+="---:|"; done
[ ${#labels[@]} -eq 2 ] && { header+=" ${labels[1]} / ${labels[0]} |"; rule+="---:|"; }
echo; echo "$header"; echo "$rule"
for c in "${cases[@]}"; do
  row="| $c |"; vals=()
  for label in "${labels[@]}"; do m=$(median "$work/$label.$c.times"); vals+=("$m"); row+=" $m |"; done
  [ ${#labels[@]} -eq 2 ] && row+=" $(awk -v a="${vals[0]}" -v b="${vals[1]}" 'BEGIN{printf "%.2f", b/a}') |"
  echo "$row"
done
