"""The built-in FP8 fake-quant comparison of calibrators (the evidence path) on a tiny Llama."""

from __future__ import annotations

import pytest
from fp8export.calibration.evaluate import compare_calibrators, to_markdown


def test_compare_calibrators_runs_and_is_consistent(tiny_llama, calib_txt):
    res = compare_calibrators(tiny_llama, calib_txt, calib_txt, batch_size=8)
    rows = res["results"]
    assert list(rows) == ["reference", "weights-only", "max", "percentile", "mse", "entropy"]
    assert rows["reference"]["kl_mean"] == 0.0 and rows["reference"]["top1_agreement"] == 1.0
    for name in ("weights-only", "max", "percentile", "mse", "entropy"):
        assert rows[name]["kl_mean"] > 0.0  # FP8 really perturbs the logits
        assert rows[name]["ppl"] == pytest.approx(rows["reference"]["ppl"], rel=0.05)
    for m in ("max", "percentile", "mse", "entropy"):
        assert 0.0 < rows[m]["amax_over_max_min"] <= rows[m]["amax_over_max_mean"] <= 1.0
    assert rows["max"]["amax_over_max_mean"] == 1.0
    # Per-module amaxes: every calibrator's is <= max's; fused members are equal.
    for m in ("percentile", "mse", "entropy"):
        assert all(a <= res["amax"]["max"][k] for k, a in res["amax"][m].items())
    a = res["amax"]["entropy"]
    assert a["model.layers.0.self_attn.q_proj"] == a["model.layers.0.self_attn.v_proj"]
    md = to_markdown(res)
    assert "`entropy`" in md and "perplexity" in md
