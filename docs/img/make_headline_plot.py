#!/usr/bin/env python3
"""docs/img/headline_kl.svg from llama2c_headline's markdown table (stdin), in the shared
plot style (plot_style.py): a panel per policy family, StreamingLLM (1 sink) and the Oracle
in grey where they are not the panel's own. Plain SVG, no plotting library:
  build/examples/headline/llama2c_headline | python3 docs/img/make_headline_plot.py"""
import math, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_style import panels_svg

rows = {}
for line in sys.stdin:
    cells = [c.strip() for c in line.strip().strip('|').split('|')]
    if len(cells) in (5, 6) and cells[0].isdigit():
        rows.setdefault(cells[1].strip('*'), {})[int(cells[0])] = float(cells[2])
xs = [16, 32, 64, 128]
pts = lambda name: [(b, rows[name][b]) for b in xs if b in rows.get(name, {})]
family = lambda name: ("kvevict's own" if name.startswith(("DecayedAttention", "recommended()")) or "per-head" in name
                       else "ceiling" if name.startswith("Oracle") else "baselines")
panels = []
for fam in ("baselines", "kvevict's own"):
    panels.append((fam, [(n, pts(n)) for n in rows if family(n) == fam]))
context = [(n, pts(n)) for n in ("StreamingLLM (1 sink)", "Oracle (non-causal ceiling)") if n in rows]
ymin, ymax = 1e-4, 1.0
y_of = lambda v: (math.log10(max(v, ymin)) - math.log10(ymin)) / (math.log10(ymax) - math.log10(ymin))
x_of = lambda b: (math.log2(b) - 4) / 3
print(panels_svg("stories260K: streaming KL(full || policy), held-out streams (lower is better)",
                 panels, context, x_of, y_of, [(b, str(b)) for b in xs],
                 [(10 ** e, f"1e{e}") for e in range(-4, 1)], "rows per layer and KV head",
                 "mean KL per token (log)", pw=430, ph=320))
