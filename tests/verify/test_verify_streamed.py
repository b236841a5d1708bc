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


def test_the_plan_counts_both_layers_the_layer_check_holds(tiny_llama, tiny_fp8, eval_npz):
    """The layer check builds the candidate's layer before the reference's runs: the plan
    (what a --max-memory cap is checked against) counts the two together (measured on an
    H200: the plan without it was exceeded by the candidate's layer)."""
    import torch

    from fp8export.streaming.parts import CheckpointParts, Fp8FolderParts

    streamed = verify(VerifyConfig(reference=tiny_llama, candidate=tiny_fp8, data=eval_npz,
                                   device="cpu", samples=4, seq_len=16, write_reports=False,
                                   offload="layers", noise_floor=False))
    assert "layer_sqnr_min" in streamed.metrics  # the layer check ran
    with CheckpointParts(tiny_llama) as ref, \
            Fp8FolderParts(tiny_fp8, torch.bfloat16, "emulate") as cand:
        both = max(ref.layer_bytes(i) + cand.layer_bytes(i) for i in range(ref.count))
    assert streamed.candidate["streaming"]["layer_bytes"] == both
