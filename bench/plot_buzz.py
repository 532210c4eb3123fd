#!/usr/bin/env python3
"""Plots for docs/policies/buzz.md from bench_buzz's CSV modes, as plain SVG (no plotting
library needed). Usage:
  bench_buzz --curve 1 4096 > early.csv; bench_buzz --curve 256 131072 > long.csv
  bench_buzz --quality > quality.csv
  plot_buzz.py early.csv long.csv quality.csv docs/img
"""
import csv
import math
import sys

W, H, M = 460, 300, (56, 16, 40, 48)  # width, height, margins: left, right, top, bottom
COLORS = {"bounded": "#1f77b4", "log_n": "#d62728"}


def read(path):
    with open(path) as f:
        return list(csv.DictReader(f))


class Panel:
    def __init__(self, x0, title, xr, yr, xlog=False, xlabel="", ylabel=""):
        self.x0, self.title, self.xr, self.yr, self.xlog = x0, title, xr, yr, xlog
        self.xlabel, self.ylabel, self.items = xlabel, ylabel, []

    def fx(self, x):
        lo, hi = self.xr
        if self.xlog:
            x, lo, hi = math.log2(max(x, 1)), math.log2(lo), math.log2(hi)
        return self.x0 + M[0] + (x - lo) / (hi - lo) * (W - M[0] - M[1])

    def fy(self, y):
        lo, hi = self.yr
        return H - M[3] - (y - lo) / (hi - lo) * (H - M[2] - M[3])

    def line(self, xs, ys, color, width=1.2, dash=""):
        pts = " ".join(f"{self.fx(x):.1f},{self.fy(y):.1f}" for x, y in zip(xs, ys))
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.items.append(f'<polyline fill="none" stroke="{color}" stroke-width="{width}"{d} '
                          f'points="{pts}"/>')

    def band(self, xs, lo, hi, color):
        pts = [f"{self.fx(x):.1f},{self.fy(y):.1f}" for x, y in zip(xs, hi)]
        pts += [f"{self.fx(x):.1f},{self.fy(y):.1f}" for x, y in zip(reversed(xs), reversed(lo))]
        self.items.append(f'<polygon fill="{color}" fill-opacity="0.35" stroke="{color}" '
                          f'stroke-width="0.6" points="{" ".join(pts)}"/>')

    def svg(self, xticks, yticks, legend):
        out = [f'<text x="{self.x0 + W / 2:.0f}" y="22" text-anchor="middle" '
               f'font-weight="bold">{self.title}</text>']
        x1, x2 = self.x0 + M[0], self.x0 + W - M[1]
        y1, y2 = M[2], H - M[3]
        out.append(f'<rect x="{x1}" y="{y1}" width="{x2 - x1}" height="{y2 - y1}" fill="none" '
                   f'stroke="#444"/>')
        for v, label in xticks:
            x = self.fx(v)
            out.append(f'<line x1="{x:.1f}" y1="{y2}" x2="{x:.1f}" y2="{y1}" stroke="#ddd"/>')
            out.append(f'<text x="{x:.1f}" y="{y2 + 16}" text-anchor="middle">{label}</text>')
        for v in yticks:
            y = self.fy(v)
            out.append(f'<line x1="{x1}" y1="{y:.1f}" x2="{x2}" y2="{y:.1f}" stroke="#ddd"/>')
            out.append(f'<text x="{x1 - 6}" y="{y + 4:.1f}" text-anchor="end">{v:g}</text>')
        out.append(f'<text x="{(x1 + x2) / 2:.0f}" y="{H - 8}" text-anchor="middle">'
                   f'{self.xlabel}</text>')
        out.append(f'<text transform="translate({self.x0 + 14},{(y1 + y2) / 2:.0f}) rotate(-90)" '
                   f'text-anchor="middle">{self.ylabel}</text>')
        out += self.items
        for i, (name, color) in enumerate(legend):
            y = y1 + 14 + 16 * i
            out.append(f'<line x1="{x1 + 10}" y1="{y - 4}" x2="{x1 + 30}" y2="{y - 4}" '
                       f'stroke="{color}" stroke-width="3"/>')
            out.append(f'<text x="{x1 + 36}" y="{y}">{name}</text>')
        return "\n".join(out)


def write(path, panels):
    body = "\n".join(panels)
    width = W * len(panels)
    with open(path, "w") as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{H}" '
                f'font-family="sans-serif" font-size="11">\n'
                f'<rect width="{width}" height="{H}" fill="white"/>\n{body}\n</svg>\n')


def size_plot(early, long_, out):
    t = [int(r["token"]) for r in early]
    p1 = Panel(0, "First 4096 tokens (every token)", (0, t[-1]), (0, 800),
               xlabel="tokens", ylabel="rows per KV head")
    p1.line(t, [int(r["bounded_max"]) for r in early], COLORS["bounded"])
    p1.line(t, [int(r["log_n_max"]) for r in early], COLORS["log_n"], dash="4,2")
    t2 = [int(r["token"]) for r in long_]
    top = max(int(r["log_n_max"]) for r in long_)
    ymax = 200 * math.ceil((top + 50) / 200)
    p2 = Panel(W, "To 128K tokens (min..max per 256)", (256, t2[-1]), (0, ymax), xlog=True,
               xlabel="tokens (log scale)", ylabel="rows per KV head")
    p2.band(t2, [int(r["bounded_min"]) for r in long_], [int(r["bounded_max"]) for r in long_],
            COLORS["bounded"])
    p2.band(t2, [int(r["log_n_min"]) for r in long_], [int(r["log_n_max"]) for r in long_],
            COLORS["log_n"])
    legend = [("bounded (reference)", COLORS["bounded"]), ("log n", COLORS["log_n"])]
    xt1 = [(v, str(v)) for v in range(0, t[-1] + 1, 1024)]
    xt2 = [(1 << k, f"{(1 << k) // 1024}K" if k >= 10 else str(1 << k)) for k in range(8, 18)]
    write(out, [p1.svg(xt1, range(0, 801, 200), legend),
                p2.svg(xt2, range(0, ymax + 1, 200), legend)])


def quality_plot(rows, out):
    forms = {}
    for r in rows:
        forms.setdefault(r["form"], {}).setdefault(int(r["checkpoint"]), []).append(r)
    xs_all = sorted({x for f in forms.values() for x in f})
    xt = [(x, f"{x // 1024}K") for x in xs_all]
    legend = [("bounded", COLORS["bounded"]), ("log n", COLORS["log_n"])]
    mean = lambda pts, key: [sum(float(r[key]) for r in pts[x]) / len(pts[x]) for x in sorted(pts)]
    top = max(max(mean(p, "mass_recall")) for p in forms.values())
    ytop = math.ceil(top * 20) / 20
    p1 = Panel(0, "Attention-mass recall (16 queries)", (xs_all[0], xs_all[-1]), (0, ytop),
               xlog=True, xlabel="tokens (log scale)", ylabel="mass recall")
    p2 = Panel(W, "Mean rows per KV head (same queries)", (xs_all[0], xs_all[-1]), (0, 1000),
               xlog=True, xlabel="tokens (log scale)", ylabel="rows")
    for name, pts in forms.items():
        p1.line(sorted(pts), mean(pts, "mass_recall"), COLORS[name], width=2)
        p2.line(sorted(pts), mean(pts, "rows"), COLORS[name], width=2)
    yt1 = [round(ytop * i / 5, 3) for i in range(6)]
    write(out, [p1.svg(xt, yt1, legend), p2.svg(xt, range(0, 1001, 200), legend)])


if __name__ == "__main__":
    early, long_, quality, outdir = sys.argv[1:5]
    size_plot(read(early), read(long_), f"{outdir}/buzz_cache_size.svg")
    quality_plot(read(quality), f"{outdir}/buzz_quality.svg")
