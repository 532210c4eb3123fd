#!/usr/bin/env bash
# The main demo: every policy side by side on the built-in "mixed" synthetic workload
# (sinks, recency, heavy hitters, needles, drifting topics), budgets 10% to 70%.
# Installs missing Debian packages, builds kvevict-eval (Release) and runs it; extra
# arguments go to kvevict-eval (see --help), e.g. --workload all, --model DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target kvevict-eval
if [ $# -eq 0 ]; then
  set -- --workload mixed --prompt 128 --steps 384 --budgets 0.1,0.3,0.5,0.7 \
         --svg build/demo.svg
fi
./build/examples/eval/kvevict-eval "$@"
echo "plot: build/demo.svg (when --svg was given)" >&2
