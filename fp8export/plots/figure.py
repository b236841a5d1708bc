"""What a chart shows, independent of how it is drawn (SVG here, PNG through matplotlib).

A :class:`Figure` is a title, a few lines of explanation, and panels stacked vertically that
may share their x axis. A panel holds marks in data coordinates: series (lines, points, bars),
horizontal bands and reference lines, and density cells. Builders decide *what* to show (and
leave a panel out when it has no data); renderers decide only *where*.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# Okabe–Ito colours (distinct for colour-blind readers), then neutral greys.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#8C6D00",
           "#555555", "#999999")
MARKERS = ("circle", "square", "diamond", "triangle", "triangle-down", "plus", "cross")
ALERT = "#C0102A"  # failures, thresholds, the worst layer
NEUTRAL = "#333333"


@dataclass
class Series:
    """A named set of points.

    ``kind``: "line" (joined, with markers unless ``marker`` is "none"), "points", "bars"
    (from 0, ``width`` x units wide), or "hist" (``x`` holds the len(y) + 1 bin edges).
    """

    label: str
    x: list[float]
    y: list[float]
    kind: str = "line"
    color: str = PALETTE[0]
    marker: str = "circle"
    width: float = 0.8  # bar width in x units
    dash: bool = False
    size: float = 3.5  # marker radius, px


@dataclass
class Band:
    """A horizontal band ``[lo, hi]`` across the plot (a theoretical range)."""

    lo: float
    hi: float
    label: str
    color: str = "#2CA02C"


@dataclass
class RefLine:
    """A reference line at ``value`` on the x axis (vertical) or y axis (horizontal)."""

    value: float
    label: str
    axis: str = "x"
    color: str = NEUTRAL
    dash: bool = True


@dataclass
class Cells:
    """A density grid: ``counts[i][j]`` for x in ``[x_edges[j], x_edges[j+1])``, y likewise."""

    x_edges: list[float]
    y_edges: list[float]
    counts: list[list[int]]
    label: str = "count"


@dataclass
class Axis:
    """An axis: its title, linear or log, and optional fixed limits, values to include, ticks.

    ``ticks`` given as ``[(value, label)]`` replace the automatic ones (categorical axes).
    """

    label: str
    log: bool = False
    lo: float | None = None
    hi: float | None = None
    include: tuple[float, ...] = ()
    ticks: list[tuple[float, str]] | None = None


@dataclass
class Panel:
    title: str
    x: Axis
    y: Axis
    series: list[Series] = field(default_factory=list)
    bands: list[Band] = field(default_factory=list)
    lines: list[RefLine] = field(default_factory=list)
    cells: Cells | None = None
    height: int = 220
    square: bool = False  # equal px per unit on both axes (scatter of y against x)

    def has_data(self) -> bool:
        finite = any(math.isfinite(v) for s in self.series for v in s.y)
        return finite or (self.cells is not None and any(map(any, self.cells.counts)))


@dataclass
class Figure:
    title: str
    panels: list[Panel]
    notes: list[str] = field(default_factory=list)  # lines under the title
    width: int = 860
    share_x: bool = False  # one x axis (the first panel's) for all; labelled under the last

    def drawable(self) -> Figure | None:
        """The figure without empty panels, or None when nothing is left to draw."""
        panels = [p for p in self.panels if p.has_data()]
        if not panels:
            return None
        return Figure(self.title, panels, list(self.notes), self.width, self.share_x)


_LAYER = re.compile(r"(?:^|\.)(\d+)\.")


def layer_and_kind(module: str) -> tuple[int | None, str]:
    """``"model.layers.3.self_attn.q_proj"`` → ``(3, "self_attn.q_proj")``; no index → None."""
    m = _LAYER.search(module)  # the first index is the layer (a later one: an MoE expert)
    if m is None:
        return None, module
    return int(m.group(1)), module[m.end():] or module


def style_of(index: int) -> tuple[str, str]:
    """The (colour, marker) of the ``index``-th series: every pair differs in both."""
    return PALETTE[index % len(PALETTE)], MARKERS[index % len(MARKERS)]
