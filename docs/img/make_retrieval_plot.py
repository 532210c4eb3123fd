#!/usr/bin/env python3
"""docs/img/headline_retrieval.svg from `llama2c_headline --retrieval`'s markdown table
(stdin): far-position name retrieval against mean KL, one line per policy through the four
budgets. Up and to the left is better. Plain SVG, no plotting library:
  build/examples/headline/llama2c_headline --retrieval --streams 32 --seed 2000 \\
    | python3 docs/img/make_retrieval_plot.py > docs/img/headline_retrieval.svg"""
import math, re, sys
rows = {}
for line in sys.stdin:
    cells = [c.strip() for c in line.strip().strip('|').split('|')]
    if len(cells) == 5 and cells[0].isdigit():
        far = float(re.match(r'[0-9.]+', cells[2]).group(0))
        rows.setdefault(cells[1].strip('*'), []).append((int(cells[0]), float(cells[4]), far))
W, H, L, R, T, B = 830, 400, 70, 400, 40, 50
xmin, xmax = 1e-4, 1.0
X = lambda v: L + (math.log10(max(v, xmin)) - math.log10(xmin)) / (math.log10(xmax) - math.log10(xmin)) * (W - L - R)
Y = lambda r: T + (1.0 - r) / 0.6 * (H - T - B)  # retrieval 0.4 .. 1.0
colours = ["#d62728", "#ff7f0e", "#2ca02c", "#1f77b4", "#7f7f7f", "#17becf", "#bcbd22"]
out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       '<rect width="100%" height="100%" fill="white"/>',
       f'<text x="10" y="22" font-size="14">stories260K: far name retrieval against streaming KL (16 / 32 / 64 / 128 rows)</text>']
for e in range(-4, 1):
    x = X(10 ** e)
    out.append(f'<line x1="{x}" x2="{x}" y1="{T}" y2="{H - B}" stroke="#ddd"/><text x="{x}" y="{H - B + 18}" text-anchor="middle">1e{e}</text>')
for r in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
    y = Y(r)
    out.append(f'<line x1="{L}" x2="{W - R}" y1="{y}" y2="{y}" stroke="#ddd"/><text x="{L - 6}" y="{y + 4}" text-anchor="end">{r:.1f}</text>')
out.append(f'<text x="{(W - R + L) / 2}" y="{H - 12}" text-anchor="middle">mean KL(full || policy) on the retrieval stories (log)</text>')
out.append(f'<text x="16" y="{(H - B + T) / 2}" transform="rotate(-90 16 {(H - B + T) / 2})" text-anchor="middle">far positions: top-1 = name</text>')
out.append(f'<rect x="{L}" y="{T}" width="{W - R - L}" height="{H - T - B}" fill="none" stroke="#333"/>')
for i, (name, pts) in enumerate(rows.items()):
    c = colours[i % len(colours)]
    pts.sort()
    dash = ' stroke-dasharray="5,4"' if 'Oracle' in name else ''
    width = 3 if name.startswith('DecayedAttention::recommended') else 1.8
    path = ' '.join(f'{"M" if j == 0 else "L"}{X(kl):.1f},{Y(far):.1f}' for j, (b, kl, far) in enumerate(pts))
    out.append(f'<path d="{path}" fill="none" stroke="{c}" stroke-width="{width}"{dash}/>')
    for b, kl, far in pts:
        out.append(f'<circle cx="{X(kl):.1f}" cy="{Y(far):.1f}" r="3.5" fill="{c}"/>'
                   f'<text x="{X(kl) + 5:.1f}" y="{Y(far) - 5:.1f}" font-size="10" fill="{c}">{b}</text>')
    ly = T + 10 + i * 20
    out.append(f'<line x1="{W - R + 15}" x2="{W - R + 40}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="{width}"{dash}/>'
               f'<text x="{W - R + 46}" y="{ly + 4}">{name}</text>')
out.append('</svg>')
print('\n'.join(out))
