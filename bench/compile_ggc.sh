#!/usr/bin/env bash
# Load-independent proxy of compile cost (issue 19): g++'s GGC memory (the TOTAL line of
# -ftime-report, in M) for the TUs of bench/compile_time.sh, one run each (deterministic).
#   bench/compile_ggc.sh [LABEL=TREE ...]     default: this checkout
# Cases: eigen_core, kvevict.hpp_sep, readme_sep (-DKVEVICT_SEPARATE_KERNELS=1),
# kvevict.hpp, readme (-DFMT_HEADER_ONLY=1), at -std=c++20 -O2 as compile_time.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
trees=("$@"); [ ${#trees[@]} -gt 0 ] || trees=("this=$here")
cxx=${CXX:-g++}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
echo "compiler: $($cxx --version | head -1); load average: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "| tree | eigen_core | kvevict.hpp_sep | readme_sep | kvevict.hpp | readme |"
echo "|---|---:|---:|---:|---:|---:|"
for t in "${trees[@]}"; do
  label=${t%%=*}; root=${t#*=}
  awk '/<!-- usage-example-begin -->/{inside=1; next} /<!-- usage-example-end -->/{inside=0}
       inside && /^```cpp/{code=1; next} inside && code && /^```/{code=0; next}
       inside && code {print}' "$root/README.md" > "$work/readme.cpp"
  printf '#include <kvevict/kvevict.hpp>\n' > "$work/k.cpp"
  printf '#include <Eigen/Core>\n' > "$work/e.cpp"
  ggc() { "$cxx" -std=c++20 -O2 -I"$root/include" -I/usr/include/eigen3 "$@" -ftime-report \
            -o /dev/null 2>&1 | awk '/TOTAL/{print $NF}'; }
  echo "| $label | $(ggc -c "$work/e.cpp") | $(ggc -DKVEVICT_SEPARATE_KERNELS=1 -c "$work/k.cpp") |" \
       "$(ggc -DKVEVICT_SEPARATE_KERNELS=1 -c "$work/readme.cpp") | $(ggc -DFMT_HEADER_ONLY=1 -c "$work/k.cpp") |" \
       "$(ggc -DFMT_HEADER_ONLY=1 -c "$work/readme.cpp") |"
done
