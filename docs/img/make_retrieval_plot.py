#!/usr/bin/env python3
"""docs/img/headline_retrieval.svg from `llama2c_headline --retrieval`'s markdown table
(stdin): far-position name retrieval against mean KL, one line per policy through the four
budgets (16 / 32 / 64 / 128 rows, left to right as KL falls). Up and to the left is
better. Shared plot style (plot_style.py), a panel per policy family. Plain SVG:
  build/examples/headline/llama2c_headline --retrieval --streams 32 --seed 2000 \\
    | python3 docs/img/make_retrieval_plot.py > docs/img/headline_retrieval.svg"""
import math, os, re, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_style import panels_svg

rows = {}
for line in sys.stdin:
    cells = [c.strip() for c in line.strip().strip('|').split('|')]
    if len(cells) == 5 and cells[0].isdigit():
        far = float(re.match(r'[0-9.]+', cells[2]).group(0))
        rows.setdefault(cells[1].strip('*'), []).append((float(cells[4]), far))
family = lambda name: ("kvevict's own" if name.startswith(("DecayedAttention", "recommended()")) or "per-head" in name
                       else "ceiling" if name.startswith("Oracle") else "baselines")
panels = [(fam, [(n, sorted(p)) for n, p in rows.items() if family(n) == fam])
          for fam in ("baselines", "kvevict's own")]
context = [(n, sorted(rows[n])) for n in ("StreamingLLM (1 sink)", "H2O (recent B/4)",
                                          "Oracle (non-causal ceiling)") if n in rows]
xmin, xmax = 1e-4, 1.0
x_of = lambda v: (math.log10(max(v, xmin)) - math.log10(xmin)) / (math.log10(xmax) - math.log10(xmin))
y_of = lambda r: (r - 0.4) / 0.6
print(panels_svg("stories260K: far name retrieval against streaming KL (16 / 32 / 64 / 128 rows)",
                 panels, context, x_of, y_of, [(10 ** e, f"1e{e}") for e in range(-4, 1)],
                 [(r / 10, f"{r / 10:.1f}") for r in range(4, 11)],
                 "mean KL(full || policy), log (left is better)", "far positions: top-1 = name",
                 pw=430, ph=320))
