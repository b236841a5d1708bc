"""``inspect --plot``: per-layer weight scale, input scale and weight SQNR of a checkpoint or an
FP8 folder, drawn by matplotlib as SVG or PNG, chosen by the file's extension.

What the figure shows: one panel per quantity that has data (a bf16 checkpoint has no input
scales, so no input-scale panel). Members of a fused group (q/k/v, gate/up) share one weight
scale and one input scale, so a group is drawn once, named with its members; SQNR differs per
member and is drawn per projection. The SQNR axis starts at 0 dB and marks what E4M3 rounding
itself gives, so a spread of tenths of a dB reads as the noise it is.
"""

from __future__ import annotations

import math
from pathlib import Path

from fp8export.errors import Fp8ExportError, UsageError
from fp8export.inspect.result import InspectResult, TensorRow
from fp8export.plots.figure import Axis, Band, Figure, Panel, Series, layer_and_kind, style_of

FORMATS = (".svg", ".png")


def _value(row: TensorRow, attr: str) -> float | None:
    v = getattr(row, attr)
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def _positions(rows: list[TensorRow]) -> tuple[dict[str, float], list[tuple[float, str]], str]:
    """x of each row's layer (numbered layers first, others after), ticks, and the x title."""
    layers = sorted({k for k in (layer_and_kind(_module(r))[0] for r in rows) if k is not None})
    x: dict[str, float] = {}
    ticks = [(float(k), str(k)) for k in layers]
    nxt = float(layers[-1] + 1) if layers else 0.0
    for r in rows:
        layer, _ = layer_and_kind(_module(r))
        if layer is not None:
            x[r.name] = float(layer)
        else:
            x[r.name] = nxt
            ticks.append((nxt, _module(r)))
            nxt += 1.0
    title = "layer (side by side within a layer: one marker per projection)" if layers \
        else "quantized linear"
    return x, ticks, title


def _module(row: TensorRow) -> str:
    return row.name.removesuffix(".weight")


def _keys(rows: list[TensorRow], attr: str) -> dict[str, tuple[str, str]]:
    """Row name → (series key, legend label). A fused group whose members hold the same value
    in every layer becomes one series named after the group; otherwise one per projection."""
    groups: dict[str, list[TensorRow]] = {}
    for r in rows:
        if r.fused_group and _value(r, attr) is not None:
            groups.setdefault(r.fused_group, []).append(r)
    shared_kinds: dict[str, set[str]] = {}  # group kind ("self_attn.qkv") → member kinds
    split: set[str] = set()
    for group, members in groups.items():
        g_kind = layer_and_kind(group)[1]
        kinds = {layer_and_kind(_module(m))[1] for m in members}
        values = {_value(m, attr) for m in members}
        if len(members) > 1 and len(values) == 1:
            shared_kinds.setdefault(g_kind, set()).update(kinds)
        else:
            split.add(g_kind)
    out: dict[str, tuple[str, str]] = {}
    for r in rows:
        kind = layer_and_kind(_module(r))[1]
        g_kind = layer_and_kind(r.fused_group)[1] if r.fused_group else None
        if g_kind in shared_kinds and g_kind not in split:
            leaves = ", ".join(_member_order(g_kind, shared_kinds[g_kind]))
            out[r.name] = (g_kind, f"{g_kind} (fused: {leaves} share one scale)")
        else:
            out[r.name] = (kind, kind)
    return out


def _member_order(group_kind: str, kinds: set[str]) -> list[str]:
    """Members in the order the group's tag names them ("qkv": q, k, v; "gate_up": gate, up)."""
    tag = group_kind.rsplit(".", 1)[-1]
    leaves = [k.rsplit(".", 1)[-1] for k in kinds]
    return sorted(leaves, key=lambda leaf: (tag.find(leaf.split("_")[0]) % (len(tag) + 1), leaf))


def _series(rows: list[TensorRow], attr: str, x: dict[str, float], styles: dict[str, int],
            shared: bool) -> list[Series]:
    """One series per key; ``styles`` (key → style index) keeps a key's look across panels.
    ``shared``: the quantity is one per fused group (scales), so groups may be drawn once."""
    keys = _keys(rows, attr) if shared else {
        r.name: (layer_and_kind(_module(r))[1],) * 2 for r in rows}
    order: list[str] = []
    labels: dict[str, str] = {}
    points: dict[str, dict[float, float]] = {}
    for r in rows:
        v = _value(r, attr)
        if v is None:
            continue
        key, label = keys[r.name]
        if key not in points:
            order.append(key)
            labels[key] = label
            points[key] = {}
        points[key][x[r.name]] = v  # a shared group: every member has the same value
    n = len(order)
    out = []
    for j, key in enumerate(order):
        offset = (j - (n - 1) / 2) * min(0.8 / max(n, 1), 0.15)
        xs = sorted(points[key])
        color, marker = style_of(styles.setdefault(key, len(styles)))
        out.append(Series(labels[key], [v + offset for v in xs], [points[key][v] for v in xs],
                          kind="line", color=color, marker=marker))
    return out


def figure(result: InspectResult) -> Figure:
    """The figure of an inspect result (panels without data are left out)."""
    from fp8export.numerics.metrics import E4M3_ROUND_TRIP_SQNR_DB

    rows = [r for r in result.tensors if r.role in ("quantized", "candidate")]
    x, ticks, x_title = _positions(rows)
    xs = list(x.values()) or [0.0]
    x_axis = Axis(x_title, lo=min(xs) - 0.6, hi=max(xs) + 0.6, ticks=ticks)
    lo, hi = E4M3_ROUND_TRIP_SQNR_DB
    styles: dict[str, int] = {}
    panels = [
        Panel("Weight scale (amax / 448) per layer", x_axis,
              Axis("weight scale (log scale)", log=True), _series(rows, "scale", x, styles, True)),
        Panel("Input (activation) scale per layer", x_axis,
              Axis("input scale (log scale)", log=True),
              _series(rows, "input_scale", x, styles, True)),
        Panel("Weight round-trip SQNR (E4M3 → dequantized vs the original)", x_axis,
              Axis("SQNR in dB (higher is better; axis from 0)", include=(0.0,)),
              _series(rows, "sqnr_db", x, styles, False),
              bands=[Band(lo, hi, f"E4M3 rounding of well-scaled weights: {lo:.1f}–{hi:.1f} dB")]),
    ]
    what = ("FP8 folder (scales as stored)" if result.kind == "fp8-folder"
            else "checkpoint (the scales convert would use)")
    layers = {layer_and_kind(_module(r))[0] for r in rows} - {None}
    notes = [f"{len(rows)} quantized linears" + (f" in {len(layers)} layers" if layers else "")
             + ". Fused groups (q/k/v, gate/up) share one weight scale and one input scale and "
             "are drawn once, named with their members."]
    if not any(_value(r, "input_scale") is not None for r in rows):
        notes.append("No static input scales (dynamic activations, or none recorded): no "
                     "input-scale panel.")
    exact = sum(1 for r in rows if r.sqnr_db is not None and math.isinf(r.sqnr_db))
    if exact:
        notes.append(f"{exact} weights round-trip exactly (SQNR ∞) and are not drawn.")
    return Figure(f"{Path(result.path).name}: {what}", panels, notes, share_x=True)


def check_plot_target(path: Path, force: bool = False, source: Path | None = None) -> None:
    """Refuse an unknown extension, a path that is or holds the inspected ``source``, or an
    existing file without ``force`` or that is not a regular file (before any work)."""
    from fp8export.io.outputs import check_file_target, refuse_overlap

    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        what = repr(path.suffix) if path.suffix else "a name without extension"
        raise UsageError(f"{path}: --plot writes .svg or .png, not {what}. Name the file "
                         "e.g. scales.svg or scales.png.")  # an option value: exit 2
    if path.is_dir() and not path.is_symlink():
        raise Fp8ExportError(f"{path}: is a folder. Give a file name for --plot, e.g. "
                             f"{path / 'scales.svg'}.")
    refuse_overlap(path, [source], "--plot")
    check_file_target(path, force, "--plot")


def write_plot(result: InspectResult, path: Path, force: bool = False,
               source: Path | None = None) -> None:
    """Write the figure to ``path``: ``.svg`` or ``.png``, by its extension.

    Raises:
        Fp8ExportError: another extension, nothing to plot, ``path`` exists without ``force``,
            or it cannot be written.
    """
    from fp8export.io.atomic import write_file_atomic

    path = Path(path)
    check_plot_target(path, force, source)
    suffix = path.suffix.lower()
    fig = figure(result).drawable()
    if fig is None:
        raise Fp8ExportError(f"{result.path}: no quantized or quantizable linear layers, so "
                             "there is nothing to plot. Inspect without --plot for the table.")
    from fp8export.plots.mpl import png_bytes, svg_text

    data = svg_text(fig, "inspect").encode("utf-8") if suffix == ".svg" else png_bytes(fig)
    write_file_atomic(path, data, what="the plot")  # an OSError becomes one clear error
