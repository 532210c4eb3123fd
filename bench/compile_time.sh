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
#   readme_narrow   the README example with its kvevict includes replaced by the three
#                   headers it uses (cache.hpp, attention.hpp, policies/h2o.hpp): what
#                   README shows since 2026-12-01 evening (readme = readme_narrow there)
#   readme_umbrella the README example with <kvevict/kvevict.hpp> as its one kvevict include
#   eigen_core      <Eigen/Core> alone (anchor: what any Eigen user already pays)
#   fmt_format      <fmt/format.h> alone, header-only mode (anchor for the fmt dependency)
# Compiled-kernels mode (kvevict::kernels, include/kvevict/config.hpp); "n/a" for a tree
# without include/kvevict/config.hpp:
#   kvevict.hpp_sep, readme_sep, readme_narrow_sep, readme_umbrella_sep, h2o_trio_sep,
#   hash_evict_sep
#                   the same TUs with -DKVEVICT_SEPARATE_KERNELS=1 (fmt linked, not
#                   header-only: no FMT_HEADER_ONLY)
#   kernels_lib     src/kernels.cpp, the library's one translation unit (paid once)
# Header-only kvevict with fmt linked (libfmt, fmt::fmt) instead of header-only fmt:
#   kvevict.hpp_fmtlib, readme_fmtlib
#                   the header-only TUs without FMT_HEADER_ONLY (a build that links -lfmt;
#                   fmt's format engine, format-inl.h, is then compiled in libfmt, not here)
# Flags are what the kvevict CMake targets give a consumer: -std=c++20, Eigen's include
# dir, and FMT_HEADER_ONLY=1 (kvevict::kvevict, fmt::fmt-header-only) or
# KVEVICT_SEPARATE_KERNELS=1 (kvevict::kernels); no -march.
set -euo pipefail

runs=3
cxx=${CXX:-g++}
cases=(kvevict.hpp readme readme_narrow readme_umbrella h2o_trio hash_evict eigen_core fmt_format
       kvevict.hpp_sep readme_sep readme_narrow_sep readme_umbrella_sep h2o_trio_sep hash_evict_sep kernels_lib
       kvevict.hpp_fmtlib readme_fmtlib)
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
  # The example's own kvevict includes replaced: by the three headers it uses (narrow), or
  # by the umbrella header (whichever form README shows today).
  grep -v '^#include <kvevict/' "$out/readme.cpp" > "$out/readme_body.cpp"
  { printf '#include <kvevict/cache.hpp>\n#include <kvevict/attention.hpp>\n#include <kvevict/policies/h2o.hpp>\n'
    cat "$out/readme_body.cpp"; } > "$out/readme_narrow.cpp"
  { printf '#include <kvevict/kvevict.hpp>\n'; cat "$out/readme_body.cpp"; } > "$out/readme_umbrella.cpp"
  for c in kvevict.hpp readme readme_narrow readme_umbrella h2o_trio hash_evict; do cp "$out/$c.cpp" "$out/${c}_sep.cpp"; done
  for c in kvevict.hpp readme; do cp "$out/$c.cpp" "$out/${c}_fmtlib.cpp"; done
  [ ! -f "$root/src/kernels.cpp" ] || cp "$root/src/kernels.cpp" "$out/kernels_lib.cpp"
}

# Compiler flags of a case beyond the common ones; "skip" when the tree cannot build it.
case_flags() {  # $1 = case, $2 = tree root
  case $1 in
    *_sep|kernels_lib)
      if [ -f "$2/include/kvevict/config.hpp" ] && [ -f "$2/src/kernels.cpp" ]; then
        echo "-DKVEVICT_SEPARATE_KERNELS=1"
      else
        echo skip
      fi ;;
    *_fmtlib) echo "" ;;
    *) echo "-DFMT_HEADER_ONLY=1" ;;
  esac
}

cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
echo "CPU: $cpu ($(nproc) logical CPUs); load average: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "compiler: $($cxx --version | head -1)"
echo "command per case: $cxx -std=c++20 -O2 -I<tree>/include -I/usr/include/eigen3 <mode> -c case.cpp -o /dev/null"
echo "  <mode>: -DFMT_HEADER_ONLY=1 (header-only cases), -DKVEVICT_SEPARATE_KERNELS=1 (*_sep, kernels_lib), none (*_fmtlib)"
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
      flags=$(case_flags "$c" "$root")
      [ "$flags" != skip ] || continue
      if ! /usr/bin/time -f "%U %S" -o "$work/t" \
           "$cxx" -std=c++20 -O2 -I"$root/include" -I/usr/include/eigen3 $flags \
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
  for label in "${labels[@]}"; do
    if [ -f "$work/$label.$c.times" ]; then m=$(median "$work/$label.$c.times"); else m=n/a; fi
    vals+=("$m"); row+=" $m |"
  done
  if [ ${#labels[@]} -eq 2 ]; then
    if [ "${vals[0]}" = n/a ] || [ "${vals[1]}" = n/a ]; then row+=" n/a |"
    else row+=" $(awk -v a="${vals[0]}" -v b="${vals[1]}" 'BEGIN{printf "%.2f", b/a}') |"; fi
  fi
  echo "$row"
done
