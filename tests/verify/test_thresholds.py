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


def test_a_file_that_sets_no_bound_is_refused(tmp_path):
    y = tmp_path / "t.yaml"
    y.write_text("kl_mean: null\n")
    with pytest.raises(Fp8ExportError, match="t.yaml: the thresholds file sets no bound"):
        load_thresholds(str(y))


def test_nothing_applicable_or_a_nan_metric_fails():
    _, t = load_thresholds({"accuracy_drop": 0.01})  # a classifier's metric, for a causal LM
    checks = evaluate({"kl_mean": 0.001, "top1_agreement": 1.0}, t)
    assert [c["status"] for c in checks] == ["skipped", "failed"]
    assert "no threshold applies" in checks[-1]["message"]
    _, t = load_thresholds({"kl_mean": 0.02})
    checks = evaluate({"kl_mean": 0.001, "cosine_min": math.nan}, t)  # NaN, not thresholded
    failed = [c["metric"] for c in checks if c["status"] == "failed"]
    assert failed == ["cosine_min"]


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    laughs = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, 9):
        prev = chr(ord("a") + i - 1)
        laughs.append(f"{chr(ord('a') + i)}: &{chr(ord('a') + i)} [" + ", ".join(
            [f"*{prev}"] * 9) + "]")
    y = tmp_path / "laughs.yaml"
    y.write_text("\n".join(laughs) + "\nkl_mean: *i\n")
    with pytest.raises(Fp8ExportError, match="laughs.yaml: line 2: YAML alias"):
        load_thresholds(str(y))


@pytest.mark.parametrize("text", ["kl_mean: !!python/object/apply:os.system [true]\n",
                                  "kl_mean: " + "9" * 5000 + "\n", "[" * 5000 + "]" * 5000])
def test_yaml_that_cannot_be_thresholds_is_one_error(tmp_path, text):
    y = tmp_path / "t.yaml"
    y.write_text(text)
    with pytest.raises(Fp8ExportError, match="t.yaml"):
        load_thresholds(str(y))
