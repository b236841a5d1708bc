"""``inspect --plot``: per-layer weight scale, input scale and SQNR, one line per projection."""

from __future__ import annotations

import re
from pathlib import Path

from fp8export.errors import Fp8ExportError
from fp8export.inspect.result import InspectResult, TensorRow

_LAYER = re.compile(r"\.(\d+)\.")


def _series(rows: list[TensorRow]) -> dict[str, list[tuple[int, TensorRow]]]:
    """Projection kind ("self_attn.q_proj") → [(layer index, row)]; modules outside numbered
    layers get their position in the table as x."""
    series: dict[str, list[tuple[int, TensorRow]]] = {}
    for pos, row in enumerate(rows):
        module = row.name.removesuffix(".weight")
        m = _LAYER.search(module)
        if m:
            kind, x = module[m.end():] or module, int(m.group(1))
        else:
            kind, x = module, pos
        series.setdefault(kind, []).append((x, row))
    return series


def write_plot(result: InspectResult, path: Path) -> None:
    """Draw the plot to ``path`` (PNG); raise Fp8ExportError if it cannot be written."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display, ever (CI, servers)
    import matplotlib.pyplot as plt

    rows = [r for r in result.tensors if r.role in ("quantized", "candidate")]
    panels = (("scale", "weight scale (amax/448)", True),
              ("input_scale", "input scale", True),
              ("sqnr_db", "weight SQNR (dB)", False))
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 9), sharex=True)
    series = _series(rows)
    for ax, (attr, label, log) in zip(axes, panels):
        drawn = False
        for kind, points in series.items():
            pts = [(x, getattr(r, attr)) for x, r in points
                   if getattr(r, attr) is not None and getattr(r, attr) == getattr(r, attr)
                   and abs(getattr(r, attr)) != float("inf")]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", markersize=3, linewidth=1, label=kind)
                drawn = True
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if drawn and log:
            ax.set_yscale("log")
        if not drawn:
            why = " (no static activation scales)" if attr == "input_scale" else ""
            ax.text(0.5, 0.5, f"no {label}{why}", ha="center", va="center",
                    transform=ax.transAxes, color="gray")
    from matplotlib.ticker import MaxNLocator

    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel("layer")
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper right", fontsize="small",
                   ncol=max(1, len(labels) // 8))
    title = "FP8 folder" if result.kind == "fp8-folder" else "checkpoint (scales convert would use)"
    fig.suptitle(f"{Path(result.path).name}: {title}")
    fig.tight_layout(rect=(0, 0, 0.85 if handles else 1, 0.96))
    try:
        fig.savefig(path, format="png", dpi=100)
    except OSError as exc:
        raise Fp8ExportError(f"{path}: cannot write the plot ({exc.strerror or exc}). "
                             "Choose a writable path for --plot.") from exc
    finally:
        plt.close(fig)
