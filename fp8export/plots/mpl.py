"""Draw a :class:`~fp8export.plots.figure.Figure` with matplotlib: inline SVG for report.html,
SVG or PNG files for ``inspect --plot``.

Panels are stacked, a legend sits beside each plot (never over the data), notes at the foot.
The output is reproducible: a fixed ``svg.hashsalt`` and no date in the SVG, so the same result
draws the same bytes. Text stays text in the SVG (``svg.fonttype`` "none"): a reader can select
and search it, a screen reader reads it, and the page stays small. Groups carry ids (``panel-k``,
``-plot-area``, ``-legend``, ``-mark-n``, ``-title``) so a browser test can check the drawing.

No pyplot: a bare ``matplotlib.figure.Figure`` needs no backend and leaves the caller's
matplotlib state (a notebook's backend, rcParams) untouched.
"""

from __future__ import annotations

import io
import math
import re
import textwrap

from fp8export.plots.figure import Figure

_MARKERS = {"circle": "o", "square": "s", "diamond": "D", "triangle": "^",
            "triangle-down": "v", "plus": "+", "cross": "x", "none": ""}
FONTS = ["DejaVu Sans", "Verdana", "Liberation Sans", "Arial", "Helvetica", "sans-serif"]
MAX_TICKS = 24  # categorical ticks beyond this are thinned so their labels never collide
_ID = re.compile(r'(\bid="|url\(#|href="#)([^")]+)')


def _rc(salt: str) -> dict:
    return {"svg.hashsalt": salt, "svg.fonttype": "none", "font.family": "sans-serif",
            "font.sans-serif": FONTS, "axes.titlelocation": "left", "path.simplify": False}


def _import():
    from fp8export._lazy import missing

    try:
        import matplotlib
        from matplotlib.colors import LogNorm
        from matplotlib.figure import Figure as MplFigure
    except ImportError as exc:  # a dependency; absent only in a broken install
        raise missing("matplotlib", "the charts of report.html and inspect --plot", exc) from exc
    return matplotlib, MplFigure, LogNorm


def _draw(fig: Figure, caption: bool):
    """The matplotlib figure of ``fig``'s non-empty panels (title and notes when ``caption``)."""
    _, MplFigure, LogNorm = _import()
    panels = [p for p in fig.panels if p.has_data()]
    # sizes in px as the figure asks (96 px an inch in a browser), the legends included
    heights = [p.height / 96 + 0.9 for p in panels]
    width = fig.width / 96
    notes = [textwrap.fill(n, int(width * 72 / 4.6)) for n in fig.notes] if caption else []
    foot = sum(n.count("\n") + 1 for n in notes) * 0.16
    mfig = MplFigure(figsize=(width, sum(heights) + (0.5 if caption else 0.1) + foot),
                     layout="constrained")
    axes = mfig.subplots(len(panels), 1, height_ratios=heights, squeeze=False,
                         sharex=fig.share_x)[:, 0]
    for k, (ax, panel) in enumerate(zip(axes, panels)):
        marks = []
        for b in panel.bands:
            ax.axhspan(b.lo, b.hi, color=b.color, alpha=0.15, label=b.label, linewidth=0)
        if panel.cells is not None:
            c = panel.cells
            # rasterized: thousands of cells as vector paths would be a megabyte of SVG
            mesh = ax.pcolormesh(c.x_edges, c.y_edges,
                                 [[n or math.nan for n in row] for row in c.counts],
                                 cmap="Blues", norm=LogNorm(vmin=1), rasterized=True)
            bar = mfig.colorbar(mesh, ax=ax, pad=0.01, fraction=0.04)
            bar.set_label(c.label, fontsize=8)
            bar.ax.tick_params(labelsize=7)
            marks.append(mesh)
        for s in panel.series:
            if s.kind == "hist":
                marks.append(ax.stairs(s.y, s.x, fill=True, color=s.color, label=s.label))
                continue
            # ±inf (a layer matching exactly, or broken) cannot be drawn: left out
            pts = [(x, y) for x, y in zip(s.x, s.y) if math.isfinite(x) and math.isfinite(y)
                   and (y > 0 or not panel.y.log)]
            xs, ys = [x for x, _ in pts], [y for _, y in pts]
            if s.kind == "bars":
                marks += list(ax.bar(xs, ys, width=s.width, color=s.color, label=s.label))
            else:
                marks += ax.plot(xs, ys, marker=_MARKERS.get(s.marker, "o"),
                                 markersize=1.6 * s.size,
                                 linestyle=("--" if s.dash else "-") if s.kind == "line"
                                 else "none", linewidth=1.2, color=s.color, label=s.label)
        for ln in panel.lines:
            draw = ax.axvline if ln.axis == "x" else ax.axhline
            draw(ln.value, color=ln.color, linestyle="--" if ln.dash else "-", linewidth=1.2,
                 label=ln.label or None)
        _axes(ax, panel)
        title = ax.set_title(panel.title, fontsize=10, fontweight="bold", wrap=True)
        ax.set_ylabel(panel.y.label, fontsize=8)
        if not fig.share_x or k == len(panels) - 1:
            ax.set_xlabel(panel.x.label, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(axis="y", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:  # beside the plot, never over the data
            legend = ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                               fontsize=7, frameon=False)
            legend.set_gid(f"panel-{k}-legend")
        ax.set_gid(f"panel-{k}")
        ax.patch.set_gid(f"panel-{k}-plot-area")
        title.set_gid(f"panel-{k}-title")
        for n, mark in enumerate(marks):
            mark.set_gid(f"panel-{k}-mark-{n}")
    if caption:
        mfig.suptitle(fig.title, x=0.01, ha="left", fontsize=12, fontweight="bold")
        if notes:
            mfig.supxlabel("\n".join(notes), x=0.01, ha="left", fontsize=8, color="#555555")
    return mfig


_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def _plain(label: str) -> str:
    """A log tick's mathtext (``$\\mathdefault{2\\times10^{-5}}$``) as plain text (``2×10⁻⁵``):
    mathtext becomes loose glyphs in an SVG whose text stays text."""
    m = re.fullmatch(r"\$\\mathdefault\{(.*)\}\$", label)
    if m is None:
        return label
    text = m.group(1).replace("\\times", "×").replace("\\cdot", "·")
    return re.sub(r"\^\{([^}]*)\}", lambda e: e.group(1).translate(_SUPERSCRIPT), text)


def _log_axis(axis) -> None:
    from matplotlib.ticker import LogFormatterSciNotation

    class Plain(LogFormatterSciNotation):  # matplotlib's choice of labels, as plain text
        def __call__(self, x, pos=None):
            return _plain(super().__call__(x, pos))

    axis.set_major_formatter(Plain())  # the formatters a log scale sets by default
    axis.set_minor_formatter(Plain(labelOnlyBase=False))


def _axes(ax, panel) -> None:
    """Scales, limits (the values an axis must show: 0 where asked, whole bands) and ticks."""
    if panel.x.log:
        ax.set_xscale("log")
        _log_axis(ax.xaxis)
    if panel.y.log:
        ax.set_yscale("log")
        _log_axis(ax.yaxis)
    if not panel.y.log:
        lo, hi = ax.get_ylim()
        keep = [*panel.y.include, *(v for b in panel.bands for v in (b.lo, b.hi))]
        ax.set_ylim(min([lo, *keep]), max([hi, *keep]))
    for axis, setter in ((panel.x, ax.set_xlim), (panel.y, ax.set_ylim)):
        if axis.lo is not None or axis.hi is not None:
            setter(axis.lo, axis.hi)
    if panel.x.ticks is not None:
        step = max(1, math.ceil(len(panel.x.ticks) / MAX_TICKS))
        shown = panel.x.ticks[::step]
        ax.set_xticks([v for v, _ in shown], [s for _, s in shown])
    if panel.square:
        lo = min(ax.get_xlim()[0], ax.get_ylim()[0])
        hi = max(ax.get_xlim()[1], ax.get_ylim()[1])
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_aspect("equal", adjustable="box")


def _save(fig: Figure, fmt: str, salt: str, caption: bool, **kwargs) -> bytes:
    matplotlib, _, _ = _import()
    buf = io.BytesIO()
    with matplotlib.rc_context(_rc(salt)):
        _draw(fig, caption).savefig(buf, format=fmt, **kwargs)
    return buf.getvalue()


def png_bytes(fig: Figure, dpi: int = 110) -> bytes:
    """``fig`` (title and notes included) drawn as PNG."""
    return _save(fig, "png", "fp8export", True, dpi=dpi, metadata={"Software": None})


def svg_text(fig: Figure, id_prefix: str = "fig", caption: bool = True) -> str:
    """``fig`` as one ``<svg>`` element, for a .svg file or inline in HTML.

    ``id_prefix`` makes every id unique when several figures share one HTML page;
    ``caption=False`` leaves the title and the notes to the page around the figure (the title
    stays in the SVG's ``<title>``, read by screen readers).
    """
    import html

    raw = _save(fig, "svg", id_prefix, caption, metadata={"Date": None}).decode("utf-8")
    svg = raw[raw.index("<svg"):].strip()
    svg = _ID.sub(lambda m: f"{m.group(1)}{id_prefix}-{m.group(2)}", svg)
    head_end = svg.index(">") + 1
    label = html.escape(fig.title, quote=True)
    return (svg[:head_end - 1] + ' role="img" class="fp8export-figure">'
            + f"<title>{label}</title>" + svg[head_end:])
