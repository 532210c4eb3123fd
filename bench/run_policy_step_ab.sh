#!/usr/bin/env bash
# A/B timing of the policy step against the attend step: two bench_policy_step binaries
# (say, one built from main and one from a branch), run alternately ROUNDS times in one
# session so both see the same load, then one table of medians (CPU µs per step; each
# binary's policy step divided by the attend step measured in its own process).
# Usage: bench/run_policy_step_ab.sh OLD_BINARY NEW_BINARY [OUT_DIR]
#   ROUNDS=3 REPS=3 MIN_TIME=0.2 FILTER='BM_(attend|policy/decayed_recommended|policy/h2o)/(1024|4096|16384|65536)/8$'
set -euo pipefail
old=$1 new=$2 out=${3:-$(mktemp -d)}
rounds=${ROUNDS:-3}
filter=${FILTER:-'BM_(attend|policy/decayed_recommended|policy/h2o)/(1024|4096|16384|65536)/8$'}
mkdir -p "$out"
for ((r = 1; r <= rounds; ++r)); do
  for tag in old new; do
    bin=$old
    [[ $tag == new ]] && bin=$new
    "$bin" --benchmark_filter="$filter" --benchmark_repetitions="${REPS:-3}" \
      --benchmark_report_aggregates_only=true --benchmark_min_time="${MIN_TIME:-0.2}" \
      --benchmark_format=json > "$out/${tag}_$r.json"
    echo "$tag round $r done $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  done
done
python3 - "$out" <<'PY'
import glob, json, re, statistics, sys
out = sys.argv[1]
res = {}  # (tag, benchmark) -> [median of each round]
for f in sorted(glob.glob(f"{out}/*_[0-9]*.json")):
    tag = f.rsplit("/", 1)[1].split("_")[0]
    txt = open(f).read()
    for b in json.loads(txt[txt.index("{"):])["benchmarks"]:  # after the CPU line
        if b.get("aggregate_name") != "median":
            continue
        unit = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[b["time_unit"]]
        res.setdefault((tag, b["run_name"]), []).append(b["cpu_time"] * unit)
med = lambda tag, name: statistics.median(res[(tag, name)])
policies = sorted({re.sub(r"/\d+/\d+$", "", k[1]) for k in res} - {"BM_attend"})
sizes = sorted({tuple(map(int, k[1].rsplit("/", 2)[1:])) for k in res})
print("| n | Hkv | attend old / new | " + " | ".join(
    f"{p.split('/')[-1]} old | new | new/old | old % attend | new % attend" for p in policies) + " |")
print("|" + "---:|" * (3 + 5 * len(policies)))
for n, h in sizes:
    ao, an = med("old", f"BM_attend/{n}/{h}"), med("new", f"BM_attend/{n}/{h}")
    cells = [f"{n}", f"{h}", f"{ao:.0f} / {an:.0f}"]
    for p in policies:
        po, pn = med("old", f"{p}/{n}/{h}"), med("new", f"{p}/{n}/{h}")
        cells += [f"{po:.1f}", f"{pn:.1f}", f"{pn / po:.2f}", f"{100 * po / ao:.2f}%", f"{100 * pn / an:.2f}%"]
    print("| " + " | ".join(cells) + " |")
print()
for k in sorted(res):
    print(*k, "round medians:", ", ".join(f"{x:.1f}" for x in res[k]))
PY
