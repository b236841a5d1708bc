"""export-onnx on a converted tiny Llama: accuracy vs torch FP8 emulation, shapes, profile."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from fp8_folder_maker import token_feed
from onnx_reference import OnnxReferenceRunner

from fp8export.numerics.fp8 import fake_quantize_e4m3
from fp8export.numerics.metrics import cosine, rel_l2
from fp8export.runners.ort_runner import OrtRunner

SHAPES = [(2, 8), (3, 13)]


def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, dtype=np.float32))


def _hooked_emulation(fp8_dir, *, quantize_inputs: bool = True):
    """Independent emulation: dequantized weights + fake-quantized inputs via pre-hooks, fp32."""
    from fp8export.fp8dir.reader import read_fp8_folder
    from fp8export.onnx.export import build_torch_model

    folder = read_fp8_folder(fp8_dir)
    model = build_torch_model(folder, torch.float32)
    mods = dict(model.named_modules())
    if quantize_inputs:
        for name, layer in folder.layers.items():
            if layer.input_scale is not None:
                s = layer.input_scale
                mods[name].register_forward_pre_hook(
                    lambda _m, args, s=s: (fake_quantize_e4m3(args[0], s), *args[1:]))
    return model


def _torch_logits(model, feed):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(feed["input_ids"]),
                     attention_mask=torch.from_numpy(feed["attention_mask"])).logits.float()


def test_fp32_logits_match_torch_fp8_model(onnx_fp32, fp8_static):
    """The acceptance bound: rel L2 <= 1e-3 against the torch FP8 model with the same scales."""
    from fp8export.runtime.fp8_model import load_fp8_model

    _, path = onnx_fp32
    fp8_model = load_fp8_model(fp8_static, dtype=torch.float32, mode="emulate")[0]
    hooked = _hooked_emulation(fp8_static)
    no_act_q = _hooked_emulation(fp8_static, quantize_inputs=False)
    with OrtRunner(path, providers=["CPUExecutionProvider"]) as runner:
        for b, s in SHAPES:
            feed = token_feed(b, s, seed=b * 100 + s)
            got = _t(runner.infer(feed)["logits"])
            assert tuple(got.shape) == (b, s, 256)
            for ref in (_torch_logits(fp8_model, feed), _torch_logits(hooked, feed)):
                assert rel_l2(ref, got) <= 1e-3
                assert cosine(ref, got) >= 0.99999
            # the activation Q/DQ is live: without it the error is far larger than the bound
            assert rel_l2(_torch_logits(no_act_q, feed), got) > 10 * rel_l2(
                _torch_logits(hooked, feed), got)


def test_padded_batch_matches_on_unmasked_positions(onnx_fp32, fp8_static):
    _, path = onnx_fp32
    hooked = _hooked_emulation(fp8_static)
    feed = token_feed(2, 10, seed=7)
    feed["attention_mask"][1, 6:] = 0  # right padding
    with OrtRunner(path) as runner:
        got = _t(runner.infer(feed)["logits"])
    ref = _torch_logits(hooked, feed)
    keep = torch.from_numpy(feed["attention_mask"]).bool()
    assert rel_l2(ref[keep], got[keep]) <= 1e-3


def test_checker_passes_every_quantized_linear_is_fp8(onnx_fp32, fp8_static):
    result, path = onnx_fp32
    manifest = json.loads((fp8_static / "fp8export.json").read_text())
    assert result.check["ok"] is True
    assert sorted(result.fp8_gemms) == sorted(manifest["quantized"])
    assert result.sixteen_bit == {}
    onnx.checker.check_model(str(path), full_check=True)
    from fp8export.onnx.check import check_model

    report = check_model(path)
    assert report.ok and len(report.fp8_gemms) == len(manifest["quantized"]) == 14
    assert report.float_gemms == 5  # 4 attention BMMs + lm_head, left in high precision


def test_graph_follows_the_profile(onnx_fp32):
    result, path = onnx_fp32
    model = onnx.load(str(path))
    assert result.opset == 21 and model.opset_import[0].version == 21
    assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"}
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask"]
    assert model.graph.output[0].name == "logits"
    for vi in model.graph.input:
        dims = vi.type.tensor_type.shape.dim
        assert vi.type.tensor_type.elem_type == onnx.TensorProto.INT64
        assert all(d.dim_param and not d.dim_value for d in dims)  # dynamic batch and sequence
    fp8 = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT8E4M3FN]
    assert len(fp8) == 14 + 1  # weights + the shared zero point
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QuantizeLinear") == 8  # shared by q/k/v and gate/up: 4 per layer
    assert ops.count("DequantizeLinear") == 14 + 8
    scales = [t for t in model.graph.initializer if t.name.endswith("_scale")]
    assert scales and all(t.data_type == onnx.TensorProto.FLOAT and not t.dims for t in scales)
    assert not any(p.key.startswith("pkg.torch")
                   for n in model.graph.node for p in n.metadata_props)
    # no float copy of a quantized weight is left behind
    assert not any(t.name.startswith("val_") and len(t.dims) == 2 and t.dims[0] == 64
                   and t.dims[1] in (32, 64, 128) for t in model.graph.initializer)


def test_onnx_reference_agrees_with_onnxruntime(onnx_fp32):
    _, path = onnx_fp32
    feed = token_feed(1, 6, seed=3)
    with OrtRunner(path) as ort_runner, OnnxReferenceRunner(path) as ref_runner:
        a = _t(ort_runner.infer(feed)["logits"])
        b = _t(ref_runner.infer(feed)["logits"])
    assert rel_l2(b, a) <= 1e-4


def test_fp16_dynamic_activations_via_cli(run_cli, fp8_dynamic, tmp_path):
    out = tmp_path / "dyn.onnx"
    res = run_cli("export-onnx", fp8_dynamic, "-o", out, "--dtype", "fp16")
    assert res.exit_code == 0, res.output
    assert "FP8-eligible GEMMs (TensorRT): 0 of 14 quantized" in res.output
    # one sentence with the way to FP8 GEMMs, not one warning line per layer
    assert "note: no FP8 GEMMs: the folder has no static input scales" in res.stderr
    assert "--calib-data FILE" in res.stderr and "16-bit GEMMs" not in res.output
    said = [line for line in res.output.splitlines() if not line.startswith("[stage]")]
    assert len(said) <= 5, res.output  # wrote, GEMM count, two notes, status
    # the wait is torch's exporter: the stage line says so before it, the summary after
    assert any(ln.startswith("[stage] tracing") and "torch's exporter" in ln
               for ln in res.stderr.splitlines())
    assert "s in torch.onnx.export)" in res.stdout
    model = onnx.load(str(out))
    assert not any(n.op_type == "QuantizeLinear" for n in model.graph.node)
    scales = [t for t in model.graph.initializer if t.name.endswith("weight_scale")]
    assert len(scales) == 14 and all(t.data_type == onnx.TensorProto.FLOAT16 for t in scales)
    weight_only = _hooked_emulation(fp8_dynamic, quantize_inputs=False)
    with OrtRunner(out) as runner:
        for b, s in SHAPES:
            feed = token_feed(b, s, seed=s)
            got = runner.infer(feed)["logits"]
            assert got.dtype == np.float16
            ref = _torch_logits(weight_only, feed)
            assert cosine(ref, _t(got)) >= 0.999
            assert rel_l2(ref, _t(got)) <= 5e-2  # fp16 activations vs fp32 emulation


def test_build_engines_default_profile_keeps_to_the_models_positions(onnx_fp32, run_cli,
                                                                    tmp_path, monkeypatch):
    _, path = onnx_fp32
    props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False)
             .metadata_props}
    assert props["fp8export.max_positions"] == "128"  # the folder's max_position_embeddings
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # printing needs no TensorRT
    r = run_cli("build-engine", path, "-o", tmp_path / "m.engine", "--print-command")
    assert r.exit_code == 0, r.output
    for name in ("input_ids", "attention_mask"):
        assert f"{name}:8x128" in r.stdout and f"{name}:8x512" not in r.stdout


def test_existing_output_needs_force(onnx_fp32, fp8_static, run_cli):
    _, path = onnx_fp32
    before = path.read_bytes()
    res = run_cli("export-onnx", fp8_static, "-o", path)
    assert res.exit_code == 1 and "--force" in res.output
    assert path.read_bytes() == before


@pytest.mark.slow
def test_export_is_deterministic_and_force_overwrites(onnx_fp32, fp8_static):
    from fp8export.onnx.export import ExportOnnxConfig, export_onnx

    _, path = onnx_fp32
    again = export_onnx(ExportOnnxConfig(fp8_dir=fp8_static, output=path.with_name("b.onnx"),
                                         dtype="fp32"))
    assert again.output.read_bytes() == path.read_bytes()
    export_onnx(ExportOnnxConfig(fp8_dir=fp8_static, output=again.output, dtype="fp32",
                                 force=True))
    assert again.output.read_bytes() == path.read_bytes()


@pytest.mark.slow
def test_bf16_graph_opset23_runs_in_onnx_reference(onnx_fp32, fp8_static, tmp_path):
    from fp8export.errors import Fp8ExportError
    from fp8export.onnx.export import ExportOnnxConfig, export_onnx

    res = export_onnx(ExportOnnxConfig(fp8_dir=fp8_static, output=tmp_path / "bf16.onnx",
                                       dtype="bf16"))
    assert res.opset == 23 and res.ir_version >= 11 and res.check["ok"]
    assert len(res.fp8_gemms) == 14
    model = onnx.load(str(res.output))
    dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert all(any(a.name == "output_dtype" and a.i == onnx.TensorProto.BFLOAT16
                   for a in n.attribute) for n in dqs)
    feed = token_feed(1, 5, seed=11)
    with OnnxReferenceRunner(res.output) as ref:
        got = _t(ref.infer(feed)["logits"])
    with OrtRunner(onnx_fp32[1]) as runner:
        want = _t(runner.infer(feed)["logits"])
    assert cosine(want, got) >= 0.99
    with pytest.raises(Fp8ExportError, match="--dtype fp16"):
        OrtRunner(res.output).activate()


def test_gpt2_conv1d_in_out_layout(tmp_path):
    """GPT-2 stores Conv1D weights [in, out] (manifest layout in_out): bound and oriented right."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from fp8export import api
    from fp8export.convert.config import ConvertConfig
    from fp8export.onnx.export import ExportOnnxConfig, export_onnx
    from fp8export.runtime.fp8_model import load_fp8_model

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64,
                     bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).to(torch.bfloat16).eval().save_pretrained(tmp_path / "src")
    np.savez(tmp_path / "calib.npz", input_ids=token_feed(4, 16, seed=5)["input_ids"])
    api.convert(ConvertConfig(checkpoint=tmp_path / "src", output=tmp_path / "fp8",
                              scales="calibrate", calib_data=tmp_path / "calib.npz"))
    manifest = json.loads((tmp_path / "fp8" / "fp8export.json").read_text())
    assert {e["layout"] for e in manifest["quantized"].values()} == {"in_out"}
    res = export_onnx(ExportOnnxConfig(fp8_dir=tmp_path / "fp8", output=tmp_path / "g.onnx",
                                       dtype="fp32"))
    assert res.check["ok"] and sorted(res.fp8_gemms) == sorted(manifest["quantized"])
    ref_model = load_fp8_model(tmp_path / "fp8", dtype=torch.float32, mode="emulate")[0]
    feed = token_feed(2, 9, seed=6)
    with OrtRunner(res.output) as runner:
        got = _t(runner.infer(feed)["logits"])
    assert rel_l2(_torch_logits(ref_model, feed), got) <= 1e-3
