#!/usr/bin/env bash
# Each public header compiles on its own (issue 19: a file includes only what it uses, so
# every header must bring what it needs): `-fsyntax-only` on a translation unit holding
# one `#include <kvevict/...>`, in both modes (header-only, and KVEVICT_SEPARATE_KERNELS as
# the kvevict::kernels target gives it).
#   scripts/check_headers.sh [compiler ...]     default: g++ and clang++-14 where present
# Skipped: the bodies included by their owner only (kernels/*_body.hpp) and
# extern_templates.hpp (included at the end of its users, no include guard on purpose).
# Prints each failure with the compiler's first lines; exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
compilers=("$@")
if [ ${#compilers[@]} -eq 0 ]; then
  for c in g++ clang++-14; do command -v "$c" > /dev/null && compilers+=("$c"); done
fi
eigen=$(pkg-config --cflags eigen3 2>/dev/null || echo -I/usr/include/eigen3)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
checked=0 failed=0
for cxx in "${compilers[@]}"; do
  for h in $(cd include && find kvevict -name '*.hpp' | sort); do
    case $h in *_body.hpp | kvevict/extern_templates.hpp) continue ;; esac
    printf '#include <%s>\n' "$h" > "$work/tu.cpp"
    for mode in "" "-DKVEVICT_SEPARATE_KERNELS=1"; do
      checked=$((checked + 1))
      # shellcheck disable=SC2086
      if ! "$cxx" -std=c++20 -fsyntax-only -Iinclude $eigen $mode "$work/tu.cpp" > "$work/err" 2>&1; then
        failed=$((failed + 1))
        echo "FAILED: $cxx ${mode:-(header-only)} <$h>"
        head -5 "$work/err"
      fi
    done
  done
done
echo "headers alone: $((checked - failed)) passed, $failed failed (${compilers[*]}; header-only and separate-kernels)"
[ "$failed" -eq 0 ]
