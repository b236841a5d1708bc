"""The figures of report.html, built from a verification result (plain data).

Each builder returns a :class:`~fp8export.plots.figure.Figure`, or None when the result has no
data for it, so the page shows panels only where there is something to see. A new family of
measurements adds a builder to :data:`BUILDERS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from fp8export.plots.figure import (
    ALERT,
    NEUTRAL,
    Axis,
    Band,
    Cells,
    Figure,
    Panel,
    RefLine,
    Series,
    layer_and_kind,
    style_of,
)

SCATTER_BINS = 48
KL_BINS = 40
KL_FLOOR = 1e-10  # smaller KL (often exactly 0) is counted in the first bin


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _db(v: Any) -> float:
    """A level to draw: None (not measured) as NaN, which is not drawn."""
    return math.nan if v is None else v


def per_layer_figure(result: dict[str, Any]) -> Figure | None:
    """Isolated and end-to-end SQNR of every quantized linear, grouped by decoder layer."""
    from fp8export.numerics.metrics import E4M3_ROUND_TRIP_SQNR_DB

    layers = sorted(result.get("per_layer") or [], key=lambda r: r["order"])
    if not layers:
        return None
    x: list[float] = []
    ticks: list[tuple[float, str]] = []
    kinds: dict[str, list[int]] = {}
    pos, prev, group_start = 0.0, object(), 0.0
    numbered = all(layer_and_kind(r["module"])[0] is not None for r in layers)
    for i, r in enumerate(layers):
        layer, kind = layer_and_kind(r["module"])
        if not numbered:
            layer, kind = i, r["module"].rsplit(".", 1)[-1]
        if layer != prev:
            if i:
                ticks.append(((group_start + pos - 1) / 2, str(prev)))
                pos += 1.0  # a gap between layers
            group_start, prev = pos, layer
        x.append(pos)
        kinds.setdefault(kind, []).append(i)
        pos += 1.0
    ticks.append(((group_start + pos - 1) / 2, str(prev)))
    series = []
    for j, (kind, idx) in enumerate(kinds.items()):
        color, _ = style_of(j)
        series.append(Series(kind, [x[i] for i in idx], [_db(layers[i]["sqnr_db"]) for i in idx],
                             kind="bars", color=color))
    if any(_finite(r["sqnr_e2e_db"]) for r in layers):
        series.append(Series("end-to-end: the error accumulated up to this layer", x,
                             [_db(r["sqnr_e2e_db"]) for r in layers], kind="points",
                             color=NEUTRAL, marker="diamond"))
    measured = [r for r in layers if r["sqnr_db"] is not None]
    worst = min(measured, key=lambda r: (r["sqnr_db"], r["order"])) if measured else None
    if worst is not None and _finite(worst["sqnr_db"]):
        # a marker just beyond the end of the worst bar, pointing at it
        finite = [v for r in layers for v in (r["sqnr_db"], r["sqnr_e2e_db"]) if _finite(v)]
        span = max(max(finite), 35.0) - min(min(finite), 0.0)
        v = worst["sqnr_db"]
        tip, shape = (v + 0.06 * span, "triangle-down") if v >= 0 else \
            (v - 0.06 * span, "triangle")
        series.append(Series(f"worst: {worst['module']} ({v:.1f} dB)",
                             [x[layers.index(worst)]], [tip], kind="points", color=ALERT,
                             marker=shape, size=6.0))
    lo, hi = E4M3_ROUND_TRIP_SQNR_DB
    lo -= 10 * math.log10(2)  # both operands rounded: the two noises add
    band = Band(lo, hi, f"E4M3 rounding, one or both operands: {lo:.1f}–{hi:.1f} dB")
    notes = [f"{len(layers)} quantized linears. Bars: isolated SQNR (each FP8 layer fed the "
             "reference's own input, so only its own error counts; the table ranks by it). "
             "Higher is better; 0 dB means an error as large as the signal."]
    exact = sum(1 for r in layers if r["sqnr_db"] == math.inf)
    if exact:
        notes.append(f"{exact} layers match the reference exactly (SQNR ∞): not drawn.")
    unmeasured = len(layers) - len(measured)
    if unmeasured:
        notes.append(f"{unmeasured} expert projections got no token of this data (no SQNR): "
                     "not drawn.")
    x_title = "decoder layer (bars in model order within a layer)" if numbered \
        else "quantized linear, model order"
    panel = Panel("Per-layer error: SQNR of each FP8 linear's output", Axis(
        x_title, lo=-1.0, hi=pos, ticks=ticks),
        Axis("output SQNR in dB (higher is better)", include=(0.0,)), series, bands=[band],
        height=240)
    return Figure("Where the error enters", [panel], notes)


def _hist2d(xs: np.ndarray, ys: np.ndarray, lo: float, hi: float, y_lo: float, y_hi: float
            ) -> Cells:
    xe = np.linspace(lo, hi, SCATTER_BINS + 1)
    ye = np.linspace(y_lo, y_hi, SCATTER_BINS + 1)
    counts, _, _ = np.histogram2d(ys, xs, bins=(ye, xe))
    return Cells([float(v) for v in xe], [float(v) for v in ye],
                 [[int(n) for n in row] for row in counts], label="logits per cell")


def logits_figure(result: dict[str, Any]) -> Figure | None:
    """Candidate against reference logits, and the error against the reference, as densities."""
    dist = result.get("distributions") or {}
    xr = np.asarray(dist.get("scatter_reference") or [], dtype=np.float64)
    xc = np.asarray(dist.get("scatter_candidate") or [], dtype=np.float64)
    n = min(xr.size, xc.size)
    if n == 0:
        return None
    xr, xc = xr[:n], xc[:n]
    lo, hi = float(min(xr.min(), xc.min())), float(max(xr.max(), xc.max()))
    if hi <= lo:
        lo, hi = lo - 1.0, hi + 1.0
    err = xc - xr
    span = float(np.abs(err).max()) or 1e-6
    diag = Series("y = x (the candidate equals the reference)", [lo, hi], [lo, hi],
                  color=ALERT, marker="none", dash=True)
    zero = RefLine(0.0, "", axis="y", color=ALERT)
    scatter = Panel("Candidate logit against reference logit", Axis("reference logit"),
                    Axis("candidate logit"), [diag], cells=_hist2d(xr, xc, lo, hi, lo, hi),
                    height=420, square=True)
    error = Panel("Error (candidate − reference) against the reference logit",
                  Axis("reference logit"), Axis("candidate − reference"),
                  cells=_hist2d(xr, err, lo, hi, -span, span), lines=[zero], height=200)
    rms = float(np.sqrt(np.mean(err * err)))
    return Figure("Logits", [scatter, error],
                  [f"{n:,} logits sampled at random from all scored positions. Cells are "
                   f"shaded by count on a log scale. RMS error {rms:.3g}, largest "
                   f"{span:.3g}."], width=540)


def kl_figure(result: dict[str, Any]) -> Figure | None:
    """Histogram of the per-token KL divergence on a log axis, with the mean and the bound."""
    kl = np.asarray((result.get("distributions") or {}).get("kl") or [], dtype=np.float64)
    kl = kl[np.isfinite(kl)]
    if kl.size == 0:
        return None
    floor = int((kl < KL_FLOOR).sum())
    pos = np.clip(kl, KL_FLOOR, None)
    lo, hi = float(pos.min()), float(max(pos.max(), pos.min() * 10))
    edges = np.logspace(np.log10(lo), np.log10(hi), KL_BINS + 1)
    counts, _ = np.histogram(pos, bins=edges)
    mean = float(kl.mean())
    lines = [RefLine(mean, f"mean {mean:.2e}", color=NEUTRAL, dash=False)]
    p99 = float(np.percentile(kl, 99))
    lines.append(RefLine(max(p99, KL_FLOOR), f"99th percentile {p99:.2e}", color="#777777"))
    for metric in ("kl_mean", "kl_p99"):
        bound = ((result.get("thresholds") or {}).get(metric) or {}).get("value")
        if _finite(bound) and bound > 0:
            lines.append(RefLine(bound, f"{metric} threshold {bound:g}", color=ALERT))
    notes = [f"KL(reference ‖ candidate) of the next-token distributions at {kl.size:,} "
             "positions, in nats. The gate compares the mean and the 99th percentile with "
             "their thresholds (red)."]
    if floor:
        notes.append(f"{floor:,} positions with KL below {KL_FLOOR:g} (often exactly 0) are "
                     "counted in the first bin.")
    panel = Panel("KL divergence per token", Axis("KL per token, nats (log scale)", log=True),
                  Axis("tokens", include=(0.0,)),
                  [Series("tokens per bin", [float(v) for v in edges],
                          [float(c) for c in counts], kind="hist", color="#009E73")],
                  lines=lines, height=220)
    return Figure("Per-token divergence", [panel], notes)


BUILDERS: tuple[Callable[[dict[str, Any]], Figure | None], ...] = (
    per_layer_figure, kl_figure, logits_figure)


def figures(result: dict[str, Any]) -> list[Figure]:
    """Every figure that has data, in page order."""
    out = []
    for build in BUILDERS:
        fig = build(result)
        fig = fig.drawable() if fig is not None else None
        if fig is not None:
            out.append(fig)
    return out
