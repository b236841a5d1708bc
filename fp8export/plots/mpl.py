"""Render a :class:`~fp8export.plots.figure.Figure` to PNG with matplotlib (optional extra).

The same figure as the SVG renderer draws: panels stacked, a legend beside each plot (never
over the data), bands, reference lines, bars, histograms and density cells; notes at the foot.
"""

from __future__ import annotations

import io
import math
import textwrap

from fp8export.plots.figure import Figure

_MARKERS = {"circle": "o", "square": "s", "diamond": "D", "triangle": "^",
            "triangle-down": "v", "plus": "+", "cross": "x", "none": ""}


def png_bytes(fig: Figure, dpi: int = 110) -> bytes:
    """``fig`` drawn as PNG. Needs matplotlib (``pip install 'fp8export[plot]'``)."""
    from fp8export._lazy import missing

    try:
        import matplotlib
    except ImportError as exc:
        raise missing("matplotlib", "PNG plots; write .svg to need nothing", exc) from exc
    matplotlib.use("Agg", force=True)  # no display, ever (CI, servers)
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    panels = [p for p in fig.panels if p.has_data()]
    heights = [p.height / 100 + 0.9 for p in panels]
    mfig, axes = plt.subplots(len(panels), 1, figsize=(fig.width / 100 + 3.2, sum(heights) + 1.2),
                              gridspec_kw={"height_ratios": heights}, squeeze=False,
                              sharex=fig.share_x, layout="constrained")
    for k, (ax, panel) in enumerate(zip(axes[:, 0], panels)):
        for b in panel.bands:
            ax.axhspan(b.lo, b.hi, color=b.color, alpha=0.15, label=b.label)
        if panel.cells is not None:
            c = panel.cells
            ax.pcolormesh(c.x_edges, c.y_edges, [[n or math.nan for n in row] for row in c.counts],
                          cmap="Blues", norm=LogNorm(vmin=1), label=c.label)
        for s in panel.series:
            if s.kind == "hist":
                ax.stairs(s.y, s.x, fill=True, color=s.color, label=s.label)
            elif s.kind == "bars":
                ax.bar(s.x, s.y, width=s.width, color=s.color, label=s.label)
            else:
                ax.plot(s.x, s.y, marker=_MARKERS.get(s.marker, "o"), markersize=4,
                        linestyle=("--" if s.dash else "-") if s.kind == "line" else "none",
                        linewidth=1.2, color=s.color, label=s.label)
        for ln in panel.lines:
            draw = ax.axvline if ln.axis == "x" else ax.axhline
            draw(ln.value, color=ln.color, linestyle="--" if ln.dash else "-", linewidth=1.2,
                 label=ln.label or None)
        if panel.x.log:
            ax.set_xscale("log")
        if panel.y.log:
            ax.set_yscale("log")
        if not panel.y.log:  # the values the axis must show: 0 where asked, whole bands
            lo, hi = ax.get_ylim()
            keep = [*panel.y.include, *(v for b in panel.bands for v in (b.lo, b.hi))]
            ax.set_ylim(min(lo, *keep), max(hi, *keep))
        for axis, setter in ((panel.x, ax.set_xlim), (panel.y, ax.set_ylim)):
            if axis.lo is not None or axis.hi is not None:
                setter(axis.lo, axis.hi)
        if panel.x.ticks is not None:
            ax.set_xticks([v for v, _ in panel.x.ticks], [s for _, s in panel.x.ticks])
        if panel.square:
            ax.set_aspect("equal", adjustable="box")
        ax.set_title(panel.title, loc="left", fontsize=10, fontweight="bold")
        ax.set_ylabel(panel.y.label, fontsize=8)
        if not fig.share_x or k == len(panels) - 1:
            ax.set_xlabel(panel.x.label, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:  # beside the plot, never over the data
            ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
                      frameon=False)
    mfig.suptitle(fig.title, x=0.01, ha="left", fontsize=12, fontweight="bold")
    if fig.notes:
        mfig.supxlabel("\n".join(textwrap.fill(n, 150) for n in fig.notes), x=0.01, ha="left",
                       fontsize=8, color="#555555")
    buf = io.BytesIO()
    try:
        mfig.savefig(buf, format="png", dpi=dpi)
    finally:
        plt.close(mfig)
    return buf.getvalue()
