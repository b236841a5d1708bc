"""Reports from a hand-made result: strict JSON with non-finite values, junit, markdown, html."""

import json
import math
import xml.etree.ElementTree as ET

from fp8export.verify.report import markdown, report_dict, write_reports
from fp8export.verify.thresholds import evaluate, load_thresholds


def _result():
    metrics = {"cosine_mean": 0.5, "cosine_min": math.nan, "kl_mean": math.inf, "tokens": 3,
               "top1_agreement": 1.0}
    _, thr = load_thresholds({"kl_mean": 0.02, "cosine_min": 0.99, "top1_agreement": 0.9,
                              "ppl_ratio": 1.05})
    checks = evaluate(metrics, thr)
    return {
        "passed": False, "backend": "torch-fp8", "samples": 1, "metrics": metrics,
        "thresholds": thr, "checks": checks, "task": "causal-lm",
        "failures": [c for c in checks if c["status"] == "failed"],
        "per_layer": [{"module": "a.b", "order": 0, "rank": 1, "sqnr_db": -math.inf,
                       "sqnr_e2e_db": 3.0, "saturated": 0.5, "weight_sqnr_db": None}],
        "thresholds_source": "custom", "reference": {"path": "ref", "backend": "torch"},
        "candidate": {"path": "cand"}, "data": {"source": "x.txt"}, "notes": ["a note"],
        "per_sample": [{"index": 0, "tokens": 3, "kl_mean": math.inf, "cosine": math.nan,
                        "top1_agreement": 1.0}],
        "distributions": {"kl": [], "scatter_reference": [], "scatter_candidate": []},
        "timing": {"total_s": 1.0},
    }


def test_nonfinite_values_make_strict_json_and_fail(tmp_path):
    res = _result()
    statuses = {c["metric"]: c["status"] for c in res["checks"]}
    assert statuses == {"kl_mean": "failed", "cosine_min": "failed",
                        "top1_agreement": "passed", "ppl_ratio": "skipped"}
    d = report_dict(res)
    assert d["metrics"]["kl_mean"] == "inf" and d["metrics"]["cosine_min"] == "nan"
    assert "distributions" not in d
    paths = write_reports(res, tmp_path)
    json.loads((tmp_path / "report.json").read_text())  # strict JSON
    assert set(paths) == {"report.json", "report.md", "report.html", "junit.xml"}
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("4", "2", "1")
    html = (tmp_path / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "<script" not in html
    assert html.count("data:image/png;base64,") == 1  # per-layer only: no scatter/KL data


def test_markdown_names_failures_and_worst_layer():
    md = markdown(_result())
    assert md.startswith("# fp8export verify: ❌ FAILED")
    assert "**Failing metrics:** `kl_mean`, `cosine_min`" in md
    assert "| `ppl_ratio` | – | ≤ 1.05 | ➖ n/a |" in md
    assert "`a.b`" in md and "> a note" in md


def test_html_without_matplotlib_still_renders(monkeypatch):
    import fp8export._lazy as lazy
    from fp8export.errors import Fp8ExportError
    from fp8export.verify.report_html import html_report

    def missing(name, purpose=None):
        raise Fp8ExportError(f"Python package '{name}' is not installed (needed for {purpose})")

    monkeypatch.setattr(lazy, "lazy_import", missing)
    html = html_report(_result())
    assert "No plots: Python package &#x27;matplotlib&#x27; is not installed" in html
    assert "data:image/png" not in html
