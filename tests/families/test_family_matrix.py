"""Every family people quantize, as transformers saves it, through the whole pipeline.

For each tiny model (``model_families.py``: bf16, saved by ``save_pretrained``): ``convert
--scales calibrate``, ``export-onnx``, ``verify`` of the folder (torch FP8 runtime) and of the
ONNX graph (onnxruntime), against the bf16 checkpoint. One test per family runs the four steps
in order, so a failure names the family and the step.

Thresholds: the ``loose`` preset with KL ten times tighter than ``default`` (2e-3; these
models measure 1.1e-5..1.4e-4, ``bench/families.py``) and top-1 agreement at 0.75: random
weights give near-uniform next-token probabilities (the top token's mean probability is
~1/vocab), so top-1 flips on ties that any rounding decides (0.79..1.0 measured; Gemma 3
lowest), while KL still sees a wrong scale (``test_wrong_expert_scale_fails``).
"""

from __future__ import annotations

import json

import pytest
from model_families import FAMILIES, MOE_FAMILIES

DATA = "samples/tiny-llama/data"
THRESHOLDS = {"preset": "loose", "kl_mean": 0.002, "top1_agreement": 0.75}


def _run_pipeline(src, out, repo):
    from fp8export.api import convert, export_onnx, verify
    from fp8export.convert.config import ConvertConfig
    from fp8export.onnx.export import ExportOnnxConfig
    from fp8export.verify.config import VerifyConfig

    fp8 = out / "fp8"
    convert(ConvertConfig(checkpoint=src, output=fp8, scales="calibrate",
                          calib_data=repo / DATA / "calib.txt", calib_samples=32, seq_len=64))
    onnx_path = out / "model.onnx"
    exported = export_onnx(ExportOnnxConfig(fp8_dir=fp8, output=onnx_path, dtype="fp32"))
    thresholds = out / "thresholds.json"
    thresholds.write_text(json.dumps(THRESHOLDS))
    results = {}
    for name, cand in (("folder", fp8), ("onnx", onnx_path)):
        results[name] = verify(VerifyConfig(
            reference=src, candidate=cand, data=repo / DATA / "eval.txt", samples=8,
            seq_len=64, report_dir=out / f"report-{name}", noise_floor=False, device="cpu",
            thresholds=str(thresholds)))
    return fp8, exported, results


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_pipeline(family, family_dir, tmp_path):
    from tests.conftest import REPO

    src = family_dir(family)
    fp8, exported, results = _run_pipeline(src, tmp_path, REPO)
    manifest = json.loads((fp8 / "fp8export.json").read_text())
    quantized = manifest["quantized"]
    assert quantized, family
    # every linear of the body is FP8 with a calibrated static input scale
    assert manifest["activation_scheme"] == "static"
    assert all(e["input_scale_source"] == "calibration" for e in quantized.values())
    # the ONNX graph quantizes every layer the folder quantizes, each as an FP8 GEMM
    assert len(exported.fp8_gemms) == len(quantized), exported.sixteen_bit
    for name, res in results.items():
        assert res.passed, (family, name, res.failures)
    if family in MOE_FAMILIES:
        moe = results["folder"].candidate["moe"]
        assert moe["expert_weight_dtypes"] == ["float8_e4m3fn"]
        assert moe["expert_gemms"].get("float8_e4m3fn", 0) > 0
        assert set(moe["expert_gemms"]) == {"float8_e4m3fn"}  # no expert ran in bf16


def test_wrong_expert_scale_fails(family_dir, tmp_path):
    """The matrix's thresholds catch one MoE expert projection with a weight scale 8x off."""
    import shutil

    from fp8_folders import damage_scale

    from fp8export.api import convert, verify
    from fp8export.convert.config import ConvertConfig
    from fp8export.errors import VerificationFailed
    from fp8export.verify.config import VerifyConfig
    from tests.conftest import REPO

    src = family_dir("mixtral")
    fp8 = tmp_path / "fp8"
    convert(ConvertConfig(checkpoint=src, output=fp8, scales="calibrate",
                          calib_data=REPO / DATA / "calib.txt", calib_samples=32, seq_len=64))
    bad = tmp_path / "bad"
    shutil.copytree(fp8, bad)
    for i in range(4):  # the down projection of every expert of the first layer
        damage_scale(bad, f"model.layers.0.block_sparse_moe.experts.{i}.w2", 8.0)
    thresholds = tmp_path / "thresholds.json"
    thresholds.write_text(json.dumps(THRESHOLDS))
    with pytest.raises(VerificationFailed):
        verify(VerifyConfig(reference=src, candidate=bad, data=REPO / DATA / "eval.txt",
                            samples=8, seq_len=64, report_dir=tmp_path / "r", noise_floor=False,
                            device="cpu", thresholds=str(thresholds)))
