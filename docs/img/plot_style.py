"""The plot style every figure in docs/ shares (kvevict-eval's SVG plots use the same, in
examples/eval/svg_plot.hpp): one panel per policy family, inside a panel distinct
Okabe-Ito colours plus a marker and a dash pattern per series, identical series merged
into one legend entry ("a = b"), context series (the baseline to beat, the ceiling)
repeated in light grey in the panels they do not belong to. Plain SVG, no plotting library.

    panels_svg(title, panels, context, x_of, y_of, x_ticks, y_ticks, x_label, y_label)

panels: [(panel title, [(series name, [(x, y), ...]), ...]), ...]
context: [(series name, [(x, y), ...]), ...] drawn grey in every panel that lacks them.
x_of / y_of map data values to [0, 1] (log scales: pass a log mapping).
"""

PALETTE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000"]
DASHES = ["", "7,3", "2,2", "9,3,2,3", "4,4", "1,3"]
CONTEXT_DASHES = ["", "6,4", "2,3"]


def esc(s):
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def marker(kind, x, y, c, r=3.4):
    kind %= 6
    if kind == 0:
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r}" fill="{c}"/>'
    if kind == 1:
        return f'<rect x="{x - r:.1f}" y="{y - r:.1f}" width="{2 * r}" height="{2 * r}" fill="{c}"/>'
    if kind == 2:
        return f'<path d="M{x:.1f},{y - 1.3 * r:.1f} l{1.2 * r},{2.2 * r} l{-2.4 * r},0 z" fill="{c}"/>'
    if kind == 3:
        return (f'<path d="M{x:.1f},{y - 1.4 * r:.1f} l{1.2 * r},{1.4 * r} l{-1.2 * r},{1.4 * r} '
                f'l{-1.2 * r},{-1.4 * r} z" fill="{c}"/>')
    if kind == 4:
        return (f'<path d="M{x - r:.1f},{y - r:.1f} l{2 * r},{2 * r} m0,{-2 * r} l{-2 * r},{2 * r}" '
                f'stroke="{c}" stroke-width="2"/>')
    return (f'<path d="M{x:.1f},{y + 1.3 * r:.1f} l{1.2 * r},{-2.2 * r} l{-2.4 * r},0 z" fill="none" '
            f'stroke="{c}" stroke-width="1.5"/>')


def merge_identical(series):
    """[(name, points)] -> [(label, points)], series with identical points merged."""
    out = []
    for name, pts in series:
        for i, (label, p) in enumerate(out):
            if sorted(p) == sorted(pts):
                out[i] = (label + " = " + name, p)
                break
        else:
            out.append((name, pts))
    return out


def panels_svg(title, panels, context, x_of, y_of, x_ticks, y_ticks, x_label, y_label,
               pw=400, ph=300, connect=True):
    ml, mr, mt, mb = 62, 14, 10, 44
    panels = [(t, merge_identical(s)) for t, s in panels]
    n_legend = max(len(s) for _, s in panels) + len(context)
    top, header = 36, 22
    legend_h = n_legend * 17 + 8
    grid_top = top + header + legend_h
    W, H = len(panels) * pw + 10, grid_top + ph + 6
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           f'font-family="sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15">{esc(title)}</text>']
    for pi, (ptitle, series) in enumerate(panels):
        ox = pi * pw
        x0, x1, y0, y1 = ox + ml, ox + pw - mr, grid_top + ph - mb, grid_top + mt
        X = lambda v: x0 + x_of(v) * (x1 - x0)
        Y = lambda v: y0 - min(max(y_of(v), 0.0), 1.0) * (y0 - y1)
        out.append(f'<text x="{(x0 + x1) / 2}" y="{top + 14}" text-anchor="middle" font-size="13" '
                   f'font-weight="bold">{esc(ptitle)}</text>')
        ly = top + header + 10
        for i, (label, _) in enumerate(series):
            c, d = PALETTE[i % len(PALETTE)], DASHES[i % len(DASHES)]
            out.append(f'<line x1="{x0}" x2="{x0 + 30}" y1="{ly}" y2="{ly}" stroke="{c}" '
                       f'stroke-width="2" stroke-dasharray="{d}"/>' + marker(i, x0 + 15, ly, c) +
                       f'<text x="{x0 + 38}" y="{ly + 4}">{esc(label)}</text>')
            ly += 17
        own = {n for label, _ in series for n in label.split(" = ")}
        ctx = [(n, p) for n, p in context if n not in own]
        for n, p in ctx:
            dash = CONTEXT_DASHES[context.index((n, p)) % 3]
            out.append(f'<line x1="{x0}" x2="{x0 + 30}" y1="{ly}" y2="{ly}" stroke="#bbb" '
                       f'stroke-width="2" stroke-dasharray="{dash}"/><text x="{x0 + 38}" y="{ly + 4}" '
                       f'fill="#888">{esc(n)}</text>')
            ly += 17
        for v, label in y_ticks:
            out.append(f'<line x1="{x0}" x2="{x1}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" stroke="#e5e5e5"/>'
                       f'<text x="{x0 - 5}" y="{Y(v) + 4:.1f}" text-anchor="end">{label}</text>')
        for v, label in x_ticks:
            out.append(f'<text x="{X(v):.1f}" y="{y0 + 16}" text-anchor="middle">{label}</text>')
        out.append(f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" fill="none" stroke="#333"/>')
        out.append(f'<text x="{(x0 + x1) / 2}" y="{y0 + 34}" text-anchor="middle">{esc(x_label)}</text>')
        out.append(f'<text transform="translate({ox + 16},{(y0 + y1) / 2}) rotate(-90)" '
                   f'text-anchor="middle">{esc(y_label)}</text>')
        for n, pts in ctx:
            path = " ".join(f'{"M" if j == 0 else "L"}{X(x):.1f},{Y(y):.1f}' for j, (x, y) in enumerate(pts))
            dash = CONTEXT_DASHES[context.index((n, pts)) % 3]
            out.append(f'<path d="{path}" fill="none" stroke="#bbb" stroke-width="2" stroke-dasharray="{dash}"/>')
        for i, (_, pts) in enumerate(series):
            c, d = PALETTE[i % len(PALETTE)], DASHES[i % len(DASHES)]
            if connect:
                path = " ".join(f'{"M" if j == 0 else "L"}{X(x):.1f},{Y(y):.1f}' for j, (x, y) in enumerate(pts))
                out.append(f'<path d="{path}" fill="none" stroke="{c}" stroke-width="1.8" '
                           f'stroke-dasharray="{d}"/>')
            out.extend(marker(i, X(x), Y(y), c) for x, y in pts)
    out.append('</svg>')
    return "\n".join(out)
