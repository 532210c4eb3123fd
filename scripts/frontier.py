#!/usr/bin/env python3
"""The memory/quality frontier of docs/quality.md: error against bytes per (layer, KV head)
for the full cache in every storage format and the recommended policies at the row
budgets that fill the same memory sizes in every format.

  scripts/frontier.py [--study stories260K|synthetic] [--eval build/examples/eval/kvevict-eval]
                      [--model DIR] [--out DIR] [--analyze-only] [--resume]

stories260K (default): kvevict-eval --model --kv-format, KL(full fp32 || configuration),
once per stream set and format: the tuning streams (seeds 0..7) and the held-out streams
(seeds 1000..1015), as llama2c_headline splits them. synthetic: the head-dim-128 `mixed` workload (kvevict-eval --workload mixed
--prompt 128 --steps 384), attention-output relative error, tuning seed 1, held-out seed 2.

Every configuration is chosen on the tuning set and reported on the held-out set. Writes,
in --out (default docs/quality/frontier): the CSVs (<study>-<set>-<format>.csv),
<study>.md (tables), <study>.svg (every policy and format) and <study>-best.svg (the
chosen configuration, pure eviction, pure quantization and the best mix at each memory
size), plain SVG in docs/img/plot_style.py's style. --analyze-only reuses the CSVs;
--resume keeps the CSVs already written."""
import argparse, csv, math, os, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs", "img"))
from plot_style import panels_svg  # noqa: E402

T = 512  # tokens per stream / workload: the full cache holds T rows
# Memory sizes: the bytes of R fp16 rows per (layer, KV head). Each format gets the most
# rows that fit: floor(bytes / its row bytes); at T rows or more, its full cache.
FP16_ROWS = [32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512]
POLICIES = ["decayed", "probfree", "streaming", "h2o"]
# Formats whose budgets are swept; the others run as full caches only: fp32 (the
# reference), bf16 (fp16's size, less precise), and the two with 4-bit keys in groups of 8
# (q4g8, k4v8), whose full caches are already far worse than any other configuration of
# their size (docs/quality.md): evicting rows on top of them was not measured.
SWEPT = ["fp16", "q8g8", "e4m3", "q4g4", "k8v4"]
FULL_ONLY = ["fp32", "bf16", "q4g8", "k4v8"]
UNQUANTIZED = {"fp32", "fp16", "bf16"}
# Mixed layouts (include/kvevict/mixed.hpp, kvevict-eval --hot-rows R): the R most recent
# rows of each (layer, KV head) in fp16, older rows in the cold format; one run per (format,
# R) with the recommended policies and the full cache. A configuration's format reads
# "f16+k8v4 R32".
MIXED = ["f16+q8g8", "f16+k8v4"]
HOT_ROWS = {"stories260K": [16], "synthetic": [16, 64]}  # band sizes run per study
MIXED_POLICIES = ["decayed", "probfree"]

STUDIES = {
    "stories260K": {
        "head_dim": 8, "metric": "mean_kl", "metric_name": "KL", "ymin": 1e-5,
        "sets": {"tune": (0, 8), "report": (1000, 16)},  # first seed, streams
        "what": "stories260K, KL(full fp32 || configuration) per token", "short": "stories260K, KL",
        "sets_text": "8 tuning streams (seeds 0..7), reported on 16 held-out streams (seeds 1000..1015)",
    },
    "synthetic": {
        "head_dim": 128, "metric": "output_error", "metric_name": "output error", "ymin": 1e-3,
        "sets": {"tune": (1, 1), "report": (2, 1)},  # seed, (one workload)
        "what": "synthetic `mixed` workload (head_dim 128), attention-output relative error",
        "short": "synthetic mixed (head_dim 128), output error",
        "sets_text": "the workload at seed 1, reported at seed 2",
    },
}


def mixed_parts(fmt):
    """"f16+k8v4 R32" -> ("f16+k8v4", "k8v4", 32); None for a single format."""
    if "+" not in fmt:
        return None
    name, _, r = fmt.partition(" R")
    return name, name.split("+")[1], int(r) if r else 0


def head_bytes(fmt, d, rows):
    """Bytes `rows` rows take per (layer, KV head): a mixed layout's first R in fp16."""
    m = mixed_parts(fmt)
    if m is None:
        return rows * row_bytes_of(fmt, d)
    hot = min(rows, m[2])
    return hot * row_bytes_of("fp16", d) + (rows - hot) * row_bytes_of(m[1], d)


def row_bytes_of(fmt, d):
    """Key + value row bytes of each format at head_dim d (quantized.hpp's layouts; a mixed
    layout's cold rows)."""
    if mixed_parts(fmt):
        fmt = mixed_parts(fmt)[1]
    q8 = lambda g: d // g * (2 + g)
    q4 = lambda g: d // g * (2 + g // 2)
    return {"fp32": 8 * d, "fp16": 4 * d, "bf16": 4 * d, "q8g8": 2 * q8(8), "q4g8": 2 * q4(8),
            "q4g4": 2 * q4(4), "e4m3": 2 * d, "k8v4": q8(8) + q4(8), "k4v8": q4(8) + q8(8)}[fmt]


def unit(study):
    """Bytes of one fp16 row: the memory sizes are multiples of it."""
    return row_bytes_of("fp16", STUDIES[study]["head_dim"])


def budgets_for(study, fmt):
    rb = row_bytes_of(fmt, STUDIES[study]["head_dim"])
    return sorted({(unit(study) * r) // rb for r in FP16_ROWS if (unit(study) * r) // rb < T})


def mixed_budgets(study, fmt, R):
    """Rows of a mixed layout filling each memory size: R fp16 rows, the rest cold."""
    d = STUDIES[study]["head_dim"]
    out = set()
    for r in FP16_ROWS:
        m = unit(study) * r
        if m < R * row_bytes_of("fp16", d):
            continue
        rows = R + (m - R * row_bytes_of("fp16", d)) // row_bytes_of(fmt, d)
        if rows < T:
            out.add(rows)
    return sorted(out)


def csv_path(args, name, fmt, R=None):
    return os.path.join(args.out, f"{args.study}-{name}-{fmt}" + (f"-R{R}" if R is not None else "") + ".csv")


def formats_and_runs(study):
    """(format, hot rows R or None) of every kvevict-eval run."""
    runs = [(fmt, None) for fmt in FULL_ONLY + SWEPT]
    runs += [(fmt, R) for fmt in MIXED for R in HOT_ROWS[study]]
    return runs


def run(args):
    os.makedirs(args.out, exist_ok=True)
    st = STUDIES[args.study]
    for name, (seed, streams) in st["sets"].items():
        for fmt, R in formats_and_runs(args.study):
            out = csv_path(args, name, fmt, R)
            if args.resume and os.path.exists(out):  # kvevict-eval writes it when done
                continue
            if R is not None:
                budgets = mixed_budgets(args.study, fmt, R)
                policies = ["full"] + MIXED_POLICIES
            else:
                budgets = budgets_for(args.study, fmt) if fmt in SWEPT else [T]
                policies = ["full"] + (POLICIES if fmt in SWEPT else [])
            cmd = [args.eval, "--seed", str(seed), "--policies", ",".join(policies),
                   "--budgets", ",".join(map(str, budgets)), "--kv-format", fmt, "--csv", out, "--quiet"]
            if R is not None:
                cmd += ["--hot-rows", str(R)]
            if args.study == "stories260K":
                cmd += ["--model", args.model, "--streams", str(streams)]
            else:
                cmd += ["--workload", "mixed", "--prompt", "128", "--steps", str(T - 128)]
            t0 = time.time()
            subprocess.run(["nice"] + cmd, check=True, stdout=subprocess.DEVNULL)
            print(f"{args.study} {name} {fmt}: {time.time() - t0:.0f} s ({' '.join(cmd)})", file=sys.stderr)


def load(args, name):
    st = STUDIES[args.study]
    rows = {}
    for fmt, R in formats_and_runs(args.study):
        with open(csv_path(args, name, fmt, R)) as f:
            for r in csv.DictReader(f):
                full = f"{r['format']} R{R}" if R is not None else r["format"]
                assert int(r["row_bytes"]) == row_bytes_of(full, st["head_dim"]), r
                c = (r["policy"], full, int(r["budget_tokens"]) or T)
                assert int(r["kv_bytes"]) == head_bytes(full, st["head_dim"], c[2]), r
                rows[c] = {"bytes": int(r["kv_bytes"]), "err": float(r[st["metric"]]), "raw": r}
    return rows


def kind(c):
    """full (the fp32 reference), evict (16-bit rows, fewer of them or all: pure eviction),
    quant (every row, quantized: pure quantization), mix (fewer rows, quantized) or layout
    (a mixed layout: recent rows fp16, older rows quantized; any number of rows)."""
    policy, fmt, _ = c
    if policy == "full" and fmt == "fp32":
        return "full"
    if mixed_parts(fmt):
        return "layout"
    if fmt in UNQUANTIZED:
        return "evict"
    return "quant" if policy == "full" else "mix"


def label(c):
    policy, fmt, rows = c
    return f"full cache, {fmt}" if policy == "full" else f"{policy}, {fmt}, {rows} rows"


def analyze(args):
    st = STUDIES[args.study]
    d, u, mn = st["head_dim"], unit(args.study), st["metric_name"]
    tune, report = load(args, "tune"), load(args, "report")
    assert tune.keys() == report.keys(), set(tune) ^ set(report)
    levels = [u * r for r in FP16_ROWS]
    pick = lambda cands: min(cands, key=lambda c: (tune[c]["err"], tune[c]["bytes"])) if cands else None
    table = []
    for m in levels:
        fits = [c for c in tune if tune[c]["bytes"] <= m]
        best = {k: pick([c for c in fits if kind(c) == k]) for k in ("evict", "quant", "mix", "layout")}
        table.append((m, pick(fits), best))
    err = lambda c: report[c]["err"]

    md, verdicts = [], []
    w = md.append
    w(f"| bytes per (layer, KV head) | = fp16 rows | kvevict's configuration (chosen on the tuning set) | "
      f"its held-out {mn} | pure eviction (16-bit rows) | {mn} | pure quantization (every row) | {mn} | "
      f"best mix (fewer rows, quantized) | {mn} | mix beats both pure forms? | "
      f"best mixed layout (recent rows fp16) | {mn} | layout beats eviction / quantization / uniform mix? |")
    w("|---:|---:|---|---:|---|---:|---|---:|---|---:|---|---|---:|---|")
    for m, rec, best in table:
        ev, qu, mx, la = best["evict"], best["quant"], best["mix"], best["layout"]
        cell = lambda c: label(c) if c else "none fits"
        num = lambda c: f"{err(c):.3g}" if c else "-"
        if mx and ev and qu:
            verdict = "**yes**" if err(mx) < min(err(ev), err(qu)) else "no"
        elif mx and ev:
            verdict = ("yes, over eviction (no quantized full cache fits)" if err(mx) < err(ev)
                       else "no (no quantized full cache fits)")
        else:
            verdict = "no mix"
        verdicts.append((m, verdict, rec))
        yn = lambda other: "-" if not (la and other) else ("yes" if err(la) < err(other) else "no")
        lv = f"{yn(ev)} / {yn(qu)} / {yn(mx)}"
        w(f"| {m} | {m // u} | **{cell(rec)}** | {num(rec)} | {cell(ev)} | {num(ev)} | {cell(qu)} | "
          f"{num(qu)} | {cell(mx)} | {num(mx)} | {verdict} | {cell(la)} | {num(la)} | {lv} |")
    w("")
    w(f"#### full cache in each format ({mn}: held-out, tuning)")
    w("")
    extra = args.study == "stories260K"
    w("| format | bytes per token | bytes per (layer, KV head) | held-out | tuning |" +
      (" top-1 | perplexity |" if extra else ""))
    w("|---|---:|---:|---:|---:|" + ("---:|---:|" if extra else ""))
    for c in sorted((c for c in report if c[0] == "full"), key=lambda c: -report[c]["bytes"]):
        r = report[c]
        w(f"| {c[1]} | {row_bytes_of(c[1], d)}{' (cold)' if mixed_parts(c[1]) else ''} | {r['bytes']} | {r['err']:.6f} | {tune[c]['err']:.6f} |" +
          (f" {float(r['raw']['top1']):.4f} | {float(r['raw']['perplexity']):.3f} |" if extra else ""))
    if extra:
        w(f"\n(perplexity of the held-out streams under the fp32 full cache: "
          f"{float(report[('full', 'fp32', T)]['raw']['perplexity_full']):.3f})")
    w("")
    for policy in POLICIES:
        w(f"#### {policy}: held-out {mn} (tuning in parentheses) and rows held, by memory size")
        w("")
        w("| format | " + " | ".join(f"{m}" for m in levels) + " |")
        w("|---|" + "---:|" * len(levels))
        layouts = [f"{f} R{R}" for f in MIXED for R in HOT_ROWS[args.study]] if policy in MIXED_POLICIES else []
        for fmt in SWEPT + layouts:
            cells = []
            for m in levels:
                if mixed_parts(fmt):
                    R = mixed_parts(fmt)[2]
                    hb = R * row_bytes_of("fp16", d)
                    rows = R + (m - hb) // row_bytes_of(fmt, d) if m >= hb else 0
                    if rows == 0:
                        cells.append("-")
                        continue
                else:
                    rows = m // row_bytes_of(fmt, d)
                c = (policy, fmt, rows) if rows < T else ("full", fmt, T)
                if c not in report:
                    cells.append("-")
                    continue
                cells.append(f"{err(c):.4f} ({tune[c]['err']:.4f}) " + ("full" if rows >= T else f"{rows} r"))
            w(f"| {fmt} | " + " | ".join(cells) + " |")
        w("")
    with open(os.path.join(args.out, f"{args.study}.md"), "w") as f:
        f.write("\n".join(md) + "\n")

    # Plots: held-out error (log) against bytes (log2).
    xmin, xmax, ymin, ymax = u * 16, u * 1024, st["ymin"], 1.0
    x_of = lambda b: (math.log2(b) - math.log2(xmin)) / (math.log2(xmax) - math.log2(xmin))
    y_of = lambda v: (math.log10(max(v, ymin)) - math.log10(ymin)) / (math.log10(ymax) - math.log10(ymin))
    fmt_b = lambda b: f"{b // 1024}K" if b >= 1024 else str(b)
    xt = [(u * r, fmt_b(u * r)) for r in (16, 32, 64, 128, 256, 512, 1024)]
    yt = [(10 ** e, f"1e{e}") for e in range(round(math.log10(ymin)), 1)]
    context = []  # each format's series ends at its own full cache; the others are in the table
    panels = []
    for policy in POLICIES:
        series = []
        layouts = [f"{f} R16" for f in MIXED] if policy in MIXED_POLICIES else []
        for fmt in SWEPT + layouts:
            pts = sorted((report[c]["bytes"], max(err(c), ymin)) for c in report
                         if c[1] == fmt and c[0] in (policy, "full"))
            series.append((fmt + (" (rows, then the full cache)" if fmt == SWEPT[0] else ""), pts))
        panels.append((policy, series))
    y_label = f"{mn} (log; below {ymin:g} drawn at {ymin:g})"
    svg = panels_svg(f"{st['what']}, held-out, against K/V bytes: each format at the policy's row budgets",
                     panels, context, x_of, y_of, xt, yt, "bytes per (layer, KV head), log", y_label,
                     pw=430, ph=360)
    with open(os.path.join(args.out, f"{args.study}.svg"), "w") as f:
        f.write(svg)
    series = []
    for name, key in (("kvevict's configuration (chosen on the tuning set)", None),
                      ("pure eviction (16-bit rows, best policy)", "evict"),
                      ("pure quantization (every row, best format)", "quant"),
                      ("best mix (fewer rows, quantized)", "mix"),
                      ("best mixed layout (recent rows fp16, older quantized)", "layout")):
        pts = [(m, max(err(c), ymin)) for m, rec, best in table
               for c in [rec if key is None else best[key]] if c]
        series.append((name, pts))
    svg = panels_svg(f"{st['short']}: the best configuration at each memory size (held-out)",
                     [(f"chosen on {st['sets_text']}", series)], [],
                     x_of, y_of, xt, yt, "memory: bytes per (layer, KV head), log", y_label,
                     pw=760, ph=400)
    with open(os.path.join(args.out, f"{args.study}-best.svg"), "w") as f:
        f.write(svg)
    for m, v, rec in verdicts:
        print(f"{m:7d} bytes: {label(rec) if rec else '-':40s} mix beats both: {v}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", choices=sorted(STUDIES), default="stories260K")
    ap.add_argument("--eval", default=os.path.join(ROOT, "build", "examples", "eval", "kvevict-eval"))
    ap.add_argument("--model", default=os.path.join(ROOT, "..", "shared", "models", "stories260K"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "quality", "frontier"))
    ap.add_argument("--analyze-only", action="store_true")
    ap.add_argument("--resume", action="store_true", help="keep the CSVs already written")
    args = ap.parse_args()
    if not args.analyze_only:
        run(args)
    analyze(args)


if __name__ == "__main__":
    main()
