"""Threshold presets, files and evaluation."""

import json
import math

import pytest

from fp8export.errors import Fp8ExportError
from fp8export.verify.thresholds import DIRECTIONS, PRESETS, evaluate, load_thresholds


def test_presets_are_ordered_strict_to_loose():
    s, d, lo = PRESETS["strict"], PRESETS["default"], PRESETS["loose"]
    assert set(s) == set(d) == set(lo)
    for k in d:
        if DIRECTIONS[k] == "min":
            assert s[k] >= d[k] >= lo[k], k
        else:
            assert s[k] <= d[k] <= lo[k], k


def test_yaml_and_json_files(tmp_path):
    y = tmp_path / "t.yaml"
    y.write_text("preset: default\nkl_mean: 0.01\nkl_p99: null\ntop1_agreement: {min: 0.5}\n")
    label, t = load_thresholds(str(y))
    assert t["kl_mean"] == {"op": "max", "value": 0.01}
    assert "kl_p99" not in t and t["top1_agreement"]["value"] == 0.5
    assert t["cosine_min"]["value"] == PRESETS["default"]["cosine_min"]
    j = tmp_path / "t.json"
    j.write_text(json.dumps({"cosine_min": 0.9}))
    assert load_thresholds(str(j))[1] == {"cosine_min": {"op": "min", "value": 0.9}}


def test_unknown_metric_lists_valid_names(tmp_path):
    y = tmp_path / "t.yaml"
    y.write_text("kl_avg: 0.1\n")
    with pytest.raises(Fp8ExportError, match="unknown metric 'kl_avg'.*kl_mean"):
        load_thresholds(str(y))


def test_wrong_direction_and_bad_preset(tmp_path):
    with pytest.raises(Fp8ExportError, match="'max' bound"):
        load_thresholds({"kl_mean": {"min": 0.1}})
    with pytest.raises(Fp8ExportError, match="neither a preset"):
        load_thresholds("medium")


def test_evaluate_pass_fail_skip_nan():
    _, t = load_thresholds({"kl_mean": 0.02, "top1_agreement": 0.9, "ppl_ratio": 1.05})
    checks = {c["metric"]: c for c in evaluate({"kl_mean": 0.03, "top1_agreement": 0.95}, t)}
    assert checks["kl_mean"]["status"] == "failed"
    assert checks["top1_agreement"]["status"] == "passed"
    assert checks["ppl_ratio"]["status"] == "skipped"
    nan = evaluate({"kl_mean": math.nan}, load_thresholds({"kl_mean": 1.0})[1])
    assert nan[0]["status"] == "failed"
