"""verify with layer streaming (verify/streamed.py): the reference, the FP8 candidate and the
fp32 floor streamed give the whole-model run's metrics exactly."""

from __future__ import annotations

from fp8export.api import verify
from fp8export.verify.config import VerifyConfig


def test_streamed_verify_measures_what_the_whole_run_measures(tiny_llama, tiny_fp8, eval_npz):
    common = dict(reference=tiny_llama, candidate=tiny_fp8, data=eval_npz, device="cpu",
                  samples=8, seq_len=32, batch_size=3, write_reports=False)
    whole = verify(VerifyConfig(**common))
    streamed = verify(VerifyConfig(**common, offload="layers", max_memory="cpu=2MiB"))
    assert whole.metrics == streamed.metrics
    assert whole.noise_floor == streamed.noise_floor and whole.noise_floor is not None
    assert whole.per_sample == streamed.per_sample
    assert streamed.candidate["streaming"]["per_block"] >= 1
    assert "streaming" not in whole.candidate
    assert any(n.startswith("Layer streaming") for n in streamed.notes)


def test_verify_plan_runs_nothing(tiny_llama, tiny_fp8, eval_npz, tmp_path, run_cli):
    report = tmp_path / "report"
    result = run_cli("verify", tiny_llama, tiny_fp8, "--data", eval_npz, "--device", "cpu",
                     "--offload", "layers", "--plan", "--report-dir", report)
    assert result.exit_code == 0, result.output
    assert "mode: layer streaming" in result.output and "estimated time:" in result.output
    assert not report.exists()
