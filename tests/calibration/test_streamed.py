"""calibrate with layer streaming (calibration/streamed.py): the same amax.json, byte for byte,
as the whole-model pass, for every calibrator, with one layer per block and the hidden states
in a spill file; MoE experts calibrated all, their routed tokens counted alike."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fp8export.calibration.api import calibrate
from fp8export.calibration.config import CalibrateConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "families"))


@pytest.mark.parametrize("method", ["max", "percentile", "mse", "entropy"])
def test_streamed_amax_file_is_the_whole_models(tiny_llama, calib_txt, tmp_path, method):
    common = dict(checkpoint=tiny_llama, calib_data=calib_txt, calib_method=method,
                  batch_size=5, device="cpu")
    whole = calibrate(CalibrateConfig(**common, output=tmp_path / "whole.json"))
    # a budget that holds one layer beside a batch's activations, not the hidden states
    streamed = calibrate(CalibrateConfig(**common, output=tmp_path / "layers.json",
                                         offload="layers", max_memory="cpu=130KB"))
    assert whole.streaming is None
    assert streamed.streaming["tier"] == "spill"
    assert (tmp_path / "whole.json").read_bytes() == (tmp_path / "layers.json").read_bytes()
    assert len(whole.amax) == 14
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "layers.json", "whole.json"]


def test_streamed_moe_calibration_is_the_whole_models(tmp_path):
    from model_families import save_family

    src = save_family("qwen3-moe", tmp_path / "src")
    data = Path(__file__).resolve().parents[2] / "samples" / "tiny-llama" / "data" / "calib.txt"
    common = dict(checkpoint=src, calib_data=data, calib_method="percentile", batch_size=4,
                  calib_samples=12, device="cpu")
    whole = calibrate(CalibrateConfig(**common, output=tmp_path / "whole.json"))
    calibrate(CalibrateConfig(**common, output=tmp_path / "layers.json", offload="layers"))
    assert whole.expert_tokens and len(whole.amax) == 32
    assert (tmp_path / "whole.json").read_bytes() == (tmp_path / "layers.json").read_bytes()


def test_plan_prints_the_plan_and_calibrates_nothing(tiny_llama, calib_txt, tmp_path,
                                                     run_cli):
    out = tmp_path / "amax.json"
    result = run_cli("calibrate", tiny_llama, "--calib-data", calib_txt, "-o", out,
                     "--device", "cpu", "--offload", "layers", "--plan")
    assert result.exit_code == 0, result.output
    for line in ("mode: layer streaming (--offload layers), 2 layers", "hidden states:",
                 "reads ", "estimated time:", "plan only (--plan)"):
        assert line in result.output
    assert not out.exists()
