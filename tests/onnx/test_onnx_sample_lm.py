"""The ONNX path end to end on the sample LM (samples/tiny-llama/model): convert -> export-onnx ->
checker (every quantized GEMM FP8-eligible) -> onnxruntime at two shapes -> logits within the
bound of the torch FP8 model. Slow (convert + two exports, ~2 min on 2 cores)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8export.numerics.metrics import rel_l2

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "tiny-llama"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (SAMPLE / "model" / "model.safetensors").is_file(),
                       reason="sample LM not built (samples/tiny-llama/train.py)"),
]


def _texts(n: int) -> list[str]:
    lines = (SAMPLE / "data" / "eval.jsonl").read_text().splitlines()
    return [json.loads(ln)["text"] for ln in lines[:n]]


def _feed(tokenizer, texts: list[str], seq: int) -> dict[str, np.ndarray]:
    ids = [tokenizer(t)["input_ids"][:seq] for t in texts]
    ids = [x + x[: seq - len(x)] if len(x) < seq else x for x in ids]  # fill by repeating
    arr = np.asarray(ids, dtype=np.int64)
    return {"input_ids": arr, "attention_mask": np.ones_like(arr)}


def test_sample_lm_done_when(run_cli, tmp_path):
    from transformers import AutoTokenizer

    from fp8export.runners.ort_runner import OrtRunner
    from fp8export.runtime.fp8_model import load_fp8_model

    out = tmp_path / "out"
    res = run_cli("convert", SAMPLE / "model", "-o", out, "--calib-data",
                  SAMPLE / "data" / "calib.txt")
    assert res.exit_code == 0, res.output
    manifest = json.loads((out / "fp8export.json").read_text())
    n = len(manifest["quantized"])
    for dtype in ("fp32", "fp16"):
        path = tmp_path / f"model_{dtype}.onnx"
        res = run_cli("export-onnx", out, "-o", path, "--dtype", dtype, "--json")
        assert res.exit_code == 0, res.output
        result = json.loads(res.output[res.output.index("{"):res.output.rindex("}") + 1])
        assert res.stderr.strip().splitlines()[-1].startswith("PASSED | export-onnx | ")
        assert result["check"]["ok"] and len(result["fp8_gemms"]) == n and not result["sixteen_bit"]
    tok = AutoTokenizer.from_pretrained(str(SAMPLE / "model"))
    fp8_model = load_fp8_model(out, dtype=torch.float32, mode="emulate")[0]
    for batch, seq in ((1, 16), (4, 48)):
        feed = _feed(tok, _texts(batch), seq)
        with torch.no_grad():
            ref = fp8_model(input_ids=torch.from_numpy(feed["input_ids"]),
                            attention_mask=torch.from_numpy(feed["attention_mask"])).logits
        with OrtRunner(tmp_path / "model_fp32.onnx") as r32, \
                OrtRunner(tmp_path / "model_fp16.onnx") as r16:
            got32 = torch.from_numpy(r32.infer(feed)["logits"])
            got16 = torch.from_numpy(r16.infer(feed)["logits"].astype(np.float32))
        assert got32.shape == (batch, seq, ref.shape[-1])
        # README "ONNX export": the fp32 graph's logits match the torch FP8 model to rel-L2
        # < 3e-4 (measured 2.7e-7 at 1x16; 8.7e-5 and, with other calibrated scales, 1.8e-4 at
        # 4x48): what is left is the two runtimes' fp32 accumulation order, which moves an
        # activation across an E4M3 rounding boundary here and there (one code step, up to 6%
        # of that value). fp16 activations give 5.7e-3, 7.4e-3; a wrong scale far more.
        r32, r16 = rel_l2(ref, got32), rel_l2(ref, got16)
        assert r32 < 3e-4, r32
        assert r16 < 2e-2, r16
        assert (ref.argmax(-1) == got32.argmax(-1)).float().mean() >= 0.99
