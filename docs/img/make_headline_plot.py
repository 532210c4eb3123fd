#!/usr/bin/env python3
"""docs/img/headline_kl.svg from llama2c_headline's markdown table (stdin). Plain SVG, no
plotting library:  build/examples/headline/llama2c_headline | python3 docs/img/make_headline_plot.py"""
import math, sys
rows = {}
for line in sys.stdin:
    cells = [c.strip() for c in line.strip().strip('|').split('|')]
    if len(cells) in (5, 6) and cells[0].isdigit():
        rows.setdefault(cells[1].strip('*'), {})[int(cells[0])] = float(cells[2])
W, H, L, R, T, B = 830, 380, 70, 400, 40, 50
xs = [16, 32, 64, 128]
ymin, ymax = 1e-4, 1.0
X = lambda b: L + (math.log2(b) - 4) / 3 * (W - L - R)
Y = lambda v: T + (math.log10(ymax) - math.log10(max(v, ymin))) / (math.log10(ymax) - math.log10(ymin)) * (H - T - B)
colours = ["#d62728", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#1f77b4", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]
out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       '<rect width="100%" height="100%" fill="white"/>',
       f'<text x="{(W - R + L) / 2}" y="22" text-anchor="middle" font-size="14">stories260K: streaming KL(full || policy), held-out streams</text>']
for e in range(-4, 1):
    y = Y(10 ** e)
    out.append(f'<line x1="{L}" x2="{W - R}" y1="{y}" y2="{y}" stroke="#ddd"/><text x="{L - 6}" y="{y + 4}" text-anchor="end">1e{e}</text>')
for b in xs:
    out.append(f'<text x="{X(b)}" y="{H - B + 18}" text-anchor="middle">{b}</text>')
out.append(f'<text x="{(W - R + L) / 2}" y="{H - 12}" text-anchor="middle">rows per layer and KV head</text>')
out.append(f'<rect x="{L}" y="{T}" width="{W - R - L}" height="{H - T - B}" fill="none" stroke="#333"/>')
for i, (name, pts) in enumerate(rows.items()):
    c = colours[i % len(colours)]
    dash = ' stroke-dasharray="5,4"' if 'Oracle' in name else ''
    width = 3 if name.startswith('DecayedAttention::recommended') else 1.8
    path = ' '.join(f'{"M" if j == 0 else "L"}{X(b):.1f},{Y(pts[b]):.1f}' for j, b in enumerate(xs) if b in pts)
    out.append(f'<path d="{path}" fill="none" stroke="{c}" stroke-width="{width}"{dash}/>')
    ly = T + 14 + i * 20
    out.append(f'<line x1="{W - R + 12}" x2="{W - R + 36}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="{width}"{dash}/>'
               f'<text x="{W - R + 42}" y="{ly + 4}">{name.replace("&", "&amp;")}</text>')
out.append('</svg>')
print('\n'.join(out))
