#!/usr/bin/env bash
# Checks the engine on the real stories260K checkpoint (not a unit test: it needs shared/).
#   examples/llama2c/check_stories260k.sh BUILD_DIR [MODEL_DIR]
# 1. greedy decoding from BOS must start with the README's known-good text;
# 2. prints the reference table's reproduction (docs/engine.md has the figures).
set -euo pipefail
build=${1:?usage: check_stories260k.sh BUILD_DIR [MODEL_DIR]}
here=$(cd "$(dirname "$0")" && pwd)
dir=${2:-${KVEVICT_MODEL_DIR:-$here/../../../shared/models/stories260K}}
bin=$build/examples/llama2c
expected="Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball."
got=$("$bin/llama2c" --model-dir "$dir" --steps 256 2>/dev/null)
if [[ "$got" != "$expected"* ]]; then
  echo "FAIL: greedy output differs from the known-good text" >&2
  echo "got: $got" >&2
  exit 1
fi
echo "OK: greedy output matches the known-good text"
"$bin/llama2c_e2e" --model-dir "$dir" --streams 4 --tokens 512 --temperature 1.0 \
  --seed 0 --sinks 1 --h2o-recent-fraction 0.25 --random-recent-fraction 0.25 \
  --budgets 16,32,64,128 --policies streaming,h2o,hashevict,buzz,random,oracle
