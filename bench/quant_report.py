#!/usr/bin/env python3
"""Markdown table of the quantized decode-step rows of one bench_decode run (issue 15).

Usage: bench/quant_report.py bench/results/decode_quant.json
Reads the medians (CPU time) of attend_{f32,f16,q8,q4,e4m3} and prints per (n, Hkv) the
times and fp16-time / format-time (above 1: the format is faster than fp16 in this run).
"""
import json
import sys

data = json.load(open(sys.argv[1]))
ctx = data["context"]
med = {}
for b in data["benchmarks"]:
    if b.get("aggregate_name") != "median":
        continue
    name = b["run_name"].split("/")
    fmt = name[0].replace("attend_", "")
    n = int(name[1].split(":")[1])
    hkv = int(name[2].split(":")[1])
    med[(fmt, n, hkv)] = b["cpu_time"]
fmts = ["f32", "f16", "q8", "q4", "e4m3"]
qint_fmts = ["q8_qint", "q4_qint"]  # attend with QuantQK::integer_query (when the run has them)
print(f"- CPU: {ctx.get('cpu_model', '?')}; kvevict attention ISA: "
      f"{ctx.get('kvevict_attention_isa', '?')}; run {ctx.get('date', '?')}; "
      f"medians of {data['benchmarks'][0].get('repetitions', '?')} repetitions, CPU time (µs).")
print()
print("| Hkv | n | " + " | ".join(fmts) + " | f16 / q8 | f16 / q4 | f16 / e4m3 |")
print("|---:|---:|" + "---:|" * (len(fmts) + 3))
for hkv in sorted({k[2] for k in med}):
    for n in sorted({k[1] for k in med if k[2] == hkv}):
        row = [med.get((f, n, hkv)) for f in fmts]
        t = dict(zip(fmts, row))
        if t["f16"] is None:
            continue
        nn = f"{n // 1024}K"
        cells = " | ".join("-" if x is None else f"{x:.1f}" for x in row)
        ratio = lambda f: "-" if t[f] is None else f"{t['f16'] / t[f]:.2f}"
        print(f"| {hkv} | {nn} | {cells} | {ratio('q8')} | {ratio('q4')} | {ratio('e4m3')} |")

# kvevict::attend with AttendOptions::quant_qk = integer_query, same run.
if any(k[0] in qint_fmts for k in med):
    print()
    print("| Hkv | n | f16 | q8 exact | q8 int-query | q4 exact | q4 int-query | f16 / q8 exact | "
          "f16 / q8 int-query | f16 / q4 exact | f16 / q4 int-query |")
    print("|---:|---:|" + "---:|" * 9)
    for hkv in sorted({k[2] for k in med}):
        for n in sorted({k[1] for k in med if k[2] == hkv}):
            t = {f: med.get((f, n, hkv)) for f in ["f16", "q8", "q8_qint", "q4", "q4_qint"]}
            if None in t.values():
                continue
            r = [t["f16"] / t[f] for f in ["q8", "q8_qint", "q4", "q4_qint"]]
            print(f"| {hkv} | {n // 1024}K | {t['f16']:.1f} | {t['q8']:.1f} | {t['q8_qint']:.1f} | "
                  f"{t['q4']:.1f} | {t['q4_qint']:.1f} | " + " | ".join(f"{x:.2f}" for x in r) + " |")

# Issue 15's integer q.K (bench_decode qstep_* / pass_* rows, when the run has them).
q = {}
for b in data["benchmarks"]:
    if b.get("aggregate_name") != "median" or not b["run_name"].startswith(("qstep_", "pass_")):
        continue
    name = b["run_name"].split("/")
    q[(name[0], int(name[1].split(":")[1]), int(name[2].split(":")[1]))] = b["cpu_time"]
if q:
    print()
    print("| Hkv | n | f16 | q8 exact | q8 qint | q4 exact | q4 qint | f16 / q8 qint | f16 / q4 qint |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for hkv in sorted({k[2] for k in q}):
        for n in sorted({k[1] for k in q if k[2] == hkv}):
            f16 = med.get(("f16", n, hkv))
            row = [q.get((k, n, hkv)) for k in ("qstep_q8", "qstep_q8_qint", "qstep_q4", "qstep_q4_qint")]
            if f16 is None or None in row:
                continue
            print(f"| {hkv} | {n // 1024}K | {f16:.1f} | " + " | ".join(f"{x:.1f}" for x in row) +
                  f" | {f16 / row[1]:.2f} | {f16 / row[3]:.2f} |")
    passes = [("pass_qk_f16", "q.K f16"), ("pass_qk_q8", "q.K q8"), ("pass_qk_q8_qint", "q.K q8 qint"),
              ("pass_qk_q4", "q.K q4"), ("pass_qk_q4_qint", "q.K q4 qint"), ("pass_pv_f16", "p.V f16"),
              ("pass_pv_q8", "p.V q8"), ("pass_pv_q4", "p.V q4")]
    ns = sorted({k[1] for k in q if k[0].startswith("pass_")})
    if ns:
        print()
        print("| pass (Hkv = 1) | " + " | ".join(f"{n // 1024}K µs" for n in ns) + " |")
        print("|---|" + "---:|" * len(ns))
        for key, label in passes:
            print(f"| {label} | " + " | ".join(f"{q.get((key, n, 1), float('nan')):.1f}" for n in ns) + " |")
