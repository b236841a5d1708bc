"""llm-compressor 0.14's folders that engines misread or cannot load, through fp8export: each is
refused by name or labelled with the engines that really load it.

* ``model_free_ptq(..., scheme="FP8_DYNAMIC", ignore=["lm_head"])`` stores ``embed_tokens`` in
  FP8 under a config whose group targets ``Linear``: vLLM and transformers use the codes
  unscaled, so verify and export-onnx refuse it naming the embedding (and inspect says no engine
  loads it); with the embedding ignored as the error says, the folder verifies;
* ``oneshot`` static FP8 on Mixtral writes its experts as ``gate_proj/up_proj/down_proj``,
  names neither vLLM's nor transformers' Mixtral loader reads (they read ``w1/w3/w2``): refused
  by name;
* ``oneshot`` FP8_BLOCK on the sample (MLP 688 = 5.4 blocks of 128): partial edge blocks and
  ragged gate/up rows, which transformers and vLLM refuse: inspect promises neither.

Runs llm-compressor in its own venv as a subprocess; skips without it (see
test_llmcompressor_peer_block.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from peer_venv import PEER_PY, needs_peer  # noqa: F401  (a fixture, autouse)

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "tiny-llama"
HERE = Path(__file__).parent


def _peer(script: str, *args) -> None:
    run = subprocess.run([str(PEER_PY), str(HERE.parent / script), *map(str, args)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def _verify(run_cli, candidate: Path, report: Path, reference: Path = SAMPLE / "model"):
    return run_cli("verify", reference, candidate, "--data", SAMPLE / "data" / "eval.txt",
                   "--samples", "4", "--report-dir", report)


def test_model_free_fp8_embedding_is_refused_by_name(tmp_path, run_cli):
    out = tmp_path / "mfp"
    _peer("peers/llmcompressor_model_free.py", "FP8_DYNAMIC", SAMPLE / "model", out, "lm_head")
    r = _verify(run_cli, out, tmp_path / "rep")
    assert r.exit_code == 1, r.output
    assert "Error:" in r.stderr and "model.embed_tokens is an embedding" in r.stderr
    r = run_cli("export-onnx", out, "-o", tmp_path / "m.onnx")
    assert r.exit_code == 1 and "model.embed_tokens is an embedding" in r.stderr
    r = run_cli("inspect", out)
    assert "format        compressed-tensors (no engine loads it as written" in r.stdout
    # what the error asks for: the embedding left out
    fixed = tmp_path / "mfp-fixed"
    _peer("peers/llmcompressor_model_free.py", "FP8_DYNAMIC", SAMPLE / "model", fixed,
          "lm_head,model.embed_tokens")
    r = run_cli("inspect", fixed)
    assert "(loads in vllm and transformers (with compressed-tensors))" in r.stdout
    r = _verify(run_cli, fixed, tmp_path / "rep2")
    assert r.exit_code == 0, r.output


def test_oneshot_mixtral_expert_names_are_refused_by_name(tmp_path, run_cli):
    sys.path.insert(0, str(ROOT / "tests" / "families"))
    from model_families import save_family

    src = save_family("mixtral", tmp_path / "src")
    out = tmp_path / "lc"
    _peer("families/llmcompressor_fp8.py", src, SAMPLE / "data" / "calib.txt", out, 8)
    r = _verify(run_cli, out, tmp_path / "rep", reference=src)
    assert r.exit_code == 1, r.output
    assert "names its experts gate_proj/up_proj/down_proj, but mixtral's loaders read " \
           "experts.N.w1/w3/w2" in r.stderr
    r = run_cli("inspect", out)
    assert "(no engine loads it as written" in r.stdout


def test_oneshot_block_with_partial_blocks_promises_no_engine(tmp_path, run_cli):
    out = tmp_path / "block"
    _peer("peers/llmcompressor_run.py", "FP8_BLOCK", SAMPLE / "model", out)
    r = run_cli("inspect", out)
    assert r.exit_code == 0, r.output
    assert "format        compressed-tensors (no engine loads it as written" in r.stdout
    assert "transformers (with compressed-tensors) does not load it as written: 18 layer(s) " \
           "have partial edge blocks" in r.stdout
    assert "vllm does not load it as written: fused members whose rows" in r.stdout
    r = _verify(run_cli, out, tmp_path / "rep")  # what its config declares still verifies
    assert r.exit_code == 0, r.output
