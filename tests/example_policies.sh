#!/usr/bin/env bash
# Every policy of the shared registry through every example program once (small settings),
# and the tools' handling of bad numeric arguments: exit status 2, exactly one line on
# stderr, nothing on stdout. Usage: example_policies.sh BUILD_EXAMPLES_DIR MODEL_DIR
# Exit 77 (skipped) when the llama2.c model is missing.
set -uo pipefail
bin=$1
model=$2
[ -f "$model/stories260K.bin" ] || { echo "no model at $model: skipped"; exit 77; }
export KVEVICT_MODEL_DIR=$model
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
policies=$("$bin/eval/kvevict-eval" --list | awk '/^policies:/{p=1;next} /^synthetic/{p=0} p{print $1}')
[ -n "$policies" ] || { echo "FAIL: kvevict-eval --list printed no policies"; exit 1; }
prompt_policies="xkv pyramidkv uniform-w8"   # need the prompt's keys and queries

# expect STATUS CMD...: runs CMD, checks its exit status; on 2 also exactly one stderr line.
expect() {
  local want=$1; shift
  "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [ "$rc" -ne "$want" ]; then
    echo "FAIL (exit $rc, expected $want): $*"; sed 's/^/    /' "$tmp/err" | tail -3
    fails=$((fails + 1)); return
  fi
  if [ "$want" -eq 2 ]; then
    local n; n=$(wc -l <"$tmp/err")
    if [ "$n" -ne 1 ] || [ -s "$tmp/out" ]; then
      echo "FAIL ($n stderr lines, stdout $(wc -c <"$tmp/out") bytes; expected 1 and 0): $*"
      sed 's/^/    /' "$tmp/err" | head -5; fails=$((fails + 1)); return
    fi
  fi
  echo "ok (exit $rc): $*"
}

for p in $policies; do
  prompt_only=0; case " $prompt_policies " in *" $p "*) prompt_only=1;; esac
  bounded=1; case "$p" in full|oracle) bounded=0;; esac
  expect 0 "$bin/eval/kvevict-eval" --policies "$p" --steps 48 --prompt 48 --layers 1 \
    --budgets 40 --quiet
  llama_want=0; [ $prompt_only -eq 1 ] && llama_want=2
  expect $llama_want "$bin/llama2c/llama2c" --policy "$p" --budget 40 --steps 64
  expect $llama_want "$bin/llama2c/llama2c_e2e" --policies "$p" --streams 1 --tokens 64 \
    --budgets 40
  expect $llama_want "$bin/headline/llama2c_headline" --policies "$p" --streams 4 --budgets 40
  expect $llama_want "$bin/headline/llama2c_diagnose" --policies "$p" --streams 1 --budgets 40 \
    --no-synthetic --hash-stride 64
  serving_want=0; [ $prompt_only -eq 1 ] || [ "$p" = oracle ] && serving_want=2
  expect $serving_want "$bin/serving/llama2c_serving" --policies "$p" --requests 2 --tokens 48 \
    --budget 40 --pool-blocks 120 --quiet
  engine_want=0; [ $prompt_only -eq 1 ] || [ $bounded -eq 0 ] && engine_want=2
  expect $engine_want "$bin/engine_owned/kvevict_engine_owned" 64 40 --policy "$p"
done

# Bad numbers: one line, exit 2, before any model line.
for args in "--temperature nan" "--temperature -1" "--top-p nan" "--top-p 0" "--top-p 1.5" \
            "--budget 0" "--steps 1e3" "--steps -5" "--seed -1" "--sinks x" "--budget"; do
  # shellcheck disable=SC2086
  expect 2 "$bin/llama2c/llama2c" $args
done
expect 2 "$bin/llama2c/llama2c" --policy full --steps 600
expect 2 "$bin/llama2c/llama2c_e2e" --temperature inf
expect 2 "$bin/llama2c/llama2c_e2e" --budgets 16,0
expect 2 "$bin/headline/llama2c_headline" --streams 6
expect 2 "$bin/headline/llama2c_diagnose" --hash-stride 0
expect 2 "$bin/headline/llama2c_diagnose" --tokens 600   # past stories260K's 512 positions
expect 2 "$bin/headline/llama2c_headline" --prefill-block 0
expect 2 "$bin/headline/llama2c_headline" --haystack-large --tune   # held out only
expect 2 "$bin/eval/kvevict-eval" --prefill-block -1
expect 2 "$bin/eval/kvevict-eval" --topk nan
expect 2 "$bin/eval/kvevict-eval" --policies nope
expect 2 "$bin/engine_owned/kvevict_engine_owned" 12x
expect 2 "$bin/serving/llama2c_serving" --pool-blocks 0
expect 2 "$bin/serving/llama2c_serving" --tokens 600
expect 2 "$bin/serving/llama2c_serving" --tokens 64 --min-tokens 65
expect 2 "$bin/serving/llama2c_serving" --tokens 64 --pool-blocks 10 --policies full
# Past the trained length with a bounded cache, both position modes.
expect 0 "$bin/llama2c/llama2c" --policy decayed --budget 16 --steps 600 --keep-going
expect 0 "$bin/llama2c/llama2c" --policy streaming --budget 16 --steps 600 --keep-going \
  --positions reindex
[ "$fails" -eq 0 ] || { echo "$fails failures"; exit 1; }
echo "all passed"
