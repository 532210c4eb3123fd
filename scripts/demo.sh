#!/usr/bin/env bash
# The main demo: every policy side by side on the built-in synthetic workloads.
# Installs missing Debian packages, builds kvevict-eval (Release) and runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target kvevict-eval
./build/examples/eval/kvevict-eval "$@"
