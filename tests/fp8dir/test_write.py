"""Writers: streaming safetensors, golden header bytes, format configs, read-back verification."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp8export.config import OutputFormat
from fp8export.convert.config import ConvertConfig
from fp8export.errors import Fp8ExportError
from fp8export.fp8dir.formats import quantization_config, scale_shape
from fp8export.fp8dir.readback import verify_output
from fp8export.fp8dir.safetensors_writer import PlannedTensor, header_bytes, write_safetensors
from fp8export.fp8dir.write import plan_shards, write_shards
from fp8export.numerics.fp8 import quantize_e4m3
from fp8export.numerics.metrics import sqnr_db
from fp8export.scales.select import select_targets
from fp8export.scales.weights import CHUNK, quantize_weight, roundtrip_sqnr, scan_weights

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_streaming_writer_round_trips_every_dtype(tmp_path):
    tensors = {
        "a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.randn(7).to(torch.float16),
        "c": torch.randn(2, 2).to(torch.float8_e4m3fn), "d": torch.tensor(0.5),
        "e": torch.arange(6, dtype=torch.int64).reshape(2, 3), "f": torch.zeros(0, 4),
        "g": torch.tensor([True, False]),
    }
    plan = [PlannedTensor(n, {torch.bfloat16: "BF16", torch.float16: "F16",
                              torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32",
                              torch.int64: "I64", torch.bool: "BOOL"}[t.dtype], tuple(t.shape))
            for n, t in tensors.items()]
    path = tmp_path / "x.safetensors"
    n = write_safetensors(path, plan, lambda p: tensors[p.name])
    assert n == path.stat().st_size
    (hlen,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert hlen % 8 == 0
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert list(f.keys()) == sorted(tensors)
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.view(torch.uint8) if t.dtype == torch.float8_e4m3fn
                               else got, t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn
                               else t)


def test_streaming_writer_rejects_a_tensor_that_breaks_the_plan(tmp_path):
    plan = [PlannedTensor("a", "F32", (2,))]
    with pytest.raises(RuntimeError, match="planned F32"):
        write_safetensors(tmp_path / "x.safetensors", plan, lambda p: torch.zeros(3))


def _golden_checkpoint(folder: Path) -> Path:
    """A tiny llama-shaped checkpoint with fixed (non-random) bf16 values."""
    folder.mkdir()

    def ramp(*shape, k=1.0):
        n = int(np.prod(shape))
        return (torch.linspace(-k, k, n) ** 3).reshape(shape).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": ramp(8, 4), "model.layers.0.self_attn.q_proj.weight":
         ramp(4, 4, k=0.5), "model.layers.0.self_attn.k_proj.weight": ramp(2, 4, k=0.25),
         "model.layers.0.self_attn.v_proj.weight": ramp(2, 4, k=2.0),
         "model.layers.0.mlp.down_proj.weight": ramp(4, 6), "model.norm.weight": ramp(4),
         "lm_head.weight": ramp(8, 4)}
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return folder


def test_golden_header_bytes(tmp_path):
    from fp8export.convert.pipeline import convert

    src = _golden_checkpoint(tmp_path / "golden-src")
    out = tmp_path / "golden-fp8"
    convert(ConvertConfig(checkpoint=src, output=out))
    data = (out / "model.safetensors").read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = data[: 8 + hlen]
    golden = GOLDEN / "tiny_fp8_model.safetensors.header"
    if os.environ.get("FP8EXPORT_REGEN_GOLDEN") == "1":  # deliberate regeneration only
        golden.write_bytes(header)
    assert header == golden.read_bytes(), (
        "the FP8 safetensors header changed; if deliberate, rerun with FP8EXPORT_REGEN_GOLDEN=1")
    # The fused q/k/v share one scale: the max amax, v_proj's 2.0**3 = 8, over 448, in float32.
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        scales = {m: float(f.get_tensor(f"model.layers.0.self_attn.{m}.weight_scale"))
                  for m in ("q_proj", "k_proj", "v_proj")}
    assert set(scales.values()) == {float(np.float32(8.0 / 448))}


def test_quantize_weight_matches_reference_sqnr():
    torch.manual_seed(0)
    w = torch.randn(3000, 2000).to(torch.bfloat16)
    assert w.numel() > CHUNK  # several chunks
    scale = np.float32(float(w.float().abs().max()) / 448)
    q = quantize_weight(w, scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert torch.equal(q.view(torch.uint8), quantize_e4m3(w, scale).view(torch.uint8))
    ref = sqnr_db(w.float(), q.float() * float(scale))  # float64 reference implementation
    got = roundtrip_sqnr(w, q, float(scale))
    assert abs(got - ref) < 1e-3
    assert 28.0 < got < 36.0  # per-tensor E4M3 of a Gaussian: ~31 dB
    # values beyond the scale's range saturate at ±448 (clamp before cast), never NaN
    small = quantize_weight(w, np.float32(float(scale) / 8)).float()
    assert not small.isnan().any() and small.abs().max() == 448.0
    assert torch.equal(quantize_weight(w, np.float32(float(scale) / 8)).view(torch.uint8),
                       quantize_e4m3(w, np.float32(float(scale) / 8)).view(torch.uint8))


def _static_ct_config(static, dynamic, ignore=("lm_head",)):
    return quantization_config(OutputFormat.COMPRESSED_TENSORS, static=static, dynamic=dynamic,
                               ignore=list(ignore), tool_version="0.1.0")


def test_compressed_tensors_configs():
    dyn = _static_ct_config([], ["a.q_proj"])
    assert dyn["format"] == "float-quantized" and dyn["quantization_status"] == "compressed"
    g = dyn["config_groups"]["group_0"]
    assert g["targets"] == ["Linear"]
    assert g["weights"] == {"num_bits": 8, "type": "float", "strategy": "tensor",
                            "symmetric": True, "dynamic": False}
    assert g["input_activations"]["dynamic"] is True
    static = _static_ct_config(["a.q_proj"], [])
    assert static["config_groups"]["group_0"]["input_activations"]["strategy"] == "tensor"
    assert static["config_groups"]["group_0"]["input_activations"]["dynamic"] is False
    mixed = _static_ct_config(["b.q_proj", "a.q_proj"], ["c.o_proj"])
    assert mixed["config_groups"]["group_0"]["targets"] == ["a.q_proj", "b.q_proj"]
    assert mixed["config_groups"]["group_1"]["targets"] == ["c.o_proj"]
    assert mixed["config_groups"]["group_1"]["input_activations"]["dynamic"] is True


@pytest.mark.parametrize("static,dynamic", [([], ["m"]), (["m"], []), (["m"], ["n"])])
def test_compressed_tensors_config_validates_with_the_real_package(static, dynamic):
    ct = pytest.importorskip("compressed_tensors.quantization")
    cfg = _static_ct_config(static, dynamic)
    parsed = ct.QuantizationConfig.model_validate(cfg)
    for group in parsed.config_groups.values():
        assert group.weights.type == "float" and group.weights.strategy == "tensor"
        assert group.weights.num_bits == 8 and not group.weights.dynamic
    assert parsed.ignore == ["lm_head"] and parsed.format == "float-quantized"


def test_vllm_and_modelopt_configs_and_their_limits():
    v = quantization_config(OutputFormat.VLLM, static=[], dynamic=["m"], ignore=["lm_head"],
                            tool_version="0.1.0")
    assert v == {"quant_method": "fp8", "activation_scheme": "dynamic",
                 "ignored_layers": ["lm_head"]}
    with pytest.raises(Fp8ExportError, match="one activation_scheme"):
        quantization_config(OutputFormat.VLLM, static=["a"], dynamic=["b"], ignore=[],
                            tool_version="0.1.0")
    with pytest.raises(Fp8ExportError, match="static-only"):
        quantization_config(OutputFormat.MODELOPT, static=[], dynamic=["b"], ignore=[],
                            tool_version="0.1.0")
    mo = quantization_config(OutputFormat.MODELOPT, static=["a"], dynamic=[],
                             ignore=["lm_head"], tool_version="0.1.0")
    assert mo["quant_method"] == "modelopt" and mo["quant_algo"] == "FP8"
    assert scale_shape(OutputFormat.MODELOPT) == () and scale_shape(OutputFormat.VLLM) == (1,)


def _written(tmp_path, dict_ckpt):
    torch.manual_seed(0)
    t = {"x.q_proj.weight": torch.randn(16, 8).to(torch.bfloat16),
         "x.k_proj.weight": torch.randn(8, 8).to(torch.bfloat16),
         "x.norm.weight": torch.ones(8, dtype=torch.bfloat16)}
    ckpt = dict_ckpt(t, config={"model_type": "llama"})
    sel = select_targets(ckpt.tensors(), ckpt.config)
    scan = scan_weights(sel.targets, ckpt.load, sel.groups)
    ws = {m: scan.scale[m] for m in sel.modules}
    ins = {"x.q_proj": np.float32(0.01), "x.k_proj": np.float32(0.01)}
    plans = plan_shards(ckpt, {x.weight: x for x in sel.targets}, ws, ins, (1,))
    write_shards(tmp_path, plans, ckpt, ws, ins)
    return ckpt, plans, ws, ins


def test_readback_passes_on_a_good_output(tmp_path, dict_ckpt):
    ckpt, plans, ws, ins = _written(tmp_path, dict_ckpt)
    sqnr = verify_output(tmp_path, plans, ckpt, ws, ins)
    assert set(sqnr) == {"x.q_proj", "x.k_proj"} and min(sqnr.values()) > 25


def _patch_tensor(path: Path, name: str, value: bytes):
    data = bytearray(path.read_bytes())
    (hlen,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8:8 + hlen])[name]["data_offsets"]
    assert len(value) == end - begin
    data[8 + hlen + begin: 8 + hlen + end] = value
    path.write_bytes(bytes(data))


def test_readback_catches_a_corrupted_weight_scale(tmp_path, dict_ckpt):
    ckpt, plans, ws, ins = _written(tmp_path, dict_ckpt)
    _patch_tensor(tmp_path / "model.safetensors", "x.q_proj.weight_scale",
                  np.float32(float(ws["x.q_proj"]) * 4).tobytes())
    with pytest.raises(Fp8ExportError) as err:
        verify_output(tmp_path, plans, ckpt, ws, ins)
    msg = str(err.value)
    assert "x.q_proj.weight_scale" in msg and "was computed" in msg
    assert "x.q_proj.weight: the FP8 weight read back" in msg  # SQNR collapses too


def test_readback_catches_non_finite_input_scale_and_bad_weight_bytes(tmp_path, dict_ckpt):
    ckpt, plans, ws, ins = _written(tmp_path, dict_ckpt)
    _patch_tensor(tmp_path / "model.safetensors", "x.k_proj.input_scale",
                  np.float32(np.inf).tobytes())
    _patch_tensor(tmp_path / "model.safetensors", "x.q_proj.weight", bytes(16 * 8))
    with pytest.raises(Fp8ExportError) as err:
        verify_output(tmp_path, plans, ckpt, ws, ins)
    msg = str(err.value)
    assert "x.k_proj.input_scale = inf is not a finite positive scale" in msg
    assert "x.q_proj.weight" in msg and "SQNR" in msg


def test_header_bytes_are_deterministic_and_padded():
    plan = [PlannedTensor("w", "F8_E4M3", (3, 5)), PlannedTensor("w_scale", "F32", (1,))]
    a, b = header_bytes(plan), header_bytes(plan)
    assert a == b and (len(a) - 8) % 8 == 0
    header = json.loads(a[8:])
    assert header["w"]["data_offsets"] == [0, 15] and header["w_scale"]["data_offsets"] == [15, 19]


def test_dump_json_is_deterministic_plain_and_refuses_nan():
    from fp8export.fp8dir.manifest import dump_json

    a = dump_json({"b": np.float32(0.5), "a": [np.int64(2)], "p": Path("/abs/dir/amax.json")})
    assert a == b'{\n  "a": [\n    2\n  ],\n  "b": 0.5,\n  "p": "amax.json"\n}\n'
    with pytest.raises(ValueError):
        dump_json({"x": float("inf")})
