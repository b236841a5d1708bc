"""Bad input to export-onnx: exit 1, a message naming the layer/option and the fix, no file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
from safetensors.torch import load_file, save_file

from fp8export.errors import Fp8ExportError
from fp8export.onnx.export import ExportOnnxConfig, write_model

LAYER = "model.layers.0.mlp.down_proj"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _no_leftovers(folder: Path) -> None:
    left = [p.name for p in folder.iterdir() if p.suffix == ".onnx" or ".tmp-" in p.name]
    assert left == [], left


def test_folder_without_manifest(run_cli, fp8_static, tmp_path):
    bad = _copy(fp8_static, tmp_path / "fp8")
    (bad / "fp8export.json").unlink()
    # its config still declares compressed-tensors FP8: read as a folder another tool wrote
    res = run_cli("export-onnx", bad, "-o", tmp_path / "m.onnx")
    assert res.exit_code == 0, res.output
    (tmp_path / "m.onnx").unlink()
    # neither a manifest nor an FP8 config: not an FP8 folder
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["quantization_config"]
    (bad / "config.json").write_text(json.dumps(cfg))
    res = run_cli("export-onnx", bad, "-o", tmp_path / "m.onnx")
    assert res.exit_code == 1
    assert "fp8export.json" in res.output and "fp8export convert" in res.output
    assert "Traceback" not in res.output
    _no_leftovers(tmp_path)


def test_missing_weight_scale_names_the_layer(run_cli, fp8_static, tmp_path):
    bad = _copy(fp8_static, tmp_path / "fp8")
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors[f"{LAYER}.weight_scale"]
    save_file(tensors, str(bad / "model.safetensors"))
    res = run_cli("export-onnx", bad, "-o", tmp_path / "m.onnx")
    assert res.exit_code == 1
    assert f"{LAYER}.weight_scale is missing" in res.output
    _no_leftovers(tmp_path)


def test_manifest_static_scale_without_tensor(fp8_static, tmp_path):
    from fp8export import api

    bad = _copy(fp8_static, tmp_path / "fp8")
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors[f"{LAYER}.input_scale"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(Fp8ExportError, match=f"layer {LAYER}: {LAYER}.input_scale is missing"):
        api.export_onnx(ExportOnnxConfig(fp8_dir=bad, output=tmp_path / "m.onnx"))
    _no_leftovers(tmp_path)


def test_non_positive_scale(fp8_static, tmp_path):
    from fp8export import api

    bad = _copy(fp8_static, tmp_path / "fp8")
    tensors = load_file(str(bad / "model.safetensors"))
    tensors[f"{LAYER}.weight_scale"].zero_()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(Fp8ExportError, match="positive finite"):
        api.export_onnx(ExportOnnxConfig(fp8_dir=bad, output=tmp_path / "m.onnx"))


def test_unknown_architecture(run_cli, fp8_static, tmp_path):
    bad = _copy(fp8_static, tmp_path / "fp8")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "no-such-arch"
    (bad / "config.json").write_text(json.dumps(cfg))
    res = run_cli("export-onnx", bad, "-o", tmp_path / "m.onnx")
    assert res.exit_code == 1 and "no-such-arch" in res.output
    _no_leftovers(tmp_path)


def test_bad_options(run_cli, fp8_static, tmp_path):
    res = run_cli("export-onnx", fp8_static, "-o", tmp_path / "m.onnx", "--opset", "19")
    assert res.exit_code == 2 and "--opset 19" in res.output and "--opset 21" in res.output
    res = run_cli("export-onnx", fp8_static, "-o", tmp_path / "m.onnx", "--dtype", "int8")
    assert res.exit_code == 2
    res = run_cli("export-onnx", fp8_static, "-o", tmp_path / "m.txt")
    assert res.exit_code == 1 and ".onnx" in res.output
    res = run_cli("export-onnx", tmp_path / "nope", "-o", tmp_path / "m.onnx")
    assert res.exit_code == 1 and "not a folder" in res.output
    _no_leftovers(tmp_path)


def test_failed_check_leaves_nothing(tmp_path):
    import torch
    from onnx_graphs import single_linear_model

    from fp8export.fp8dir.reader import QuantLayer
    from fp8export.numerics.fp8 import quantize_e4m3

    w = torch.ones(4, 4)
    model = single_linear_model(QuantLayer("lin", quantize_e4m3(w, 0.01), "out_in", 0.01, 0.1))
    out = tmp_path / "m.onnx"

    def refuse(path):
        assert path.is_file() and path.parent != tmp_path  # checked before it is published
        raise Fp8ExportError("refused")

    with pytest.raises(Fp8ExportError, match="refused"):
        write_model(model, out, force=False, check_fn=refuse)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(Fp8ExportError, match="refused"):  # nor the folders made to hold it
        write_model(model, tmp_path / "new" / "deeper" / "m.onnx", force=False, check_fn=refuse)
    assert list(tmp_path.iterdir()) == []
    write_model(model, out, force=False, check_fn=lambda p: onnx.checker.check_model(str(p)))
    assert out.is_file() and [p.name for p in tmp_path.iterdir()] == ["m.onnx"]
    with pytest.raises(Fp8ExportError, match="--force"):
        write_model(model, out, force=False)


def test_external_data_above_threshold(tmp_path, monkeypatch):
    """Models over the protobuf limit are written with external data (threshold lowered)."""
    import torch
    from onnx_graphs import single_linear_model

    import fp8export.onnx.export as export
    from fp8export.fp8dir.reader import QuantLayer
    from fp8export.numerics.fp8 import quantize_e4m3
    from fp8export.onnx.check import check_model

    w = torch.randn(256, 128)
    model = single_linear_model(QuantLayer("lin", quantize_e4m3(w, 0.01), "out_in", 0.01, 0.1))
    monkeypatch.setattr(export, "EXTERNAL_DATA_BYTES", 1000)
    out, data = write_model(model, tmp_path / "m.onnx", force=False)
    assert data == tmp_path / "m.onnx.data" and data.stat().st_size >= 256 * 128
    assert out.stat().st_size < 4096
    onnx.checker.check_model(str(out), full_check=True)
    assert check_model(out).ok
