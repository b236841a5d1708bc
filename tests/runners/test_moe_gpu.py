"""The MoE FP8 runtime on a GPU: expert projections through torch._scaled_mm (gpu-marked)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "families"))

from model_families import save_family  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    int(__import__("transformers").__version__.split(".")[0]) < 5,
    reason="transformers < 5 has no fused experts modules (its experts are nn.Linear already)")]
DATA = Path(__file__).resolve().parents[2] / "samples" / "tiny-llama" / "data"


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe"])
def test_expert_gemms_scaled_mm_match_emulation(family, tmp_path):
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig
    from fp8export.moe import expert_summary
    from fp8export.runtime.fp8_model import load_fp8_model

    src = save_family(family, tmp_path / "src")
    out = tmp_path / "fp8"
    convert(ConvertConfig(checkpoint=src, output=out, scales="calibrate",
                          calib_data=DATA / "calib.txt", calib_samples=32, seq_len=64,
                          device="cpu"))
    ids = torch.randint(3, 1900, (4, 48), generator=torch.Generator().manual_seed(0))
    gpu, _, _, info = load_fp8_model(out, device="cuda", mode="scaled_mm")
    assert info["mode"] == "scaled_mm" and not info["fallbacks"]
    emu, *_ = load_fp8_model(out, device="cuda", mode="emulate")
    with torch.no_grad():
        a = gpu(ids.cuda()).logits.float()
        b = emu(ids.cuda()).logits.float()
    rel = ((a - b).norm() / b.norm()).item()
    assert rel < 2e-2, rel
    moe = expert_summary(gpu)
    assert moe["expert_weight_dtypes"] == ["float8_e4m3fn"]
    assert set(moe["expert_gemms"]) == {"float8_e4m3fn"} and moe["expert_gemms"]["float8_e4m3fn"]


def test_verify_reports_expert_gemms_on_gpu(tmp_path):
    from fp8export.api import convert, verify
    from fp8export.convert.config import ConvertConfig
    from fp8export.verify.config import VerifyConfig

    src = save_family("mixtral", tmp_path / "src")
    out = tmp_path / "fp8"
    convert(ConvertConfig(checkpoint=src, output=out, scales="calibrate",
                          calib_data=DATA / "calib.txt", calib_samples=32, seq_len=64))
    res = verify(VerifyConfig(reference=src, candidate=out, data=DATA / "eval.txt", samples=8,
                              seq_len=64, report_dir=tmp_path / "r", device="cuda",
                              fp8_mode="scaled_mm", thresholds="loose"))
    assert res.candidate["mode"] == "scaled_mm"
    assert res.candidate["moe"]["expert_gemms"]["float8_e4m3fn"] > 0
    assert any("torch._scaled_mm" in n and n.startswith("MoE:") for n in res.notes)
