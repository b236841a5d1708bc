"""``fp8export.inspect.inspect`` on real files: checkpoints (amax, would-be scale, round-trip
SQNR checked against an independent ml_dtypes cast), FP8 folders built by hand from
docs/fp8-folder.md, JSON output, plots, and ONNX delegation."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fp8export.checkpoint import source as _source
from fp8export.errors import Fp8ExportError
from fp8export.inspect import InspectResult, inspect
from fp8export.numerics.fp8 import quantize_e4m3

# Stopgap: open_checkpoint loads the built-in readers only while its registry is empty, so a
# reader registered earlier (importing the Transformer Engine reader does) hides them. Loading
# them here keeps these tests independent of collection order until source.py uses a flag.
_source._load_builtin_readers()

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def independent_sqnr(w: torch.Tensor, scale: float) -> float:
    """Quantize with ml_dtypes (not torch), dequantize, SQNR in float64."""
    x = w.float().numpy().astype(np.float32)
    q = np.clip(x / np.float32(scale), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    deq = q.astype(np.float32) * np.float32(scale)
    ref = x.astype(np.float64)
    return 10 * math.log10(float((ref ** 2).sum()) / float(((ref - deq) ** 2).sum()))


@pytest.fixture()
def checkpoint(tmp_path):
    torch.manual_seed(0)
    t = {
        "model.embed_tokens.weight": torch.randn(32, 16, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": (torch.randn(16, 16) * 0.5).bfloat16(),
        "model.layers.0.self_attn.k_proj.weight": (torch.randn(8, 16) * 2.0).bfloat16(),
        "model.layers.0.self_attn.v_proj.weight": (torch.randn(8, 16) * 0.1).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": (torch.randn(16, 24) * 0.02).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.ones(16, dtype=torch.bfloat16),
        "model.layers.1.mlp.down_proj.weight": (torch.randn(16, 24) * 0.05).bfloat16(),
        "position_ids": torch.arange(8),
    }
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file(t, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"model_type": "llama",
                                               "architectures": ["LlamaForCausalLM"]}))
    return d, t


def rows_by_name(result: InspectResult):
    return {r.name: r for r in result.tensors}


def test_checkpoint_amax_scale_and_sqnr(checkpoint):
    d, t = checkpoint
    result = inspect(d)
    assert result.kind == "checkpoint" and result.reader == "hf-folder"
    rows = rows_by_name(result)
    assert len(result.tensors) == len(t) and set(rows) == set(t)  # every tensor, once
    name = "model.layers.0.mlp.down_proj.weight"
    row = rows[name]
    amax = float(t[name].float().abs().max())
    assert row.role == "candidate" and row.amax == pytest.approx(amax, rel=0, abs=0)
    assert row.scale == float(np.float32(amax / 448))
    assert row.sqnr_db == pytest.approx(independent_sqnr(t[name], row.scale), abs=1e-6)
    assert 25 < row.sqnr_db < 40  # E4M3 has 3 mantissa bits: ~30 dB on gaussian weights
    norm = rows["model.layers.0.input_layernorm.weight"]
    assert norm.role == "float" and norm.scale is None and norm.amax == 1.0
    ids = rows["position_ids"]
    assert ids.role == "other" and ids.amax is None and ids.dtype == "I64"
    s = result.summary
    assert s["tensors"] == len(t) and s["model_type"] == "llama"
    assert s["by_dtype"]["BF16"]["tensors"] == 7 and s["by_dtype"]["I64"]["bytes"] == 64
    assert s["sqnr_db_min"] == min(r.sqnr_db for r in result.tensors if r.sqnr_db is not None)


def test_checkpoint_fused_qkv_share_the_largest_scale(checkpoint):
    d, t = checkpoint
    rows = rows_by_name(inspect(d))
    qkv = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    group_amax = max(float(t[n].float().abs().max()) for n in qkv)
    for n in qkv:
        assert rows[n].scale == float(np.float32(group_amax / 448)), n
        assert rows[n].sqnr_db == pytest.approx(independent_sqnr(t[n], rows[n].scale), abs=1e-6)
    # the embedding stays in high precision and says why
    emb = rows["model.embed_tokens.weight"]
    assert emb.role == "float" and emb.scale is None and emb.note


def test_nan_weight_gets_no_scale_but_inspect_still_explains(tmp_path):
    w = torch.ones(4, 4)
    w[1, 2] = float("nan")
    save_file({"fc.weight": w, "ok.weight": torch.full((2, 2), 0.5)}, tmp_path / "m.safetensors")
    result = inspect(tmp_path / "m.safetensors")
    rows = rows_by_name(result)
    assert math.isnan(rows["fc.weight"].amax) and rows["fc.weight"].scale is None
    assert "no scale possible" in rows["fc.weight"].note
    # 0.5 with scale 0.5/448 maps to exactly 448: a lossless round trip
    assert rows["ok.weight"].sqnr_db == math.inf
    data = result.to_dict()
    json.dumps(data, allow_nan=False)  # strict JSON: non-finite numbers are spelled as strings
    by = {r["name"]: r for r in data["tensors"]}
    assert by["fc.weight"]["amax"] == "nan" and by["ok.weight"]["sqnr_db"] == "inf"


def test_torch_state_dict(tmp_path):
    torch.save({"state_dict": {"fc.weight": torch.randn(4, 8, dtype=torch.float16)}},
               tmp_path / "m.pt")
    result = inspect(tmp_path / "m.pt")
    assert result.reader == "torch"
    assert result.tensors[0].dtype == "F16" and result.tensors[0].scale is not None
    assert any("state_dict" in n for n in result.notes)


# --------------------------------------------------------------------------- FP8 folder

def make_fp8_folder(root: Path, *, manifest_scale_factor: float = 1.0, manifest: bool = True):
    """An FP8 folder as docs/fp8-folder.md describes it (what convert writes)."""
    torch.manual_seed(1)
    d = root / "fp8"
    d.mkdir()
    w = torch.randn(8, 16) * 0.1
    amax = float(w.abs().max())
    scale = np.float32(amax / 448)
    q = quantize_e4m3(w, scale)
    in_scale = np.float32(3.0 / 448)
    tensors = {
        "model.embed_tokens.weight": torch.randn(32, 16, dtype=torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": q,
        "model.layers.0.mlp.down_proj.weight_scale": torch.tensor([scale], dtype=torch.float32),
        "model.layers.0.mlp.down_proj.input_scale": torch.tensor([in_scale], dtype=torch.float32),
        "model.norm.weight": torch.ones(16, dtype=torch.bfloat16),
    }
    save_file(tensors, d / "model.safetensors")
    fp8_args = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                "dynamic": False}
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "quantization_config": {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": fp8_args,
                                          "input_activations": fp8_args}},
            "ignore": ["model.embed_tokens"]}}))
    if manifest:
        (d / "fp8export.json").write_text(json.dumps({
            "format_version": 1, "tool": {"name": "fp8export", "version": "0.1.0"},
            "source": {"name": "ckpt", "kind": "hf-folder", "files": []},
            "options": {}, "output_format": "compressed-tensors", "activation_scheme": "static",
            "quantized": {"model.layers.0.mlp.down_proj": {
                "weight": "model.layers.0.mlp.down_proj.weight", "shape": [8, 16],
                "layout": "out_in", "source_dtype": "F32", "fused_group": None,
                "weight_amax": amax, "weight_scale": float(scale) * manifest_scale_factor,
                "weight_scale_source": "weights", "weight_sqnr_db": 30.25,
                "input_amax": 3.0, "input_scale": float(in_scale),
                "input_scale_source": "calibration", "input_details": {}}},
            "excluded": {"model.embed_tokens.weight": "embedding"},
            "notes": ["activations calibrated on 4 samples"]}))
    return d, q, float(scale), float(in_scale)


def test_fp8_folder_reads_scales_and_manifest(tmp_path):
    d, q, scale, in_scale = make_fp8_folder(tmp_path)
    result = inspect(d)
    assert result.kind == "fp8-folder"
    rows = rows_by_name(result)
    row = rows["model.layers.0.mlp.down_proj.weight"]
    assert row.role == "quantized" and row.dtype == "F8_E4M3"
    assert row.scale == scale and row.input_scale == in_scale
    assert row.amax == pytest.approx(float(q.float().abs().max()) * scale, rel=1e-6)
    assert row.sqnr_db == 30.25
    assert (row.scale_source, row.input_scale_source) == ("weights", "calibration")
    assert rows["model.layers.0.mlp.down_proj.weight_scale"].role == "scale"
    assert rows["model.embed_tokens.weight"].note == "embedding"
    s = result.summary
    assert s["quantized"] == 1 and s["static_input_scales"] == 1
    assert s["activation_scheme"] == "static" and s["quantization_config"] == "compressed-tensors"
    assert s["by_dtype"]["F8_E4M3"]["bytes"] == 128
    assert "activations calibrated on 4 samples" in result.notes
    assert not any("modified" in n for n in result.notes)


def test_fp8_folder_scale_disagreeing_with_manifest_is_refused(tmp_path):
    d, *_ = make_fp8_folder(tmp_path, manifest_scale_factor=2.0)
    with pytest.raises(Fp8ExportError, match="weight_scale is .* but the manifest records"):
        inspect(d)


def test_fp8_folder_without_manifest(tmp_path):
    d, _, scale, _ = make_fp8_folder(tmp_path, manifest=False)
    result = inspect(d)
    assert result.kind == "fp8-folder"
    row = rows_by_name(result)["model.layers.0.mlp.down_proj.weight"]
    assert row.scale == scale and row.sqnr_db is None
    assert any("no fp8export.json" in n for n in result.notes)


def test_fp8_folder_with_broken_manifest(tmp_path):
    d, *_ = make_fp8_folder(tmp_path)
    (d / "fp8export.json").write_text("{oops")
    with pytest.raises(Fp8ExportError, match="fp8export.json.*not valid JSON"):
        inspect(d)


# ---------------------------------------------------------------------------------- plot

@pytest.mark.parametrize("kind", ["checkpoint", "fp8"])
def test_plot_writes_a_png(tmp_path, checkpoint, kind):
    d = checkpoint[0] if kind == "checkpoint" else make_fp8_folder(tmp_path)[0]
    out = tmp_path / "scales.png"
    result = inspect(d, plot=out)
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1024
    assert result.plot == str(out)


def test_plot_to_unwritable_path(tmp_path, checkpoint):
    with pytest.raises(Fp8ExportError, match="cannot write the plot"):
        inspect(checkpoint[0], plot=tmp_path / "no" / "such" / "dir" / "p.png")


# ---------------------------------------------------------------------------------- ONNX

def test_onnx_is_delegated_to_the_checker(tmp_path, monkeypatch):
    seen = []

    class Report:
        ok = False

        def to_text(self):
            return "rule Q/DQ: FAILED"

        def to_dict(self):
            return {"ok": False}

    def check_model(path):
        seen.append(Path(path))
        return Report()

    monkeypatch.setitem(sys.modules, "fp8export.onnx.check",
                        types.SimpleNamespace(check_model=check_model))
    (tmp_path / "m.onnx").write_bytes(b"\x08\x07")
    result = inspect(tmp_path / "m.onnx")
    assert seen == [tmp_path / "m.onnx"]
    assert result.kind == "onnx" and not result.ok and result.report == {"ok": False}
    assert "rule Q/DQ: FAILED" in result.to_text()
    with pytest.raises(Fp8ExportError, match="--plot"):
        inspect(tmp_path / "m.onnx", plot=tmp_path / "p.png")


def test_checkpoint_prediction_matches_what_convert_writes(tmp_path, checkpoint):
    """inspect on a checkpoint predicts the scale and SQNR that convert then records."""
    from fp8export import api
    from fp8export.convert.config import ConvertConfig

    d, _ = checkpoint
    out = tmp_path / "out-fp8"
    api.convert(ConvertConfig(checkpoint=d, output=out))
    before, after = rows_by_name(inspect(d)), rows_by_name(inspect(out))
    quantized = [n for n, r in after.items() if r.role == "quantized"]
    assert quantized and sorted(quantized) == sorted(n for n, r in before.items()
                                                     if r.role == "candidate")
    for name in quantized:
        assert after[name].scale == before[name].scale, name
        assert after[name].sqnr_db == pytest.approx(before[name].sqnr_db, abs=1e-3), name
        # dequantized amax never exceeds 448 * scale, and the largest code hits it for
        # the tensor that set its (group's) scale
        assert after[name].amax <= 448 * after[name].scale * (1 + 1e-6)
    assert inspect(out).summary["quantized"] == len(quantized)


def test_training_history_gives_input_scales(tmp_path, monkeypatch):
    """A checkpoint with FP8 training state shows the input scales convert would take from it."""
    from fp8export.checkpoint import source
    from fp8export.checkpoint.hf_folder import WeightFilesCheckpoint
    from fp8export.checkpoint.training.base import AmaxHistory, TrainingState

    save_file({"fc1.weight": torch.randn(8, 4), "fc2.weight": torch.randn(4, 8)},
              tmp_path / "m.safetensors")
    history = np.array([0.0, 3.0, 5.5, 2.0], dtype=np.float32)  # newest first

    class WithHistory(WeightFilesCheckpoint):
        def training_state(self):
            return TrainingState("transformer-engine", "test", [
                AmaxHistory("fc1", "input", history), AmaxHistory("fc1", "weight", history)])

    reader = ("test-history", lambda p: p.suffix == ".safetensors",
              lambda p: WithHistory(p, "safetensors", [p]))
    monkeypatch.setattr(source, "_READERS", [reader])
    result = inspect(tmp_path / "m.safetensors")
    rows = rows_by_name(result)
    assert rows["fc1.weight"].input_scale == float(np.float32(5.5 / 448))
    assert rows["fc1.weight"].input_scale_source == "history"
    assert rows["fc2.weight"].input_scale is None
    assert result.summary["training_state"] == {"framework": "transformer-engine",
                                                "version": "test", "histories": 2}
    assert any("fc2" in n and "no FP8 input history" in n for n in result.notes)
    assert "input scales from history" in result.to_text()


def test_fp8_folder_without_config_json_is_still_checked(tmp_path):
    # convert from a bare .safetensors writes no config.json: inspect shows the folder, and
    # still refuses one whose scales were edited
    d, *_ = make_fp8_folder(tmp_path)
    (d / "config.json").unlink(missing_ok=True)
    assert any("cannot run this folder" in n for n in inspect(d).notes)
    (tmp_path / "bad").mkdir()
    bad, *_ = make_fp8_folder(tmp_path / "bad", manifest_scale_factor=2.0)
    (bad / "config.json").unlink(missing_ok=True)
    with pytest.raises(Fp8ExportError, match="but the manifest records"):
        inspect(bad)
