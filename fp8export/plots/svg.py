"""Render a :class:`~fp8export.plots.figure.Figure` as a standalone SVG string (no libraries).

Layout rule that keeps every label readable: text never goes inside a plot area. Titles,
notes, legends and the y-axis title sit above each plot, tick labels beside and below it, and
the layout reserves their measured width (``text.text_width``) before it places anything, so
nothing overlaps; tick labels that would crowd each other are thinned. Marks are clipped to
their plot area. Elements carry classes (``panel``, ``plot-area``, ``mark``, ``legend``) so a
browser test can check the drawing.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

from fp8export.plots.figure import Axis, Band, Cells, Figure, Panel, RefLine, Series
from fp8export.plots.scale import Scale, fmt_number, linear_domain, log_domain
from fp8export.plots.text import ASCENT, DESCENT, FONT_FAMILY, Box, text_box, text_width, wrap

PAD = 14
TITLE, NOTE, PANEL_TITLE, SMALL = 16, 12, 13, 11  # font sizes, px
AXIS_COLOR, GRID_COLOR, MUTED = "#888888", "#E6E6E6", "#555555"
_MIDLINE = (ASCENT - DESCENT) / 2  # baseline offset, in em, that centres a line box on a y
_BLUES = ((0.87, 0.92, 0.97), (0.62, 0.79, 0.88), (0.26, 0.57, 0.78), (0.03, 0.19, 0.42))


def _e(s: str) -> str:
    return html.escape(s, quote=True)


def _f(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


@dataclass
class Rendered:
    """The SVG text and the box of every label in it (for layout tests)."""

    svg: str
    width: float
    height: float
    text_boxes: list[Box] = field(default_factory=list)
    plot_areas: list[Box] = field(default_factory=list)


class _Canvas:
    def __init__(self):
        self.parts: list[str] = []
        self.boxes: list[Box] = []

    def text(self, x: float, y: float, s: str, size: float, *, anchor: str = "start",
             bold: bool = False, color: str = "#222222", cls: str = "label") -> None:
        self.boxes.append(text_box(x, y, s, size, anchor, bold))
        weight = ' font-weight="bold"' if bold else ""
        self.parts.append(f'<text class="{cls}" x="{_f(x)}" y="{_f(y)}" font-size="{size}" '
                          f'text-anchor="{anchor}" fill="{color}"{weight}>{_e(s)}</text>')

    def add(self, element: str) -> None:
        self.parts.append(element)


def _marker(shape: str, x: float, y: float, color: str, r: float = 3.5,
            cls: str = "mark") -> str:
    if shape == "none":
        return ""
    c = f'class="{cls}" fill="{color}" stroke="{color}"'
    if shape == "square":
        return (f'<rect {c} x="{_f(x - r)}" y="{_f(y - r)}" width="{_f(2 * r)}" '
                f'height="{_f(2 * r)}"/>')
    pts = {"diamond": ((0, -1.3), (1.3, 0), (0, 1.3), (-1.3, 0)),
           "triangle": ((0, -1.3), (1.2, 0.9), (-1.2, 0.9)),
           "triangle-down": ((0, 1.3), (1.2, -0.9), (-1.2, -0.9))}.get(shape)
    if pts:
        d = " ".join(f"{_f(x + a * r)},{_f(y + b * r)}" for a, b in pts)
        return f'<polygon {c} points="{d}"/>'
    if shape in ("plus", "cross"):
        k = r * (1.0 if shape == "plus" else 0.8)
        seg = (((-k, 0), (k, 0)), ((0, -k), (0, k))) if shape == "plus" else \
            (((-k, -k), (k, k)), ((-k, k), (k, -k)))
        d = " ".join(f"M{_f(x + a)},{_f(y + b)} L{_f(x + c2)},{_f(y + d2)}"
                     for (a, b), (c2, d2) in seg)
        return f'<path class="{cls}" d="{d}" stroke="{color}" stroke-width="2" fill="none"/>'
    return f'<circle {c} cx="{_f(x)}" cy="{_f(y)}" r="{_f(r)}"/>'


def _blue(t: float) -> str:
    t = min(max(t, 0.0), 1.0) * (len(_BLUES) - 1)
    i = min(int(t), len(_BLUES) - 2)
    a, b = _BLUES[i], _BLUES[i + 1]
    rgb = [round(255 * (a[k] + (t - i) * (b[k] - a[k]))) for k in range(3)]
    return "#" + "".join(f"{v:02X}" for v in rgb)


# --------------------------------------------------------------------------- domains, ticks

def _values(panel: Panel, axis: str) -> list[float]:
    vals: list[float] = []
    for s in panel.series:
        vals += s.x if axis == "x" else s.y
        if axis == "x" and s.kind == "bars" and s.x:
            vals += [min(s.x) - s.width / 2, max(s.x) + s.width / 2]
    if axis == "y":
        vals += [v for b in panel.bands for v in (b.lo, b.hi)]
    vals += [ln.value for ln in panel.lines if ln.axis == axis]
    if panel.cells is not None:
        edges = panel.cells.x_edges if axis == "x" else panel.cells.y_edges
        vals += [edges[0], edges[-1]]
    return [v for v in vals if v is not None and math.isfinite(v)]


def _domain(axis: Axis, values: list[float], length: float
            ) -> tuple[float, float, list[tuple[float, str]]]:
    """(lo, hi, [(tick, label)]) for an axis of ``length`` px."""
    if axis.log:
        pos = [v for v in [*values, *axis.include] if v > 0]
        lo, hi, ticks = log_domain(min(pos, default=1.0), max(pos, default=10.0))
    else:
        target = max(2, min(8, int(length // 60)))
        lo, hi, raw, step = linear_domain(min(values, default=0.0), max(values, default=1.0),
                                          target, axis.include)
        ticks = [(t, fmt_number(t, step)) for t in raw]
    if axis.lo is not None:
        lo = axis.lo
    if axis.hi is not None:
        hi = axis.hi
    if axis.ticks is not None:
        ticks = list(axis.ticks)
    return lo, hi, [(v, s) for v, s in ticks if lo - 1e-9 * abs(hi - lo) <= v <= hi +
                    1e-9 * abs(hi - lo)]


def _thin_y(ticks: list[tuple[float, str]], scale: Scale) -> list[tuple[float, str]]:
    kept: list[tuple[float, str]] = []
    for v, s in ticks:
        if not kept or abs(scale(v) - scale(kept[-1][0])) >= SMALL * 1.6:
            kept.append((v, s))
    return kept


def _thin_x(ticks: list[tuple[float, str]], scale: Scale, left: float, right: float,
            baseline: float, taken: list[Box]) -> list[tuple[float, str, str, float]]:
    """Tick labels at ``baseline`` that fit: 8 px apart, inside ``[left, right]``, clear of
    the labels already placed (``taken``: the y tick labels at the corner) → (v, s, anchor, x)."""
    kept: list[tuple[float, str, str, float]] = []
    last: Box | None = None
    for v, s in ticks:
        x, anchor = scale(v), "middle"
        box = text_box(x, baseline, s, SMALL, anchor)
        if box.x0 < left:
            x, anchor = left, "start"
        elif box.x1 > right:
            x, anchor = right, "end"
        box = text_box(x, baseline, s, SMALL, anchor)
        if last is not None and box.x0 < last.x1 + 8:
            continue
        if any(box.overlaps(t, gap=2) for t in taken):
            continue
        kept.append((v, s, anchor, x))
        last = box
    return kept


# ------------------------------------------------------------------------------ the legend

def _legend_entries(panel: Panel) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = [(s.label, s) for s in panel.series
                                     if s.label and any(math.isfinite(v) for v in s.y)]
    out += [(b.label, b) for b in panel.bands if b.label]
    out += [(ln.label, ln) for ln in panel.lines if ln.label]
    if panel.cells is not None:
        top = max((max(r) for r in panel.cells.counts if r), default=0)
        out.append((f"{panel.cells.label}: 1 … {top} (log shading)", panel.cells))
    return out


SWATCH = 24


def _swatch(c: _Canvas, item: object, x: float, y: float) -> None:
    """Draw a legend swatch in ``[x, x + SWATCH]`` centred on ``y``."""
    mid = x + SWATCH / 2
    if isinstance(item, Series):
        if item.kind in ("bars", "hist"):
            c.add(f'<rect x="{_f(x + 6)}" y="{_f(y - 6)}" width="12" height="12" '
                  f'fill="{item.color}"/>')
            return
        if item.kind == "line":
            dash = ' stroke-dasharray="4 3"' if item.dash else ""
            c.add(f'<line x1="{_f(x)}" y1="{_f(y)}" x2="{_f(x + SWATCH)}" y2="{_f(y)}" '
                  f'stroke="{item.color}" stroke-width="1.5"{dash}/>')
        c.add(_marker(item.marker, mid, y, item.color, cls="swatch"))
    elif isinstance(item, Band):
        c.add(f'<rect x="{_f(x)}" y="{_f(y - 6)}" width="{SWATCH}" height="12" '
              f'fill="{item.color}" fill-opacity="0.18" stroke="{item.color}" '
              'stroke-dasharray="3 2"/>')
    elif isinstance(item, RefLine):
        dash = ' stroke-dasharray="5 3"' if item.dash else ""
        if item.axis == "x":
            c.add(f'<line x1="{_f(mid)}" y1="{_f(y - 7)}" x2="{_f(mid)}" y2="{_f(y + 7)}" '
                  f'stroke="{item.color}" stroke-width="1.5"{dash}/>')
        else:
            c.add(f'<line x1="{_f(x)}" y1="{_f(y)}" x2="{_f(x + SWATCH)}" y2="{_f(y)}" '
                  f'stroke="{item.color}" stroke-width="1.5"{dash}/>')
    elif isinstance(item, Cells):
        for k in range(4):
            c.add(f'<rect x="{_f(x + 6 * k)}" y="{_f(y - 6)}" width="6" height="12" '
                  f'fill="{_blue(k / 3)}"/>')


def _legend(c: _Canvas, panel: Panel, x0: float, x1: float, y: float) -> float:
    """Lay the legend out in rows from ``y``; return the y below it."""
    entries = _legend_entries(panel)
    if not entries:
        return y
    row_h = SMALL * (ASCENT + DESCENT) + 6
    c.add('<g class="legend">')
    x, cy = x0, y + row_h / 2
    for label, item in entries:
        max_label = x1 - x0 - SWATCH - 6
        label = _fit(label, SMALL, max_label)
        w = SWATCH + 6 + text_width(label, SMALL)
        if x > x0 and x + w > x1:
            x, cy = x0, cy + row_h
        _swatch(c, item, x, cy)
        c.text(x + SWATCH + 6, cy + SMALL * _MIDLINE, label, SMALL, cls="legend-label")
        x += w + 18
    c.add("</g>")
    return cy + row_h / 2


def _fit(s: str, size: float, width: float) -> str:
    """``s``, cut with an ellipsis to fit ``width`` px."""
    if text_width(s, size) <= width:
        return s
    while s and text_width(s + "…", size) > width:
        s = s[:-1]
    return s + "…"


# ------------------------------------------------------------------------------- the marks

def _marks(c: _Canvas, panel: Panel, sx: Scale, sy: Scale, clip: str) -> None:
    c.add(f'<g clip-path="url(#{clip})">')
    y_lo, y_hi = sorted((sy.lo, sy.hi))
    for b in panel.bands:
        top, bot = sy(min(b.hi, y_hi)), sy(max(b.lo, y_lo))
        if b.hi < y_lo or b.lo > y_hi:
            continue
        c.add(f'<rect class="band" x="{_f(sx.p0)}" y="{_f(top)}" width="{_f(sx.p1 - sx.p0)}" '
              f'height="{_f(max(bot - top, 1))}" fill="{b.color}" fill-opacity="0.15"/>')
    if panel.cells is not None:
        cells = panel.cells
        top = max((max(r) for r in cells.counts if r), default=0)
        for i, row in enumerate(cells.counts):
            for j, n in enumerate(row):
                if n <= 0:
                    continue
                x0, x1 = sx(cells.x_edges[j]), sx(cells.x_edges[j + 1])
                y0, y1 = sy(cells.y_edges[i + 1]), sy(cells.y_edges[i])
                t = math.log(n) / math.log(top) if top > 1 else 1.0
                c.add(f'<rect class="mark" x="{_f(x0)}" y="{_f(y0)}" width="{_f(x1 - x0 + 0.3)}" '
                      f'height="{_f(y1 - y0 + 0.3)}" fill="{_blue(0.15 + 0.85 * t)}"/>')
    base = sy(0.0) if (not sy.log and y_lo <= 0.0 <= y_hi) else sy.p0
    for s in panel.series:
        pts = [(x, y) for x, y in zip(s.x, s.y) if math.isfinite(x) and math.isfinite(y)
               and (not sy.log or y > 0)]
        if s.kind == "hist":
            for (x0, x1), n in zip(zip(s.x, s.x[1:]), s.y):
                if n > 0 and math.isfinite(n):
                    top = sy(n)
                    c.add(f'<rect class="mark" x="{_f(sx(x0))}" y="{_f(top)}" '
                          f'width="{_f(max(sx(x1) - sx(x0) - 0.5, 0.5))}" '
                          f'height="{_f(max(base - top, 0.8))}" fill="{s.color}"/>')
            continue
        if s.kind == "bars":
            half = abs(sx(s.width / 2) - sx(0.0))
            for x, y in pts:
                top, bot = sorted((sy(y), base))
                c.add(f'<rect class="mark" x="{_f(sx(x) - half)}" y="{_f(top)}" '
                      f'width="{_f(max(2 * half, 1))}" height="{_f(max(bot - top, 0.8))}" '
                      f'fill="{s.color}"/>')
            continue
        if s.kind == "line" and len(pts) > 1:
            d = " ".join(f"{'M' if k == 0 else 'L'}{_f(sx(x))},{_f(sy(y))}"
                         for k, (x, y) in enumerate(pts))
            dash = ' stroke-dasharray="5 3"' if s.dash else ""
            c.add(f'<path class="mark" d="{d}" fill="none" stroke="{s.color}" '
                  f'stroke-width="1.5" stroke-opacity="0.8"{dash}/>')
        for x, y in pts:
            c.add(_marker(s.marker, sx(x), sy(y), s.color, r=s.size))
    for ln in panel.lines:
        dash = ' stroke-dasharray="5 3"' if ln.dash else ""
        if ln.axis == "x":
            x = sx(ln.value)
            c.add(f'<line class="refline" x1="{_f(x)}" y1="{_f(sy.p0)}" x2="{_f(x)}" '
                  f'y2="{_f(sy.p1)}" stroke="{ln.color}" stroke-width="1.5"{dash}/>')
        else:
            y = sy(ln.value)
            c.add(f'<line class="refline" x1="{_f(sx.p0)}" y1="{_f(y)}" x2="{_f(sx.p1)}" '
                  f'y2="{_f(y)}" stroke="{ln.color}" stroke-width="1.5"{dash}/>')
    c.add("</g>")


# ------------------------------------------------------------------------------ the figure

def _left_margin(fig: Figure) -> float:
    widest = 0.0
    for p in fig.panels:
        _, _, ticks = _domain(p.y, _values(p, "y"), p.height)
        widest = max([widest, *(text_width(s, SMALL) for _, s in ticks)])
    return PAD + widest + 8


def _lines(c: _Canvas, y: float, text: str, size: float, width: float, *, x: float = PAD,
           anchor: str = "start", bold: bool = False, color: str = "#222222", cls: str,
           leading: float = 3.0) -> float:
    """Wrap ``text`` into lines from ``y`` (the top of the first line box); return the y
    below the last."""
    for line in wrap(text, size, width, bold):
        baseline = y + ASCENT * size
        c.text(x, baseline, line, size, anchor=anchor, bold=bold, color=color, cls=cls)
        y = baseline + DESCENT * size + leading
    return y


def render(fig: Figure, id_prefix: str = "fig", title: bool = True) -> Rendered:
    """Lay out and draw ``fig`` (only its non-empty panels).

    ``id_prefix`` makes the clip-path ids unique when several figures share one HTML page;
    ``title=False`` leaves the title to the page around the figure (it stays in ``<title>``).
    """
    c = _Canvas()
    width = float(fig.width)
    right = width - PAD
    y = PAD
    if title:
        y = _lines(c, y, fig.title, TITLE, width - 2 * PAD, bold=True, cls="title", leading=6)
    for note in fig.notes:
        y = _lines(c, y, note, NOTE, width - 2 * PAD, color=MUTED, cls="note", leading=2)
    left = _left_margin(fig)
    areas: list[Box] = []
    panels = [p for p in fig.panels if p.has_data()]
    square = next((min(right - left, float(p.height)) for p in panels if p.square), None)
    for k, panel in enumerate(panels):
        y = _lines(c, y + 14, panel.title, PANEL_TITLE, width - 2 * PAD, bold=True,
                   cls="panel-title")
        c.add(f'<g class="panel" data-title="{_e(panel.title)}">')
        y = _legend(c, panel, PAD, right, y + 4)
        y = _lines(c, y + 2, panel.y.label, SMALL, width - 2 * PAD, color=MUTED,
                   cls="axis-title") + 8
        plot_w, plot_h = right - left, float(panel.height)
        if square is not None:  # every panel as wide as the square one, aligned under it
            plot_w = square
            if panel.square:
                plot_h = square
        top, bottom, x_end = y, y + plot_h, left + plot_w
        if fig.share_x:  # one x axis for all: the first panel's, over every panel's data
            x_lo, x_hi, x_ticks = _domain(panels[0].x, [v for p in panels
                                                        for v in _values(p, "x")], plot_w)
        else:
            x_lo, x_hi, x_ticks = _domain(panel.x, _values(panel, "x"), plot_w)
        y_lo, y_hi, y_ticks = _domain(panel.y, _values(panel, "y"), plot_h)
        if panel.square and not (panel.x.log or panel.y.log):  # one domain for both axes
            x_lo, x_hi, x_ticks = _domain(Axis(""), [min(x_lo, y_lo), max(x_hi, y_hi)], plot_h)
            y_lo, y_hi, y_ticks = x_lo, x_hi, x_ticks
        sx = Scale(x_lo, x_hi, left, x_end, panel.x.log)
        sy = Scale(y_lo, y_hi, bottom, top, panel.y.log)
        clip = f"{id_prefix}-clip{k}"
        c.add(f'<clipPath id="{clip}"><rect x="{_f(left)}" y="{_f(top)}" width="{_f(plot_w)}" '
              f'height="{_f(plot_h)}"/></clipPath>')
        c.add(f'<rect class="plot-area" x="{_f(left)}" y="{_f(top)}" width="{_f(plot_w)}" '
              f'height="{_f(plot_h)}" fill="#FFFFFF" stroke="none"/>')
        for v, s in _thin_y(y_ticks, sy):
            ty = sy(v)
            c.add(f'<line x1="{_f(left)}" y1="{_f(ty)}" x2="{_f(x_end)}" y2="{_f(ty)}" '
                  f'stroke="{GRID_COLOR}" stroke-width="1"/>')
            c.text(left - 6, ty + SMALL * _MIDLINE, s, SMALL, anchor="end", color=MUTED,
                   cls="tick")
        _marks(c, panel, sx, sy, clip)
        c.add(f'<path d="M{_f(left)},{_f(top)} L{_f(left)},{_f(bottom)} L{_f(x_end)},'
              f'{_f(bottom)}" fill="none" stroke="{AXIS_COLOR}" stroke-width="1"/>')
        areas.append(Box(left, top, x_end, bottom))
        y = bottom
        last = k == len(panels) - 1
        if not fig.share_x or last:
            baseline = bottom + 5 + SMALL * ASCENT
            for v, s, anchor, lx in _thin_x(x_ticks, sx, PAD, right, baseline, c.boxes):
                tx = sx(v)
                c.add(f'<line x1="{_f(tx)}" y1="{_f(bottom)}" x2="{_f(tx)}" '
                      f'y2="{_f(bottom + 4)}" stroke="{AXIS_COLOR}"/>')
                c.text(lx, baseline, s, SMALL, anchor=anchor, color=MUTED, cls="tick")
            y = _lines(c, baseline + SMALL * DESCENT + 4, panel.x.label, SMALL, plot_w,
                       x=left + plot_w / 2, anchor="middle", color=MUTED, cls="axis-title")
        c.add("</g>")
    height = y + PAD
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" class="fp8export-figure" role="img" '
            f'width="{_f(width)}" height="{_f(height)}" viewBox="0 0 {_f(width)} {_f(height)}" '
            f'font-family="{_e(FONT_FAMILY)}"><title>{_e(fig.title)}</title>'
            f'<desc>{_e(" ".join(fig.notes))}</desc>'
            f'<rect width="100%" height="100%" fill="#FFFFFF"/>')
    return Rendered(head + "".join(c.parts) + "</svg>", width, height, c.boxes, areas)


def to_svg(fig: Figure, id_prefix: str = "fig", title: bool = True) -> str:
    """The SVG of ``fig`` as a string (embed inline in HTML, or write as a .svg file)."""
    return render(fig, id_prefix, title).svg
