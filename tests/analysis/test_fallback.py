"""convert --accuracy-budget: the search measures the model convert writes, keeps the fewest
layers (fused groups whole) and the written folder measures what the search measured."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fp8export import api
from fp8export.analysis.fallback import FallbackLayer, FallbackSearch
from fp8export.convert.config import ConvertConfig
from fp8export.numerics.fp8 import amax_to_scale, quantize_e4m3


def _convert(src, out, data, **kw):
    return api.convert(ConvertConfig(checkpoint=src, output=out, calib_data=data,
                                     scales="calibrate", calib_samples=8, accuracy_samples=8,
                                     **kw))


def test_budget_is_met_by_the_written_folder(tiny_llama, eval_npz, tmp_path):
    free = _convert(tiny_llama, tmp_path / "free", eval_npz, accuracy_budget=10.0)
    b = free.accuracy_budget
    assert b["keep"] == [] and b["kept_param_fraction"] == 0 and len(b["evaluations"]) == 1
    kl_all = b["kl_all_fp8"]
    assert 0 < kl_all < 0.05
    res = _convert(tiny_llama, tmp_path / "tight", eval_npz, accuracy_budget=kl_all / 3,
                   weight_granularity="channel")
    b = res.accuracy_budget
    assert b["keep"] and b["kl_selected"] <= kl_all / 3 < b["kl_all_fp8"]
    # the written folder is checked on samples the search did not see, and the gap is said
    assert b["written"]["data"] == "held-out" and b["written"]["samples"] == 4
    assert b["written"]["gap"] == pytest.approx(b["written"]["kl"] / b["kl_selected"] - 1)
    assert b["held_out_samples"] == 4 and b["samples"] == 8
    assert 0 < b["kept_param_fraction"] < 1 and b["seconds"]["total"] > 0
    man = json.loads((tmp_path / "tight" / "fp8export.json").read_text())
    assert man["accuracy_budget"]["keep"] == b["keep"]
    kept = {k.rsplit(".", 1)[0] for k, why in man["excluded"].items()
            if "accuracy-budget" in why}
    assert kept == set(b["keep"])
    groups: dict[str, set[str]] = {}
    for m, e in json.loads((tmp_path / "free" / "fp8export.json").read_text())[
            "quantized"].items():
        if e["fused_group"]:
            groups.setdefault(e["fused_group"], set()).add(m)
    for members in groups.values():  # a fused group is kept whole or not at all
        assert members <= kept or not members & kept


def test_convert_accuracy_budget_keeps_layers(tiny_llama, eval_npz, tmp_path):
    """Default convert options with a budget below the all-FP8 KL: layers are kept, and the
    budget is met by the search's measurement and by the folder written."""
    budget = 1e-5
    out = tmp_path / "budget"
    res = api.convert(ConvertConfig(checkpoint=tiny_llama, output=out, calib_data=eval_npz,
                                    accuracy_budget=budget))
    b = res.accuracy_budget
    assert b["kl_all_fp8"] > budget  # all-FP8 misses it: something must stay in bf16
    assert b["keep"] and b["kl_selected"] <= budget
    assert b["written"]["kl"] <= budget * (1 + 1e-3)
    excluded = json.loads((out / "fp8export.json").read_text())["excluded"]
    kept = {k.rsplit(".", 1)[0] for k, why in excluded.items() if "accuracy-budget" in why}
    assert kept == set(b["keep"])


def test_score_finds_the_layer_with_a_bad_scale(tiny_llama, eval_npz):
    """A layer whose input scale clips hard adds the most error: the score ranks it first."""
    from fp8export.models import load_model

    model, _ = load_model(tiny_llama, dtype=torch.float32)
    names = [n for n, m in model.named_modules() if n.endswith(("o_proj", "down_proj"))]
    bad = names[1]
    layers = []
    for n in names:
        w = model.get_submodule(n).weight.detach()
        ws = amax_to_scale(float(w.abs().max()))
        s_in = np.float32(1e-4) if n == bad else None  # clips every input to ±0.045
        layers.append(FallbackLayer(n, quantize_e4m3(w, ws), ws, s_in, None))
    search = FallbackSearch(tiny_llama, layers, data=eval_npz, samples=8, seq_len=32)
    scores = search.score()
    assert max(scores, key=scores.get) == bad
    assert scores[bad] > 10 * sorted(scores.values())[-2]
    result = search.search(budget=search.kl(set())["kl"] / 2)
    assert result["keep"][0] == bad


def test_the_written_folder_measures_what_the_search_measured(tiny_llama, eval_npz, tmp_path):
    """Same tokens, same bytes, same scales: the folder convert wrote (through the FP8 runtime)
    measures the search's own measurement of its selection."""
    res = _convert(tiny_llama, tmp_path / "o", eval_npz, accuracy_budget=1e-5)
    b = res.accuracy_budget
    assert b["keep"]
    search = _search_like_convert(tiny_llama, tmp_path / "o", eval_npz)
    kept = search.kl(set(b["keep"]))
    again = search.check_written(tmp_path / "o", held_out=False)
    assert again["data"] == "search"
    assert again["kl"] == pytest.approx(kept["kl"], rel=1e-4)
    assert again["kl"] == pytest.approx(b["kl_selected"], rel=1e-4)


def _search_like_convert(src, folder, data):
    """A search over the layers of ``folder`` as they were written (bytes and scales)."""
    from safetensors import safe_open

    man = json.loads((folder / "fp8export.json").read_text())
    budget = man["accuracy_budget"]
    everything = sorted(set(man["quantized"]) | set(budget["keep"]))
    full = folder.parent / "full"  # the same options without a budget: every layer in FP8
    api.convert(ConvertConfig(checkpoint=src, output=full, calib_data=data, scales="calibrate",
                              calib_samples=8))
    layers = []
    with safe_open(str(full / "model.safetensors"), framework="pt") as f:
        fman = json.loads((full / "fp8export.json").read_text())["quantized"]
        for m in everything:
            s_in = f.get_tensor(f"{m}.input_scale") if f"{m}.input_scale" in f.keys() else None
            layers.append(FallbackLayer(m, f.get_tensor(f"{m}.weight"),
                                        f.get_tensor(f"{m}.weight_scale").numpy(),
                                        None if s_in is None else s_in.numpy(),
                                        fman[m]["fused_group"]))
    return FallbackSearch(src, layers, data=data, samples=8, seq_len=None)
