#!/usr/bin/env bash
# kvevict-eval --kv-format (tests/kv_format.cmake): one small stories260K run of the full
# cache and DecayedAttention in fp32, Q8<8> and Q4<8>, checked against what must hold
# (bytes per row from the formats' layouts, the bytes held, the fp32 full cache equal to
# the reference, 8 bits closer to it than 4), one small synthetic run (head_dim 128), and
# the option's bad-argument handling.
# Usage: kv_format_test.sh KVEVICT_EVAL MODEL_DIR. Exit 77 (skipped) without the model.
set -uo pipefail
eval_bin=$1
model=$2
[ -f "$model/stories260K.bin" ] || { echo "no model at $model: skipped"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

"$eval_bin" --model "$model" --steps 96 --policies full,decayed --budgets 40 \
  --kv-format fp32,q8g8,q4g8 --csv "$tmp/out.csv" --quiet >"$tmp/stdout" 2>"$tmp/stderr" ||
  { fail "kvevict-eval exited $?"; cat "$tmp/stderr"; exit 1; }
cat "$tmp/stdout"

# column of a CSV row: field POLICY FORMAT COLUMN
field() {
  awk -F, -v p="$1" -v f="$2" -v c="$3" '
    NR == 1 { for (i = 1; i <= NF; ++i) col[$i] = i; next }
    $1 == p && $2 == f { print $col[c]; found = 1 }
    END { if (!found) print "missing" }' "$tmp/out.csv"
}
# stories260K: head_dim 8. fp32 row: K + V = 2 x 8 x 4 bytes; Q8<8>: 2 x (fp16 scale + 8
# int8); Q4<8>: 2 x (fp16 scale + 8 nibbles).
for spec in fp32:64 q8g8:20 q4g8:12; do
  f=${spec%%:*} want=${spec##*:}
  for p in full decayed; do
    got=$(field "$p" "$f" row_bytes)
    [ "$got" = "$want" ] || fail "$p $f row_bytes = $got, expected $want"
  done
  got=$(field full "$f" kv_bytes)
  [ "$got" = "$((96 * want))" ] || fail "full $f kv_bytes = $got, expected 96 rows x $want"
  got=$(field decayed "$f" kv_bytes)
  [ "$got" = "$((40 * want))" ] || fail "decayed $f kv_bytes = $got, expected 40 rows x $want"
done

# awk -v a=.. -v b=.. 'COND': exit 0 when COND holds for the numbers a and b.
holds() { awk -v a="$1" -v b="$2" "BEGIN { exit !($3) }"; }
kl_fp32=$(field full fp32 mean_kl)
kl_q8=$(field full q8g8 mean_kl)
kl_q4=$(field full q4g8 mean_kl)
kl_dec=$(field decayed fp32 mean_kl)
kl_dec4=$(field decayed q4g8 mean_kl)
echo "full-cache KL: fp32 $kl_fp32, q8g8 $kl_q8, q4g8 $kl_q4; decayed at 40 rows: fp32 $kl_dec, q4g8 $kl_dec4"
# The fp32 full cache is the reference up to the block prefill's float rounding.
holds "$kl_fp32" 0 'a >= 0 && a < 1e-6' || fail "full fp32 KL $kl_fp32, expected < 1e-6"
holds "$kl_q8" "$kl_fp32" 'a > 1e-6 && a > 10 * b' || fail "full q8g8 KL $kl_q8 not above fp32's $kl_fp32"
holds "$kl_q8" "$kl_q4" 'a < b' || fail "full q8g8 KL $kl_q8 not below q4g8's $kl_q4"
holds "$kl_dec" "$kl_fp32" 'a > b' || fail "decayed fp32 KL $kl_dec not above the full cache's"

# A mixed layout (f16+q8g8, --hot-rows 8): 8 fp16 rows (32 bytes) + older rows Q8<8> (20):
# bytes held 8 x 32 + (rows - 8) x 20; the fp16 band brings the full cache's KL below the
# Q8<8> full cache's; a band above the budget is the cache's error (exit 2, message names R).
"$eval_bin" --model "$model" --steps 96 --policies full,decayed --budgets 40 \
  --kv-format f16+q8g8 --hot-rows 8 --csv "$tmp/out.csv" --quiet >"$tmp/stdout" 2>"$tmp/stderr" ||
  { fail "kvevict-eval (mixed) exited $?"; cat "$tmp/stderr"; }
[ "$(field full f16+q8g8 row_bytes)" = 20 ] || fail "mixed row_bytes $(field full f16+q8g8 row_bytes), expected 20 (cold)"
[ "$(field full f16+q8g8 kv_bytes)" = $((8 * 32 + 88 * 20)) ] ||
  fail "mixed full kv_bytes $(field full f16+q8g8 kv_bytes), expected 8 x 32 + 88 x 20"
[ "$(field decayed f16+q8g8 kv_bytes)" = $((8 * 32 + 32 * 20)) ] ||
  fail "mixed decayed kv_bytes $(field decayed f16+q8g8 kv_bytes), expected 8 x 32 + 32 x 20"
kl_mix=$(field full f16+q8g8 mean_kl)
echo "full-cache KL: f16+q8g8 (8 fp16 rows) $kl_mix, q8g8 $kl_q8"
holds "$kl_mix" "$kl_q8" 'a > 0 && a < b' || fail "full f16+q8g8 KL $kl_mix not in (0, q8g8's $kl_q8)"
"$eval_bin" --model "$model" --steps 16 --policies decayed --budgets 40 --kv-format f16+q8g8 \
  --hot-rows 41 --quiet >"$tmp/o" 2>"$tmp/e"
[ $? = 2 ] && grep -q "R = 41 exceeds the capacity 40" "$tmp/e" ||
  { fail "--hot-rows 41 with 40 rows: expected exit 2 naming R"; cat "$tmp/e"; }

# The synthetic workloads (head_dim 128) in fp32 and Q8<8>: the full cache's output error
# is 0 in fp32 and above 0 in Q8<8>; row bytes 2 x 128 x 4 and 2 x 16 x (2 + 8).
"$eval_bin" --workload mixed --layers 1 --prompt 16 --steps 16 --policies full,streaming \
  --budgets 24 --kv-format fp32,q8g8 --csv "$tmp/syn.csv" --quiet >"$tmp/stdout" 2>"$tmp/stderr" ||
  { fail "kvevict-eval (synthetic) exited $?"; cat "$tmp/stderr"; }
sfield() {
  awk -F, -v p="$1" -v f="$2" -v c="$3" '
    NR == 1 { for (i = 1; i <= NF; ++i) col[$i] = i; next }
    $2 == p && $3 == f { print $col[c]; found = 1 }
    END { if (!found) print "missing" }' "$tmp/syn.csv"
}
[ "$(sfield full fp32 row_bytes)" = 1024 ] || fail "synthetic fp32 row_bytes $(sfield full fp32 row_bytes)"
[ "$(sfield full q8g8 row_bytes)" = 320 ] || fail "synthetic q8g8 row_bytes $(sfield full q8g8 row_bytes)"
[ "$(sfield streaming q8g8 kv_bytes)" = $((24 * 320)) ] ||
  fail "synthetic streaming q8g8 kv_bytes $(sfield streaming q8g8 kv_bytes)"
e32=$(sfield full fp32 output_error) e8=$(sfield full q8g8 output_error)
echo "synthetic full-cache output error: fp32 $e32, q8g8 $e8"
holds "$e32" 0 'a == 0' || fail "synthetic full fp32 output error $e32, expected 0"
holds "$e8" 0 'a > 0 && a < 0.1' || fail "synthetic full q8g8 output error $e8, expected in (0, 0.1)"

# expect_usage ARGS...: exit status 2, one line on stderr, nothing on stdout.
expect_usage() {
  "$eval_bin" "$@" >"$tmp/o" 2>"$tmp/e"
  local rc=$?
  if [ "$rc" -ne 2 ] || [ "$(wc -l <"$tmp/e")" -ne 1 ] || [ -s "$tmp/o" ]; then
    fail "expected exit 2 and one stderr line (got $rc): $*"; head -3 "$tmp/e"
  else
    echo "ok (usage error): $* -> $(cat "$tmp/e")"
  fi
}
expect_usage --model "$model" --kv-format q9 --steps 16
expect_usage --model "$model" --kv-format fp32, --steps 16
expect_usage --model "$model" --kv-format q8g8 --policies knorm --steps 16
expect_usage --kv-format q8g8,fp16 --svg "$tmp/x.svg" --steps 16
expect_usage --streams 2 --steps 16

[ "$fails" -eq 0 ] || { echo "$fails failure(s)"; exit 1; }
echo "all kv-format checks passed"
