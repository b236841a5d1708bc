"""The noise floor: the bf16 reference against an fp32 run of itself, and bounds relative to it."""

import json

import numpy as np
import pytest
import torch

from fp8export.errors import Fp8ExportError
from fp8export.verify.noise_floor import FloorBound, Relation, evaluate_floor, side_by_side
from fp8export.verify.thresholds import DIRECTIONS, load_thresholds


def test_floor_bounds_from_a_thresholds_file(tmp_path):
    y = tmp_path / "t.yaml"
    y.write_text("preset: default\nfloor:\n  kl_mean: {factor: 10}\n"
                 "  top1_agreement: {delta: 0.05}\n")
    _, t = load_thresholds(str(y))
    assert t["kl_mean"]["value"] == 0.02  # the absolute preset bounds stay
    assert t["floor"]["kl_mean"] == {"metric": "kl_mean", "op": "max", "relation": "factor",
                                     "amount": 10.0}
    assert t["floor"]["top1_agreement"]["relation"] == "delta"


@pytest.mark.parametrize("spec, match", [
    ({"top1_agreement": {"factor": 2}}, "similarity, give"),
    ({"kl_avg": {"factor": 2}}, "unknown metric 'kl_avg'"),
    ({"kl_mean": {"times": 2}}, "times"),
    ({"kl_mean": {"factor": -1}}, ">= 0"),
    ({"kl_mean": 3}, "must be"),
    ([1], "must map metric names"),
])
def test_bad_floor_bounds_are_one_clear_error(spec, match):
    with pytest.raises(Fp8ExportError, match=match):
        load_thresholds({"floor": spec})


def test_relative_bounds_pass_and_fail_against_the_floor():
    _, t = load_thresholds({"floor": {"kl_mean": {"factor": 10},
                                      "top1_agreement": {"delta": 0.05},
                                      "ppl_ratio": {"delta": 0.01}}})
    floor = {"kl_mean": 0.002, "top1_agreement": 0.97, "ppl_ratio": 1.001}
    checks = {c["metric"]: c for c in evaluate_floor(
        {"kl_mean": 0.03, "top1_agreement": 0.93, "ppl_ratio": 1.0105}, floor, t["floor"])}
    assert checks["kl_mean"]["status"] == "failed"  # 0.03 > 10 x 0.002
    assert checks["kl_mean"]["threshold"] == pytest.approx(0.02)
    assert checks["top1_agreement"]["status"] == "passed"  # 0.93 >= 0.97 - 0.05
    assert checks["ppl_ratio"]["status"] == "passed"  # 1.0105 <= 1.001 + 0.01
    skipped = evaluate_floor({"kl_mean": 0.001}, None, t["floor"])
    assert {c["status"] for c in skipped} == {"skipped"}
    assert FloorBound("kl_mean", "max", Relation.FACTOR, 10).describe() == "10x floor"


def test_side_by_side_loss_ratios():
    rows = {r["metric"]: r for r in side_by_side(
        {"kl_mean": 0.03, "top1_agreement": 0.88, "ppl_ratio": 1.02},
        {"kl_mean": 0.002, "top1_agreement": 0.97, "ppl_ratio": 1.004}, None)}
    assert rows["kl_mean"]["ratio"] == pytest.approx(15.0)
    assert rows["top1_agreement"]["ratio"] == pytest.approx(0.12 / 0.03)
    assert rows["ppl_ratio"]["ratio"] == pytest.approx(5.0)
    assert "neighbor_agreement" in DIRECTIONS


def _kl_mean(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    lp = torch.log_softmax(torch.as_tensor(p_logits, dtype=torch.float64), -1)
    lq = torch.log_softmax(torch.as_tensor(q_logits, dtype=torch.float64), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def test_verify_measures_the_floor_on_the_same_inputs(tiny_llama, tiny_fp8, eval_npz, tmp_path):
    from fp8export.api import verify
    from fp8export.runners.torch_runner import TorchRunner
    from fp8export.verify.config import VerifyConfig

    res = verify(VerifyConfig(reference=tiny_llama, candidate=tiny_fp8, data=eval_npz,
                              report_dir=tmp_path, device="cpu"))
    floor = res.noise_floor
    assert floor["reference_dtype"] == "bf16" and floor["against"] == "fp32"
    # The floor recomputed by hand: bf16 and fp32 runs of the reference on the same ids.
    ids = np.load(eval_npz)["input_ids"]
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    with TorchRunner(tiny_llama, dtype="fp32", device="cpu") as r32:
        fp32 = r32.infer(feed)["logits"]
    with TorchRunner(tiny_llama, dtype="bf16", device="cpu") as r16:
        bf16 = r16.infer(feed)["logits"]
    assert floor["metrics"]["kl_mean"] == pytest.approx(_kl_mean(fp32, bf16), rel=1e-4)
    assert 0 < floor["metrics"]["kl_mean"] < res.metrics["kl_mean"]  # FP8 adds to bf16 noise
    assert floor["candidate_vs_fp32"]["kl_mean"] > 0
    assert {r["metric"] for r in floor["rows"]} >= {"kl_mean", "top1_agreement", "ppl_ratio"}
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["noise_floor"]["metrics"]["kl_mean"] == floor["metrics"]["kl_mean"]
    md = (tmp_path / "report.md").read_text()
    assert "## Noise floor" in md and "reference vs fp32 (floor)" in md
    assert "id='noise-floor'" in (tmp_path / "report.html").read_text()
    assert 'name="noise_floor.kl_mean"' in (tmp_path / "junit.xml").read_text()


def test_relative_gate_and_when_the_floor_is_not_measured(tiny_llama, damaged_fp8, tiny_fp8,
                                                          eval_npz, tmp_path):
    from fp8export.api import verify
    from fp8export.errors import VerificationFailed
    from fp8export.verify.config import VerifyConfig

    relative = {"floor": {"kl_mean": {"factor": 50}, "top1_agreement": {"delta": 0.05}}}
    ok = verify(VerifyConfig(reference=tiny_llama, candidate=tiny_fp8, data=eval_npz,
                             thresholds=relative, write_reports=False, device="cpu"))
    assert [c["status"] for c in ok.checks] == ["passed", "passed"]
    with pytest.raises(VerificationFailed) as failed:  # one scale x8: far above the floor
        verify(VerifyConfig(reference=tiny_llama, candidate=damaged_fp8, data=eval_npz,
                            thresholds=relative, write_reports=False, device="cpu"))
    assert any(f["metric"] == "kl_mean" for f in failed.value.result.failures)
    off = verify(VerifyConfig(reference=tiny_llama, candidate=tiny_fp8, data=eval_npz,
                              noise_floor=False, write_reports=False, device="cpu"))
    assert off.noise_floor is None and "floor_s" in off.timing
    fp32 = verify(VerifyConfig(reference=tiny_llama, candidate=tiny_fp8, data=eval_npz,
                               reference_dtype="fp32", write_reports=False, device="cpu"))
    assert fp32.noise_floor is None
    for kwargs in ({"noise_floor": False}, {"reference_dtype": "fp32"}):
        with pytest.raises(Fp8ExportError, match="relative to the noise floor"):
            verify(VerifyConfig(reference=tiny_llama, candidate=tiny_fp8, data=eval_npz,
                                thresholds=relative, write_reports=False, **kwargs))


def test_cli_flag_and_summary(run_cli, tiny_llama, tiny_fp8, eval_npz, tmp_path):
    res = run_cli("verify", tiny_llama, tiny_fp8, "--data", eval_npz, "--device", "cpu",
                  "--report-dir", tmp_path / "on")
    assert res.exit_code == 0, res.output
    assert "judged by logits" in res.output and "noise floor (bf16 reference vs fp32)" in \
        res.output
    res = run_cli("verify", tiny_llama, tiny_fp8, "--data", eval_npz, "--device", "cpu",
                  "--no-noise-floor", "--report-dir", tmp_path / "off")
    assert res.exit_code == 0 and "noise floor" not in res.output
    assert json.loads((tmp_path / "off" / "report.json").read_text())["noise_floor"] is None
