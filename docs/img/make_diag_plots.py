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
    step = next(st for st in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0) if ymax / st <= 6)
    ticks = [(k * step, f"{k * step:g}") for k in range(int(ymax / step) + 1)]
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

# (3) rows held by token age at 32 rows: every policy, by family; the Oracle and the
# top-B of full attention (the ideal kept set) as grey context.
family_plot(os.path.join(out_dir, "diag_kept_age.svg"),
            f"stories260K, {B} rows: rows held by token age (mean per layer and KV head)",
            BUCKETS, "token age t - pos (log2 buckets; pos 0 = token 0)",
            "rows held", lambda p, i: data[("kept_age", p, B, -1, -1)][BUCKETS[i]],
            [(name, [(i, data[("kept_age", name, B, -1, -1)][b]) for i, b in enumerate(BUCKETS)])
             for name in ("Oracle (non-causal)", "Top-B of full attention (ideal)")])

# (4) SimHash ranking quality against bits: a panel per head dimension, the exact cosine
# ranking (the ceiling of any hash) and recency as grey context where measured.
bits = [8, 16, 32, 64]
sp = lambda label, mode: [(i, max(data[("hash_spearman", label, b, -1, -1)][mode], 0.0))
                          for i, b in enumerate(bits)]
flat = lambda label, mode: [(i, max(data[("hash_spearman", label, 0, -1, -1)][mode], 0.0))
                            for i in range(len(bits))]
d8, d128 = "stories260K d=8", "synthetic mixed d=128"
panels = [(f"{label}", [("query codes", sp(label, "query")), ("key codes", sp(label, "key")),
                        ("exact cosine (no hashing)", flat(label, "cosine")),
                        ("recency (newest first)", flat(label, "recency"))])
          for label in (d8, d128)]
open(os.path.join(out_dir, "diag_hash_rank.svg"), "w").write(panels_svg(
    "SimHash: Spearman(-Hamming, q.k) over the cached rows (clipped at 0)", panels, [],
    lambda i: i / (len(bits) - 1), lambda v: v, [(i, f"b = {b}") for i, b in enumerate(bits)],
    [(k / 5, f"{k / 5:.1f}") for k in range(6)], "bits per code", "Spearman rank correlation",
    pw=420, ph=300))
