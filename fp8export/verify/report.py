"""Reports from a verification result: report.json, report.md, and the writer of all four.

The result is already plain data (see run.py); reporting only formats it. Non-finite floats
are written to JSON as the strings "inf", "-inf" and "nan" so the file stays strict JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

JSON_KEYS_ORDER = ("passed", "backend", "samples", "metrics", "thresholds", "failures",
                   "per_layer")
METRIC_ORDER = ("cosine_mean", "cosine_min", "cosine_token_min", "rel_l2", "max_abs",
                "prob_max_abs", "top1_agreement", "top5_overlap", "kl_mean", "kl_p99", "kl_max",
                "ppl_reference", "ppl_candidate", "ppl_ratio", "accuracy_reference",
                "accuracy_candidate", "accuracy_drop", "tokens", "ppl_tokens")


def json_safe(obj: Any) -> Any:
    """Replace non-finite floats by strings, recursively (tuples become lists)."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def report_dict(result: dict[str, Any]) -> dict[str, Any]:
    """The content of report.json: the DESIGN.md keys first, then the rest (no raw plot data)."""
    out = {k: result.get(k) for k in JSON_KEYS_ORDER}
    for k, v in result.items():
        if k not in out and k != "distributions":
            out[k] = v
    return json_safe(out)


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


def markdown(result: dict[str, Any], max_layers: int = 10) -> str:
    """report.md: a verdict line, the threshold checks, all metrics, worst layers, notes."""
    verdict = "✅ PASSED" if result["passed"] else "❌ FAILED"
    lines = [f"# fp8export verify: {verdict}", ""]
    ref, cand = result["reference"], result["candidate"]
    lines += [f"- **Reference**: `{ref['path']}` ({ref['backend']}, {ref.get('dtype', '')})",
              f"- **Candidate**: `{cand['path']}` ({result['backend']}"
              + (f", {cand['mode']}" if cand.get("mode") else "") + ")",
              f"- **Data**: {result['data']['source']} — {result['samples']} samples, "
              f"{result['metrics'].get('tokens')} tokens",
              f"- **Thresholds**: {result['thresholds_source']}", ""]
    failed = [c for c in result["checks"] if c["status"] == "failed"]
    if failed:
        lines.append("**Failing metrics:** " + ", ".join(f"`{c['metric']}`" for c in failed))
        lines.append("")
    lines += ["| check | value | threshold | result |", "|---|---|---|---|"]
    icon = {"passed": "✅ pass", "failed": "❌ FAIL", "skipped": "➖ n/a"}
    for c in result["checks"]:
        sym = "≥" if c["op"] == "min" else "≤"
        lines.append(f"| `{c['metric']}` | {_fmt(c['value'])} | {sym} {c['threshold']:g} | "
                     f"{icon[c['status']]} |")
    lines += ["", "<details><summary>All metrics</summary>", "",
              "| metric | value |", "|---|---|"]
    m = result["metrics"]
    for k in METRIC_ORDER:
        if k in m:
            lines.append(f"| `{k}` | {_fmt(m[k])} |")
    lines += ["", "</details>", ""]
    layers = result.get("per_layer")
    if layers:
        lines += [f"## Per-layer error (worst {min(max_layers, len(layers))} of {len(layers)}, "
                  "isolated SQNR: each FP8 layer fed the reference's own input)", "",
                  "| rank | module | SQNR dB | end-to-end SQNR dB | saturated |",
                  "|---|---|---|---|---|"]
        for r in layers[:max_layers]:
            lines.append(f"| {r['rank']} | `{r['module']}` | {_fmt(r['sqnr_db'])} | "
                         f"{_fmt(r['sqnr_e2e_db'])} | {r['saturated']:.2%} |")
        lines.append("")
    for note in result.get("notes", []):
        lines.append(f"> {note}")
    return "\n".join(lines).rstrip() + "\n"


def write_reports(result: dict[str, Any], report_dir: Path) -> dict[str, str]:
    """Write report.json, report.md, report.html and junit.xml; return their paths."""
    from fp8export.verify.junit import junit_xml
    from fp8export.verify.report_html import html_report

    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: report_dir / name for name in
             ("report.json", "report.md", "report.html", "junit.xml")}
    result = dict(result)
    result["reports"] = {k: str(v) for k, v in paths.items()}
    paths["report.json"].write_text(json.dumps(report_dict(result), indent=2,
                                               allow_nan=False) + "\n")
    paths["report.md"].write_text(markdown(result), encoding="utf-8")
    paths["report.html"].write_text(html_report(result), encoding="utf-8")
    paths["junit.xml"].write_bytes(junit_xml(result))
    return {k: str(v) for k, v in paths.items()}
