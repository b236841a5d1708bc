"""report.html: one self-contained page (inline CSS and SVG charts drawn by matplotlib; no
scripts, nothing to fetch). Every string from the run is HTML-escaped: paths, module names and
sample text are untrusted input (matplotlib escapes the text it writes into the SVG)."""

from __future__ import annotations

import html
from typing import Any

from fp8export.reports.report import (
    NOISE_FLOOR_HEAD,
    NOISE_FLOOR_TEXT,
    NOISE_FLOOR_TITLE,
    confidence_summary,
    format_db,
    format_value,
    header_rows,
    interval_text,
    layer_check_text,
    metric_rows,
    noise_floor_rows,
    threshold_text,
    worst_sample_text,
)

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:2em auto;max-width:1100px;
padding:0 1.5em;color:#222;line-height:1.4}
h1{margin-bottom:.3em}h2{margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;margin:.8em 0}td,th{border:1px solid #ccc;padding:4px 8px;
text-align:left;font-size:14px;vertical-align:top}th{background:#f3f3f3}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.pass{color:#1a7f37}.fail{color:#c00;font-weight:bold}.na{color:#888}
code{font-size:13px;overflow-wrap:anywhere}
table.header th{width:9em;background:none;border:none;padding:2px 8px 2px 0;color:#555}
table.header td{border:none;padding:2px 0;overflow-wrap:anywhere}
.note{background:#fff8e1;padding:8px;border-left:4px solid #f0b400}
figure{margin:1em 0}figure svg{max-width:100%;height:auto;border:1px solid #eee}
figcaption p{margin:.3em 0;font-size:14px}
td.text{max-width:34em;overflow-wrap:anywhere;font-family:ui-monospace,monospace;font-size:13px}
mark{background:#ffd54f;padding:0 1px}.muted{color:#666}
code span.w{white-space:nowrap}
"""


def _e(s: Any) -> str:
    return html.escape(str(s), quote=True)


def _code(text: str) -> str:
    """Monospace text that wraps between words (a command never breaks inside "--x"); only a
    word too long for a line (a deep path) breaks anywhere."""
    words = " ".join(f"<span class='w'>{_e(w)}</span>" if len(w) <= 40 else _e(w)
                     for w in str(text).split(" "))
    return f"<code>{words}</code>"


def _header(result: dict[str, Any]) -> list[str]:
    parts = ["<table class='header'>"]
    for label, text, code in header_rows(result):
        value = " — ".join(x for x in (_code(code) if code else "",
                                       _e(text) if text else "") if x)
        parts.append(f"<tr><th>{_e(label)}</th><td>{value}</td></tr>")
    parts.append("</table>")
    return parts


def _checks(result: dict[str, Any]) -> list[str]:
    level = (result.get("confidence") or {}).get("level", 0.95)
    parts = ["<h2 id='checks'>Threshold checks</h2><table><tr><th>metric</th><th>value</th>"
             f"<th>{level:.0%} interval</th><th>threshold</th><th>result</th></tr>"]
    cls = {"passed": "pass", "failed": "fail", "skipped": "na"}
    for c in result["checks"]:
        parts.append(f"<tr><td><code>{_e(c['metric'])}</code></td>"
                     f"<td class='num'>{_e(format_value(c['value']))}</td>"
                     f"<td class='num'>{_e(interval_text(c))}</td>"
                     f"<td class='num'>{_e(threshold_text(c))}</td>"
                     f"<td class='{cls[c['status']]}'>{_e(c['status'])}</td></tr>")
    parts.append("</table>")
    head, warnings = confidence_summary(result)
    if head:
        parts.append(f"<p class='muted'>{_e(head)}</p>")
        parts += [f"<p class='note'>⚠ {_e(w)}</p>" for w in warnings]
    layers_text, layers_failed = layer_check_text(result)
    if layers_text:
        parts.append(f"<p class='{'note' if layers_failed else 'muted'}'>{_e(layers_text)}</p>")
    return parts + _noise_floor(result)


def _noise_floor(result: dict[str, Any]) -> list[str]:
    rows = noise_floor_rows(result)
    if not rows:
        return []
    dtype = result["noise_floor"]["reference_dtype"]
    parts = [f"<h2 id='noise-floor'>{_e(NOISE_FLOOR_TITLE.format(dtype=dtype))}</h2>",
             f"<p class='muted'>{_e(NOISE_FLOOR_TEXT.format(dtype=dtype))}</p><table><tr>"
             + "".join(f"<th>{_e(h)}</th>" for h in NOISE_FLOOR_HEAD) + "</tr>"]
    for m, *values in rows:
        parts.append(f"<tr><td><code>{_e(m)}</code></td>"
                     + "".join(f"<td class='num'>{_e(v)}</td>" for v in values) + "</tr>")
    parts.append("</table>")
    return parts


def _figures(result: dict[str, Any]) -> list[str]:
    from fp8export.plots.mpl import svg_text
    from fp8export.reports.charts import figures

    parts = []
    for i, fig in enumerate(figures(result)):
        svg = svg_text(fig, f"fig{i}", caption=False)
        notes = "".join(f"<p>{_e(n)}</p>" for n in fig.notes)  # text that reflows with the page
        parts.append(f"<h2 id='figure-{i + 1}'>{_e(fig.title)}</h2><figure>{svg}"
                     f"<figcaption class='muted'>{notes}</figcaption></figure>")
    return parts


def _layers(result: dict[str, Any], max_layers: int) -> list[str]:
    layers = result.get("per_layer") or []
    if not layers:
        return []
    parts = [f"<h2 id='layers'>Layers ranked worst first ({len(layers)} quantized"
             f"{f', {max_layers} shown' if len(layers) > max_layers else ''})</h2><table><tr>"
             "<th>rank</th><th>module</th><th>isolated SQNR dB</th><th>end-to-end SQNR dB</th>"
             "<th>saturated</th><th>weight SQNR dB</th></tr>"]
    for r in layers[:max_layers]:
        parts.append(f"<tr><td class='num'>{r['rank']}</td><td><code>{_e(r['module'])}</code>"
                     f"</td><td class='num'>{format_db(r['sqnr_db'])}</td>"
                     f"<td class='num'>{format_db(r['sqnr_e2e_db'])}</td>"
                     f"<td class='num'>{r['saturated']:.2%}</td>"
                     f"<td class='num'>{format_db(r.get('weight_sqnr_db'))}</td></tr>")
    parts.append("</table>")
    return parts


def _worst_samples(result: dict[str, Any]) -> list[str]:
    worst = result.get("worst_samples") or []
    if not worst:
        return []
    token_level = any(s.get("position") is not None for s in worst)
    parts = [f"<h2 id='worst-samples'>Worst samples ({len(worst)} with the largest mean KL)</h2>",
             "<p class='muted'>"
             + ("Text before the position where the candidate diverged most, that token "
                "<mark>highlighted</mark>, and what each model predicted next there (with its "
                "probability)." if token_level else "The sample's text and both predictions.")
             + " Text is shortened and shown as data.</p>",
             "<table><tr><th>sample</th><th>tokens</th><th>KL mean</th><th>KL max"
             + (" (at token)" if token_level else "") + "</th><th>text</th>"
               "<th>predictions</th></tr>"]
    for s in worst:
        context, token, pred = worst_sample_text(s)
        text = _e(context) + (f"<mark>{_e(token)}</mark>" if token is not None else "")
        at = f" (at {s['position']})" if s.get("position") is not None else ""
        parts.append(f"<tr><td class='num'>{_e(s['index'])}</td>"
                     f"<td class='num'>{_e(s.get('tokens'))}</td>"
                     f"<td class='num'>{format_value(s.get('kl_mean'))}</td>"
                     f"<td class='num'>{format_value(s.get('kl_max'))}{at}</td>"
                     f"<td class='text'>{text}</td><td>{_e(pred)}</td></tr>")
    parts.append("</table>")
    return parts


def _metrics(result: dict[str, Any]) -> list[str]:
    parts = ["<h2 id='metrics'>All metrics</h2>"
             "<table><tr><th>family</th><th>metric</th><th>value</th></tr>"]
    for group, k, v in metric_rows(result["metrics"]):
        parts.append(f"<tr><td>{_e(group)}</td><td><code>{_e(k)}</code></td>"
                     f"<td class='num'>{_e(format_value(v))}</td></tr>")
    parts.append("</table>")
    return parts


def html_report(result: dict[str, Any], max_layers: int = 30) -> str:
    """The whole page: verdict, header, notes, checks, plots, layers, worst samples, metrics."""
    passed = result["passed"]
    word = "PASSED" if passed else "FAILED"
    verdict = f'<span class="{"pass" if passed else "fail"}">{word}</span>'
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
             f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
             f"<title>fp8export verify: {word}</title><style>{_CSS}</style></head><body>",
             f"<h1>fp8export verify: {verdict}</h1>"]
    parts += _header(result)
    parts += [f"<p class='note'>{_e(note)}</p>" for note in result.get("notes", [])]
    parts += _checks(result)
    parts += _figures(result)
    parts += _layers(result, max_layers)
    parts += _worst_samples(result)
    parts += _metrics(result)
    parts.append("</body></html>")
    return "\n".join(parts)
