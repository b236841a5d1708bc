"""The convert recipes beyond per-tensor static scales, on a MoE decoder (tiny Mixtral)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO

DATA = REPO / "samples" / "tiny-llama" / "data"
RECIPES = {
    "kv-cache": dict(scales="calibrate", calib_data=DATA / "calib.txt", kv_cache="fp8"),
    "channel-token": dict(scales="weights", weight_granularity="channel",
                          dynamic_activations="token"),
    "accuracy-budget": dict(scales="calibrate", calib_data=DATA / "calib.txt",
                            accuracy_budget=1e-7, accuracy_samples=8),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_moe_recipe(recipe, family_dir, tmp_path):
    from fp8export.api import convert, verify
    from fp8export.convert.config import ConvertConfig
    from fp8export.verify.config import VerifyConfig

    src = family_dir("mixtral")
    out = tmp_path / "fp8"
    convert(ConvertConfig(checkpoint=src, output=out, calib_samples=32, seq_len=64,
                          **RECIPES[recipe]))
    manifest = json.loads((out / "fp8export.json").read_text())
    res = verify(VerifyConfig(reference=src, candidate=out, data=DATA / "eval.txt", samples=8,
                              seq_len=64, report_dir=tmp_path / "r", noise_floor=False,
                              device="cpu", thresholds="loose"))
    assert res.passed, res.failures
    moe = res.candidate["moe"]
    if recipe == "kv-cache":
        assert len(manifest["kv_cache"]["layers"]) == 2 and res.candidate["kv_cache"]
    if recipe == "channel-token":
        assert manifest["weight_granularity"] == "channel"
    if recipe == "accuracy-budget":  # the budget keeps some expert projections in bf16
        kept = manifest["accuracy_budget"]["keep"]
        assert kept and manifest["accuracy_budget"]["written"]["kl"] <= 1e-7
        if any(".experts." in k for k in kept):
            assert "bfloat16" in moe["expert_gemms"]
    assert moe["expert_gemms"].get("float8_e4m3fn", 0) > 0
