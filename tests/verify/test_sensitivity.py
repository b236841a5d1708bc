"""Sensitivity ranking and the --accuracy-budget selection (emulated FP8, fp32 reference)."""

import json

import pytest

from fp8export.errors import Fp8ExportError
from fp8export.verify.sensitivity import sensitivity


def _modules(fp8_dir):
    return list(json.loads((fp8_dir / "fp8export.json").read_text())["quantized"])


def test_ranking_and_greedy_budget(tiny_llama, tiny_fp8, eval_npz):
    mods = _modules(tiny_fp8)
    free = sensitivity(tiny_llama, mods, budget_kl=10.0, data=eval_npz, samples=8)
    assert free["keep"] == [] and free["kl_after"] == free["kl_all"]
    kls = [r["kl"] for r in free["ranking"]]
    assert len(kls) == len(mods) and kls == sorted(kls, reverse=True) and min(kls) >= 0
    assert 0 < free["kl_all"] < 0.05
    budget = free["kl_all"] / 3
    tight = sensitivity(tiny_llama, mods, budget_kl=budget, data=eval_npz, samples=8)
    assert tight["keep"] and tight["kl_after"] <= budget < tight["kl_all"]
    assert tight["keep"][0] == tight["ranking"][0]["module"]  # most sensitive goes first
    assert [s["kept"] for s in tight["steps"]] == tight["keep"]


def test_convert_accuracy_budget_keeps_layers(tiny_llama, eval_npz, tmp_path):
    from fp8export import api
    from fp8export.config import ConvertConfig

    out = tmp_path / "budget"
    api.convert(ConvertConfig(checkpoint=tiny_llama, output=out, calib_data=eval_npz,
                              accuracy_budget=1e-5))
    excluded = json.loads((out / "fp8export.json").read_text())["excluded"]
    kept = [k for k, why in excluded.items() if "accuracy-budget" in why]
    assert kept, excluded


def test_bad_budget(tiny_llama, tiny_fp8):
    with pytest.raises(Fp8ExportError, match="KL > 0"):
        sensitivity(tiny_llama, _modules(tiny_fp8), budget_kl=0.0)
