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
print(f"- CPU: {ctx.get('cpu_model', '?')}; kvevict attention ISA: "
      f"{ctx.get('kvevict_attention_isa', '?')}; run {ctx.get('date', '?')}; "
      f"medians of {data['benchmarks'][0].get('repetitions', '?')} repetitions, CPU time (µs).")
print()
print("| Hkv | n | " + " | ".join(fmts) + " | f16 / q8 | f16 / q4 | f16 / e4m3 |")
print("|---:|---:|" + "---:|" * (len(fmts) + 3))
for hkv in sorted({k[2] for k in med}):
    for n in sorted({k[1] for k in med if k[2] == hkv}):
        row = [med.get((f, n, hkv)) for f in fmts]
        if None in row:
            continue
        t = dict(zip(fmts, row))
        nn = f"{n // 1024}K"
        cells = " | ".join(f"{x:.1f}" for x in row)
        print(f"| {hkv} | {nn} | {cells} | {t['f16'] / t['q8']:.2f} | {t['f16'] / t['q4']:.2f} | "
              f"{t['f16'] / t['e4m3']:.2f} |")
