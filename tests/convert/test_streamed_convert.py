"""convert's model steps with layer streaming: GPTQ (the same matrices, so the same codes),
the FP8 KV cache and sequential GPTQ (calibration/hessian_streamed.py, convert/rounding.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fp8export.api import convert
from fp8export.convert.config import ConvertConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "families"))
DATA = Path(__file__).resolve().parents[2] / "samples" / "tiny-llama" / "data" / "calib.txt"


@pytest.fixture(scope="module", params=["llama", "qwen3-moe"])
def src(request, tmp_path_factory):
    from model_families import save_family

    return save_family(request.param, tmp_path_factory.mktemp(request.param) / "src")


def _convert(src, out, **kw):
    kw.setdefault("device", "cpu")
    convert(ConvertConfig(checkpoint=src, output=out, calib_data=DATA, calib_samples=12,
                          batch_size=4, **kw))
    manifest = json.loads((out / "fp8export.json").read_text())
    return {p.name: p.read_bytes() for p in out.glob("*.safetensors")}, manifest


def test_streamed_gptq_and_kv_cache_write_the_same_shards(src, tmp_path):
    whole, m1 = _convert(src, tmp_path / "whole", weight_rounding="gptq", kv_cache="fp8")
    layers, m2 = _convert(src, tmp_path / "layers", weight_rounding="gptq", kv_cache="fp8",
                          offload="layers")
    assert whole == layers
    assert m1["kv_cache"]["layers"] == m2["kv_cache"]["layers"]
    assert m1["weight_rounding"]["layers"] == m2["weight_rounding"]["layers"] > 0
    assert not m2["weight_rounding"]["nearest_layers"]


@pytest.mark.gpu
def test_streamed_gptq_on_the_gpu_sums_on_the_device_and_writes_the_same_shards(
        src, tmp_path, monkeypatch):
    """On a GPU the input matrices' partial sums stay on the device (no copy to the host per
    slot): the same additions, so the same codes as the whole model's."""
    from fp8export import distributed

    kept = []
    init = distributed.SlotSums.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        kept.append(self.on_device)

    kw = {"weight_rounding": "gptq", "device": "cuda"}
    whole, _ = _convert(src, tmp_path / "whole", **kw)
    monkeypatch.setattr(distributed.SlotSums, "__init__", spy)
    layers, _ = _convert(src, tmp_path / "layers", offload="layers", **kw)
    assert kept and all(kept)
    assert whole == layers


def test_sequential_gptq_rounds_on_the_rounded_layers_inputs(src, tmp_path):
    parallel, _ = _convert(src, tmp_path / "gptq", weight_rounding="gptq")
    sequential, m = _convert(src, tmp_path / "seq", weight_rounding="gptq-sequential")
    entry = m["weight_rounding"]
    assert entry["method"] == "gptq-sequential" and entry["passes"] == 2
    assert entry["layers"] == len(m["quantized"]) and "layers before it" in entry["inputs"]
    # layer 0 sees the same (bf16) inputs either way; later layers see the rounded ones
    assert sequential != parallel
