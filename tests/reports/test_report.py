"""Reports from a hand-made result: strict JSON with non-finite values, junit, markdown, html;
the header; worst samples shown as inert text whatever the data holds."""

import hashlib
import json
import math
import re
import xml.etree.ElementTree as ET

import pytest

from fp8export.reports.html import html_report
from fp8export.reports.report import header_rows, markdown, metric_rows, report_dict, write_reports
from fp8export.verify.thresholds import evaluate, load_thresholds
from fp8export.verify.worst_samples import display_text, worst_samples

EVIL = "</td></tr><script>alert(1)</script> ![pixel](http://evil.example/p.png) `x` | \u202edlrow"


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


def _with_header(result):
    result = dict(result)
    result["header"] = {
        "tool": {"name": "fp8export", "version": "9.9.9"},
        "command": "fp8export verify ref cand --data 'my data.txt'",
        "created": "2026-01-02T03:04:05+00:00",
        "reference": {"path": "ref", "dtype": "bf16", "backend": "torch", "device": "cpu",
                      "sha256": "a" * 64, "files": [{}, {}], "bytes": 2_000_000, "skipped": []},
        "candidate": {"path": "cand", "kind": "fp8-folder", "mode": "emulate",
                      "converted_from_reference": False, "source_mismatch": ["model.safetensors"],
                      "sha256": "b" * 64, "files": [{}], "bytes": 10, "skipped": [".cache/"]},
        "data": {"source": "x.txt", "samples": 1, "tokens": 3, "sha256": "c" * 64},
        "backend": "torch-fp8", "device": "cuda:0", "device_name": "NVIDIA H100",
        "dtype": {"reference": "bf16", "candidate": "bf16"},
        "environment": {"python": "3.11.7", "torch": "2.13.0", "platform": "Linux"},
    }
    result["worst_samples"] = [{
        "index": 0, "tokens": 3, "kl_mean": 0.5, "kl_max": 1.5, "position": 2,
        "context": EVIL, "token": "<b>tok</b>", "next_token": "&amp;",
        "reference_top1": " the", "reference_top1_p": 0.5, "candidate_top1": EVIL,
        "candidate_top1_p": 0.25}]
    return result


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
    # per-layer only (no scatter/KL data); the -inf bar is not drawn but the e2e point is
    assert html.count("<svg") == 1 and "data:image" not in html


def test_markdown_names_failures_and_worst_layer():
    md = markdown(_result())
    assert md.startswith("# fp8export verify: ❌ FAILED")
    assert "**Failing metrics:** `kl_mean`, `cosine_min`" in md
    assert "| `ppl_ratio` | – | – | ≤ 1.05 | ➖ n/a |" in md
    assert "`a.b`" in md and "> a note" in md


def test_confidence_intervals_and_warnings_in_every_format(tmp_path):
    res = _result()
    for c in res["checks"]:
        if c["metric"] == "top1_agreement":
            c.update(interval=[0.85, 0.97], decided=False)
    warning = "top1_agreement = 1: its 95% interval [0.85, 0.97] holds the threshold"
    res["confidence"] = {"level": 0.95, "resamples": 1000, "samples": 12, "tokens": 1200,
                         "verdict": "uncertain", "warnings": [warning]}
    md = markdown(res)
    assert "| 95% interval |" in md
    assert "| `top1_agreement` | 1.0000 | [0.8500, 0.9700] ⚠ | ≥ 0.9 | ✅ pass |" in md
    assert "**Verdict uncertain: 95% intervals from 1000 bootstrap resamples of the 12 samples" \
        in md
    assert "- ⚠ top1\\_agreement = 1: its 95% interval \\[0.85, 0.97\\] holds" in md
    html = html_report(res)
    assert "<th>95% interval</th>" in html and "[0.8500, 0.9700] ⚠" in html
    assert "Verdict uncertain" in html and "holds the threshold" in html
    write_reports(res, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["confidence"]["verdict"] == \
        "uncertain"


def test_header_in_every_format(tmp_path):
    res = _with_header(_result())
    rows = {label: (text, code) for label, text, code in header_rows(res)}
    assert rows["Tool"][0] == "fp8export 9.9.9"
    assert rows["Command"][1] == "fp8export verify ref cand --data 'my data.txt'"
    assert rows["Date"][0] == "2026-01-02 03:04:05 UTC"
    assert "sha256 aaaaaaaaaaaa (2 files, 2.0 MB)" in rows["Reference"][0]
    assert "NOT converted from this reference" in rows["Candidate"][0]
    assert "not read: .cache/" in rows["Candidate"][0]
    assert rows["Data"] == ("1 samples, 3 tokens — sha256 cccccccccccc", "x.txt")
    assert rows["Backend"][0].startswith("torch-fp8 on cuda:0 (NVIDIA H100)")
    write_reports(res, tmp_path)
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["header"]["reference"]["sha256"] == "a" * 64
    md = (tmp_path / "report.md").read_text()
    assert "- **Command**: `fp8export verify ref cand --data 'my data.txt'`" in md
    html = (tmp_path / "report.html").read_text()
    text = re.sub(r"<[^>]+>", "", html)  # the command wraps between words only
    assert "fp8export verify ref cand --data &#x27;my data.txt&#x27;" in text
    assert "<span class='w'>--data</span>" in html
    # an old result without a header still renders the basics
    assert dict((label, code) for label, _, code in header_rows(_result()))["Reference"] == "ref"


def test_worst_sample_text_is_inert_in_html_and_markdown():
    res = _with_header(_result())
    html = html_report(res)
    assert "<script" not in html and "<b>tok" not in html
    assert "&lt;/td&gt;&lt;/tr&gt;&lt;script&gt;" in html and "<mark>&lt;b&gt;tok" in html
    assert "&amp;amp;" in html  # an entity in the data is shown, not interpreted
    md = markdown(res)
    assert "<script" not in md and "![pixel]" not in md and "<b>tok</b>" not in md
    assert "\u202e" not in md and "\u202e" not in html  # shown as the escape, never applied
    assert "→ <b>&lt;b&gt;tok&lt;/b&gt;</b>" in md
    assert r"&lt;script&gt;alert(1)&lt;/script&gt; \!\[pixel\]" in md
    row = next(line for line in md.splitlines() if line.startswith("| 0 |"))
    assert row.count(" | ") == 4  # the data's own "|" cannot add a column


def test_display_text_makes_controls_visible_and_bounds_length():
    s = display_text("a\nb\tc\u202ed\u200be\x07" + "x" * 500, 40)
    assert s.startswith("a⏎b⇥c\\u202ed\\u200be\\u0007") and len(s) == 41 and s.endswith("…")
    assert display_text("0123456789", 4, keep="end") == "…6789"


def test_worst_samples_decode_the_text_around_the_divergence(repo_root):
    tok_dir = repo_root / "samples" / "tiny-llama" / "model"
    if not (tok_dir / "tokenizer.json").is_file():
        pytest.skip("the sample tokenizer is not built")
    from fp8export.inputs.tokenizer import open_tokenizer

    text = "Once upon a time <script>alert(1)</script> the cat sat on the mat."
    with open_tokenizer(tok_dir) as tok:
        full, head = tok.encode([text, "Once upon a time <script>"], "a test")
    ids = tuple(full)
    pos = len(head) - 1
    per_sample = [{"index": 0, "tokens": len(ids), "kl_mean": 0.001, "kl_max": 0.01,
                   "kl_max_pos": 2, "reference_top1": ids[3], "candidate_top1": ids[3],
                   "reference_top1_p": 0.9, "candidate_top1_p": 0.8},
                  {"index": 1, "tokens": len(ids), "kl_mean": 0.5, "kl_max": 3.0,
                   "kl_max_pos": pos, "reference_top1": ids[pos + 1],
                   "candidate_top1": ids[pos + 2], "reference_top1_p": 0.7,
                   "candidate_top1_p": 0.4}]
    worst = worst_samples(per_sample, (ids, ids), tok_dir, "causal-lm", {}, n=1)
    assert len(worst) == 1 and worst[0]["index"] == 1 and worst[0]["position"] == pos
    w = worst[0]
    assert (w["context"] + w["token"]).endswith("Once upon a time <script>")
    assert w["next_token"] == w["reference_top1"] and w["candidate_top1"] != w["reference_top1"]
    # no tokenizer: token ids, never an error
    bare = worst_samples(per_sample, (ids, ids), repo_root / "tests", "causal-lm", {}, n=1)
    assert bare[0]["token"] == f"[{ids[pos]}]"
    # a classifier: the sample's start and class names
    cls = worst_samples([{**per_sample[1], "kl_max_pos": 0, "reference_top1": 1,
                          "candidate_top1": 0}], (ids, ids), tok_dir, "seq-cls",
                        {"id2label": {"0": "neg", "1": "pos"}})
    assert cls[0]["position"] is None and cls[0]["context"].startswith("<s>Once upon")
    assert (cls[0]["reference_top1"], cls[0]["candidate_top1"]) == ("pos (1)", "neg (0)")


def test_new_metrics_slot_in_under_other():
    rows = metric_rows({"kl_mean": 0.1, "noise_floor_db": 55.0, "tokens": 3})
    assert rows == [("Predictions", "kl_mean", 0.1), ("Counts", "tokens", 3),
                    ("Other", "noise_floor_db", 55.0)]


def test_content_hash_is_the_sha256sum_listing_of_what_is_read(tmp_path):
    from safetensors.torch import save_file

    from fp8export.verify.provenance import content_hash, converted_from, edited_files

    d = tmp_path / "m"
    d.mkdir()
    save_file({"w": __import__("torch").ones(4)}, str(d / "model.safetensors"))
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{}")
    (d / ".hidden").write_text("x")
    (d / "sub").mkdir()
    with open(d / "optimizer_state.bin", "wb") as f:  # a 200 GB sparse file: never read
        f.truncate(200 << 30)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    (d / "link.json").symlink_to(outside)
    h = content_hash(d)
    names = ("config.json", "model.safetensors", "tokenizer.json")
    listing = "".join(f"{hashlib.sha256((d / n).read_bytes()).hexdigest()}  {n}\n"
                      for n in names)
    assert h["sha256"] == hashlib.sha256(listing.encode()).hexdigest()
    assert [f["name"] for f in h["files"]] == list(names)
    assert sorted(h["skipped"]) == [".hidden", "link.json", "optimizer_state.bin", "sub/"]
    single = content_hash(d / "config.json")
    assert single["sha256"] == hashlib.sha256(b"{}").hexdigest() and single["skipped"] == []
    # the FP8 folder's manifest names its source files with their sha256, and its own files
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    (fp8 / "config.json").write_text("{}")
    own = [{"name": "config.json", "sha256": hashlib.sha256(b"{}").hexdigest(), "bytes": 2}]
    (fp8 / "fp8export.json").write_text(json.dumps({"source": {"files": h["files"]},
                                                    "files": own}))
    assert converted_from(fp8, h["files"]) == (True, [])
    assert edited_files(fp8, content_hash(fp8)["files"]) == []
    (fp8 / "config.json").write_text('{"edited": 1}')
    assert edited_files(fp8, content_hash(fp8)["files"]) == ["config.json"]
    (d / "config.json").write_text("{\"changed\": 1}")
    assert converted_from(fp8, content_hash(d)["files"]) == (False, ["config.json"])
    assert converted_from(d, h["files"]) == (None, [])
