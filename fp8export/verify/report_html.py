"""report.html: one self-contained page (inline CSS, plots as base64 PNG, no scripts)."""

from __future__ import annotations

import base64
import html
import io
from typing import Any

from fp8export.errors import Fp8ExportError
from fp8export.verify.report import METRIC_ORDER, _fmt


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _plots(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(title, base64 png) pairs: per-layer SQNR, logit scatter, KL histogram."""
    from fp8export._lazy import lazy_import

    matplotlib = lazy_import("matplotlib", "the plots of report.html")
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import numpy as np

    plots = []
    layers = result.get("per_layer") or []
    if layers:
        by_order = sorted(layers, key=lambda r: r["order"])
        finite = [r["sqnr_db"] if np.isfinite(r["sqnr_db"]) else np.nan for r in by_order]
        e2e = [r["sqnr_e2e_db"] if np.isfinite(r["sqnr_e2e_db"]) else np.nan for r in by_order]
        fig, ax = plt.subplots(figsize=(10, 3.6))
        x = np.arange(len(by_order))
        ax.bar(x, finite, color="#4c72b0", label="isolated (layer alone)")
        ax.plot(x, e2e, color="#dd8452", marker=".", lw=1, label="end-to-end (accumulated)")
        worst = layers[0]
        ax.annotate(worst["module"], (worst["order"], finite[worst["order"]]), fontsize=7,
                    xytext=(5, -12), textcoords="offset points", color="#c44e52")
        ax.set_xlabel("quantized linear (model order)")
        ax.set_ylabel("output SQNR (dB, higher is better)")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        plots.append(("Per-layer error (SQNR of each FP8 linear's output)", _png(fig)))
    dist = result.get("distributions") or {}
    xr, xc = dist.get("scatter_reference") or [], dist.get("scatter_candidate") or []
    if xr:
        fig, ax = plt.subplots(figsize=(5, 5))
        ax.scatter(xr, xc, s=2, alpha=0.3, color="#4c72b0", rasterized=True)
        lo, hi = min(min(xr), min(xc)), max(max(xr), max(xc))
        ax.plot([lo, hi], [lo, hi], color="#c44e52", lw=1, label="y = x")
        ax.set_xlabel("reference logit")
        ax.set_ylabel("candidate logit")
        ax.set_title(f"{len(xr)} sampled logits", fontsize=9)
        ax.legend(fontsize=8)
        plots.append(("Logit scatter (candidate vs reference)", _png(fig)))
    kl = np.asarray(dist.get("kl") or [], dtype=np.float64)
    if kl.size:
        fig, ax = plt.subplots(figsize=(7, 3.4))
        pos = np.clip(kl, 1e-10, None)
        bins = np.logspace(np.log10(pos.min()), np.log10(max(pos.max(), pos.min() * 10)), 50)
        ax.hist(pos, bins=bins, color="#55a868")
        ax.set_xscale("log")
        thr = (result.get("thresholds") or {}).get("kl_mean")
        if thr:
            ax.axvline(thr["value"], color="#c44e52", ls="--", lw=1, label="kl_mean threshold")
        ax.axvline(kl.mean(), color="#333", lw=1, label=f"mean {kl.mean():.2e}")
        ax.set_xlabel("KL(reference ‖ candidate) per token (nats)")
        ax.set_ylabel("tokens")
        ax.legend(fontsize=8)
        plots.append(("KL divergence per token", _png(fig)))
    return plots


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;
text-align:left;font-size:14px}th{background:#f3f3f3}.pass{color:#1a7f37}.fail{color:#c00;
font-weight:bold}.na{color:#888}code{font-size:13px}img{max-width:100%}.note{background:#fff8e1;
padding:8px;border-left:4px solid #f0b400}"""


def html_report(result: dict[str, Any], max_layers: int = 30) -> str:
    e = html.escape
    passed = result["passed"]
    verdict = '<span class="pass">PASSED</span>' if passed else '<span class="fail">FAILED</span>'
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>fp8export verify: "
             f"{'PASSED' if passed else 'FAILED'}</title><style>{_CSS}</style></head><body>",
             f"<h1>fp8export verify: {verdict}</h1><ul>",
             f"<li>Reference: <code>{e(result['reference']['path'])}</code> "
             f"({e(str(result['reference'].get('dtype', '')))})</li>",
             f"<li>Candidate: <code>{e(result['candidate']['path'])}</code> "
             f"(backend {e(result['backend'])})</li>",
             f"<li>Data: {e(result['data']['source'])}, {result['samples']} samples</li>",
             f"<li>Thresholds: {e(result['thresholds_source'])}</li></ul>"]
    for note in result.get("notes", []):
        parts.append(f"<p class='note'>{e(note)}</p>")
    parts.append("<h2>Threshold checks</h2><table><tr><th>metric</th><th>value</th>"
                 "<th>threshold</th><th>result</th></tr>")
    cls = {"passed": "pass", "failed": "fail", "skipped": "na"}
    for c in result["checks"]:
        sym = "≥" if c["op"] == "min" else "≤"
        parts.append(f"<tr><td><code>{e(c['metric'])}</code></td><td>{e(_fmt(c['value']))}</td>"
                     f"<td>{sym} {c['threshold']:g}</td><td class='{cls[c['status']]}'>"
                     f"{c['status']}</td></tr>")
    parts.append("</table><h2>All metrics</h2><table><tr><th>metric</th><th>value</th></tr>")
    for k in METRIC_ORDER:
        if k in result["metrics"]:
            parts.append(f"<tr><td><code>{k}</code></td>"
                         f"<td>{e(_fmt(result['metrics'][k]))}</td></tr>")
    parts.append("</table>")
    try:
        plots = _plots(result)
    except Fp8ExportError as exc:  # matplotlib is an optional extra: the report still renders
        plots = []
        parts.append(f"<p class='note'>No plots: {e(str(exc))}</p>")
    for title, png in plots:
        parts.append(f"<h2>{e(title)}</h2><img alt='{e(title)}' src=\"data:image/png;base64,"
                     f"{png}\">")
    layers = result.get("per_layer") or []
    if layers:
        parts.append(f"<h2>Layers ranked worst first ({len(layers)} quantized)</h2><table><tr>"
                     "<th>rank</th><th>module</th><th>isolated SQNR dB</th>"
                     "<th>end-to-end SQNR dB</th><th>saturated</th><th>weight SQNR dB</th></tr>")
        for r in layers[:max_layers]:
            parts.append(f"<tr><td>{r['rank']}</td><td><code>{e(r['module'])}</code></td>"
                         f"<td>{_fmt(r['sqnr_db'])}</td><td>{_fmt(r['sqnr_e2e_db'])}</td>"
                         f"<td>{r['saturated']:.2%}</td><td>{_fmt(r['weight_sqnr_db'])}</td></tr>")
        parts.append("</table>")
    worst = sorted(result.get("per_sample") or [], key=lambda s: s["kl_mean"], reverse=True)[:10]
    if worst:
        parts.append("<h2>Worst samples by KL</h2><table><tr><th>sample</th><th>tokens</th>"
                     "<th>kl_mean</th><th>cosine</th><th>top1</th></tr>")
        for s in worst:
            parts.append(f"<tr><td>{s['index']}</td><td>{s['tokens']}</td>"
                         f"<td>{_fmt(s['kl_mean'])}</td><td>{_fmt(s['cosine'])}</td>"
                         f"<td>{_fmt(s['top1_agreement'])}</td></tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)
