"""verify with the reference and the FP8 candidate spread over devices (fp8export.placement):
the same metrics as on one device. CPU here (layers offloaded to disk and streamed back);
tests/calibration/test_gpu.py runs the 2-GPU split."""

from __future__ import annotations

import importlib.util
import math

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                reason="optional dependency accelerate not installed")


def test_spread_verify_matches_one_device(tiny_llama, tiny_fp8, eval_npz, tmp_path):
    from fp8export.api import verify
    from fp8export.verify.config import VerifyConfig

    common = dict(reference=tiny_llama, candidate=tiny_fp8, data=eval_npz, device="cpu",
                  samples=8, seq_len=32, per_layer=True, write_reports=False)
    one = verify(VerifyConfig(**common))
    # the tiny Llama is 209 KiB of bf16 weights, its FP8 folder 137 KiB: 200 KiB of host memory
    # for both models puts about half of each on 'disk'
    spread = verify(VerifyConfig(**common, max_memory="cpu=200KiB", offload="none"))
    assert spread.reference["device"] == "cpu,disk" and spread.candidate["device"] == "cpu,disk"
    assert spread.reference["placement"]["devices"]["disk"]["modules"] > 0
    assert spread.candidate["placement"]["devices"]["disk"]["modules"] > 0
    assert one.passed and spread.passed
    for key, value in one.metrics.items():
        got = spread.metrics[key]
        if isinstance(value, float) and math.isfinite(value):
            assert got == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert [r["module"] for r in spread.per_layer] == [r["module"] for r in one.per_layer]
    for a, b in zip(one.per_layer, spread.per_layer, strict=True):
        assert b["sqnr_db"] == pytest.approx(a["sqnr_db"], rel=1e-6)


def test_spread_verify_has_no_room_for_the_noise_floor(tiny_llama, tiny_fp8, eval_npz):
    from fp8export.api import verify
    from fp8export.errors import Fp8ExportError
    from fp8export.verify.config import VerifyConfig

    common = dict(reference=tiny_llama, candidate=tiny_fp8, data=eval_npz, device="cpu",
                  samples=4, seq_len=16, write_reports=False, max_memory="cpu=200KiB",
                  offload="none")
    spread = verify(VerifyConfig(**common))
    assert spread.noise_floor is None
    assert any(n.startswith("No noise floor: --max-memory") for n in spread.notes)
    with pytest.raises(Fp8ExportError, match="--max-memory spreads the model"):
        verify(VerifyConfig(**common, thresholds={"floor": {"kl_mean": {"factor": 10}}}))
