#!/usr/bin/env python3
"""docs/img/diag_*.svg from llama2c_diagnose's CSV (plain SVG, no plotting library):
    build/examples/headline/llama2c_diagnose --csv docs/quality/diagnosis.csv > docs/quality/diagnosis.txt
    python3 docs/img/make_diag_plots.py docs/quality/diagnosis.csv docs/img"""
import csv, os, sys
from collections import defaultdict
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_style import panels_svg

src = sys.argv[1] if len(sys.argv) > 1 else "docs/quality/diagnosis.csv"
out_dir = sys.argv[2] if len(sys.argv) > 2 else "docs/img"
data = defaultdict(dict)  # (section, policy, budget, layer, head) -> {bucket: value}
for r in csv.DictReader(open(src)):
    key = (r["section"], r["policy"], int(r["budget"]), int(r["layer"]), int(r["head"]))
    data[key][r["bucket"]] = float(r["value"])

BUCKETS = ["pos 0", "0", "1", "2-3", "4-7", "8-15", "16-31", "32-63", "64-127", "128-255", "256-511"]
COLOURS = {"StreamingLLM (1 sink)": "#1f77b4", "H2O (recent B/4)": "#d62728",
           "TOVA (decay 0, 1 sink)": "#8c564b", "DecayedAttention (h 3, f 1/2, no recall)": "#98df8a",
           "DecayedAttention::recommended()": "#2ca02c",
           "HashEvict query": "#9467bd", "HashEvict key": "#e377c2", "BUZZ (budget mode)": "#ff7f0e",
           "Oracle (non-causal)": "#7f7f7f", "Top-B of full attention (ideal)": "#bbbbbb",
           "full model's attention": "#000000"}


def esc(s):
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def frame(title, w, h):
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
            '<rect width="100%" height="100%" fill="white"/>',
            f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="14">{esc(title)}</text>']


def axes(out, L, T, PW, PH, ymax, ylabel, xlabels, xtitle, ticks=5):
    for i in range(ticks + 1):
        v = ymax * i / ticks
        y = T + PH - PH * i / ticks
        out.append(f'<line x1="{L}" x2="{L + PW}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e4e4e4"/>'
                   f'<text x="{L - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.3g}</text>')
    n = len(xlabels)
    for i, lab in enumerate(xlabels):
        x = L + PW * (i + 0.5) / n
        out.append(f'<text x="{x:.1f}" y="{T + PH + 16}" text-anchor="middle" font-size="11">{esc(lab)}</text>')
    out.append(f'<text x="{L + PW / 2}" y="{T + PH + 36}" text-anchor="middle">{esc(xtitle)}</text>')
    out.append(f'<text transform="translate(16,{T + PH / 2}) rotate(-90)" text-anchor="middle">{esc(ylabel)}</text>')
    out.append(f'<rect x="{L}" y="{T}" width="{PW}" height="{PH}" fill="none" stroke="#333"/>')


def legend(out, x, y, names, dashed=()):
    for i, name in enumerate(names):
        c = COLOURS.get(name, "#333")
        d = ' stroke-dasharray="5,4"' if name in dashed else ""
        ly = y + i * 19
        out.append(f'<line x1="{x}" x2="{x + 24}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="3"{d}/>'
                   f'<text x="{x + 30}" y="{ly + 4}">{esc(name)}</text>')


def line_plot(path, title, xlabels, xtitle, ylabel, series, dashed=(), ymax=None):
    W, H, L, R, T, B = 900, 420, 64, 270, 40, 50
    PW, PH = W - L - R, H - T - B
    ymax = ymax or max(max(v) for v in series.values()) * 1.08
    out = frame(title, W, H)
    axes(out, L, T, PW, PH, ymax, ylabel, xlabels, xtitle)
    n = len(xlabels)
    for name, vals in series.items():
        c = COLOURS.get(name, "#333")
        d = ' stroke-dasharray="5,4"' if name in dashed else ""
        pts = [(L + PW * (i + 0.5) / n, T + PH - PH * min(v, ymax) / ymax) for i, v in enumerate(vals)]
        out.append(f'<path d="{" ".join(("M" if i == 0 else "L") + f"{x:.1f},{y:.1f}" for i, (x, y) in enumerate(pts))}" '
                   f'fill="none" stroke="{c}" stroke-width="2"{d}/>')
        out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{c}"/>' for x, y in pts]
    legend(out, W - R + 14, T + 12, list(series), dashed)
    out.append("</svg>")
    open(path, "w").write("\n".join(out))


def bar_plot(path, title, xlabels, xtitle, ylabel, series, ymax=None):
    W, H, L, R, T, B = 900, 420, 64, 270, 40, 50
    PW, PH = W - L - R, H - T - B
    ymax = ymax or max(max(v) for v in series.values()) * 1.08
    out = frame(title, W, H)
    axes(out, L, T, PW, PH, ymax, ylabel, xlabels, xtitle)
    n, k = len(xlabels), len(series)
    slot = PW / n
    bw = slot * 0.84 / k
    for j, (name, vals) in enumerate(series.items()):
        c = COLOURS.get(name, "#333")
        for i, v in enumerate(vals):
            x = L + slot * i + slot * 0.08 + j * bw
            h = PH * min(v, ymax) / ymax
            out.append(f'<rect x="{x:.1f}" y="{T + PH - h:.1f}" width="{bw:.1f}" height="{h:.1f}" fill="{c}"/>')
    legend(out, W - R + 14, T + 12, list(series))
    out.append("</svg>")
    open(path, "w").write("\n".join(out))


POLICIES = ["StreamingLLM (1 sink)", "H2O (recent B/4)", "TOVA (decay 0, 1 sink)",
            "DecayedAttention (h 3, f 1/2, no recall)", "DecayedAttention::recommended()", "HashEvict query", "HashEvict key",
            "BUZZ (budget mode)", "Oracle (non-causal)"]

FAMILIES = [("baselines", ["StreamingLLM (1 sink)", "H2O (recent B/4)", "TOVA (decay 0, 1 sink)"]),
            ("the seed papers' methods", ["HashEvict query", "HashEvict key", "BUZZ (budget mode)"]),
            ("kvevict's own", ["DecayedAttention (h 3, f 1/2, no recall)", "DecayedAttention::recommended()"])]


def family_plot(path, title, xlabels, xtitle, ylabel, value, context):
    """Shared style (plot_style.py): a panel per family, context series in grey."""
    n = len(xlabels)
    panels = [(fam, [(p, [(i, value(p, i)) for i in range(n)]) for p in names]) for fam, names in FAMILIES]
    ymax = max(y for _, series in panels for _, pts in series for _, y in pts)
    ymax = max([ymax] + [y for _, pts in context for _, y in pts]) * 1.08
    step = next(st for st in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0) if ymax / st <= 6)
    ticks = [(k * step, f"{k * step:.2g}") for k in range(int(ymax / step) + 1)]
    xt = [(i, lab) for i, lab in enumerate(xlabels) if n <= 6 or i % 2 == 0]
    open(path, "w").write(panels_svg(title, panels, context, lambda i: i / (n - 1), lambda v: v / ymax,
                                     xt, ticks, xtitle, ylabel, pw=400, ph=300))


# (1) mass lost by token age at 32 rows, with where the full model's mass sits.
B = 32
full_age = [(i, data[("full_age", "full", 0, -1, -1)][b]) for i, b in enumerate(BUCKETS)]
oracle_age = [(i, data[("lost_age", "Oracle (non-causal)", B, -1, -1)][b]) for i, b in enumerate(BUCKETS)]
family_plot(os.path.join(out_dir, "diag_lost_by_age.svg"),
            f"stories260K, {B} rows: attention mass lost by token age (16 streams)",
            BUCKETS, "token age t - pos (log2 buckets; every other labelled)", "mean mass per step",
            lambda p, i: data[("lost_age", p, B, -1, -1)][BUCKETS[i]],
            [("full model's attention (where the mass is)", full_age), ("Oracle (non-causal)", oracle_age)])

# (2) mass lost per layer at 32 rows.
oracle_layer = [(l, data[("lost_layer", "Oracle (non-causal)", B, l, -1)]["all"]) for l in range(5)]
family_plot(os.path.join(out_dir, "diag_lost_by_layer.svg"),
            f"stories260K, {B} rows: attention mass lost per layer (16 streams)",
            [f"layer {l}" for l in range(5)], "layer", "mean mass lost per step",
            lambda p, l: data[("lost_layer", p, B, l, -1)]["all"],
            [("StreamingLLM (1 sink)", [(l, data[("lost_layer", "StreamingLLM (1 sink)", B, l, -1)]["all"]) for l in range(5)]),
             ("Oracle (non-causal)", oracle_layer)])

# (3) rows held by token age at 32 rows.
kept = ["StreamingLLM (1 sink)", "H2O (recent B/4)", "DecayedAttention (h 3, f 1/2, no recall)",
        "DecayedAttention::recommended()",
        "Oracle (non-causal)"]
series = {p: [data[("kept_age", p, B, -1, -1)][b] for b in BUCKETS] for p in kept}
bar_plot(os.path.join(out_dir, "diag_kept_age.svg"),
         f"stories260K, {B} rows: rows held by token age (mean per layer and KV head)",
         BUCKETS, "token age t - pos (log2 buckets; pos 0 = first token)", "rows held", series)

# (4) SimHash ranking quality against bits, head dim 8 vs 128.
bits = [8, 16, 32, 64]
sp = lambda label, mode: [data[("hash_spearman", label, b, -1, -1)][mode] for b in bits]
d8, d128 = "stories260K d=8", "synthetic mixed d=128"
COLOURS.update({"d=8 query": "#1f77b4", "d=8 key": "#aec7e8", "d=8 exact cosine": "#1f77b4",
                "d=128 query": "#d62728", "d=128 key": "#ff9896", "d=128 exact cosine": "#d62728",
                "d=8 recency": "#2ca02c"})
series = {"d=8 query": sp(d8, "query"), "d=8 key": sp(d8, "key"),
          "d=8 exact cosine": [data[("hash_spearman", d8, 0, -1, -1)]["cosine"]] * 4,
          "d=8 recency": [data[("hash_spearman", d8, 0, -1, -1)]["recency"]] * 4,
          "d=128 query": sp(d128, "query"), "d=128 key": sp(d128, "key"),
          "d=128 exact cosine": [data[("hash_spearman", d128, 0, -1, -1)]["cosine"]] * 4}
for k in series:
    series[k] = [max(v, 0.0) for v in series[k]]
line_plot(os.path.join(out_dir, "diag_hash_rank.svg"),
          "SimHash: Spearman(-Hamming, q.k) over the cached rows",
          [f"b = {b}" for b in bits], "bits per code", "Spearman rank correlation (clipped at 0)",
          series, dashed=("d=8 exact cosine", "d=128 exact cosine", "d=8 recency"), ymax=1.0)
