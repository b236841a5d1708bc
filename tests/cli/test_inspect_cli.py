"""``fp8export inspect`` through the real CLI: table, --json, --plot, FP8 folder, ONNX verdict."""

from __future__ import annotations

import json
import sys
import types

import torch
from safetensors.torch import save_file

from fp8export.checkpoint import source as _source

# Stopgap: open_checkpoint loads the built-in readers only while its registry is empty, so a
# reader registered earlier (importing the Transformer Engine reader does) hides them. Loading
# them here keeps these tests independent of collection order until source.py uses a flag.
_source._load_builtin_readers()



def _ckpt(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    torch.manual_seed(0)
    save_file({"model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, dtype=torch.bfloat16),
               "model.norm.weight": torch.ones(4, dtype=torch.bfloat16)}, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return d


def test_table(tmp_path, run_cli):
    result = run_cli("inspect", _ckpt(tmp_path))
    assert result.exit_code == 0, result.output
    out = result.output
    header = next(line for line in out.splitlines() if line.startswith("name"))
    for col in ("dtype", "shape", "amax", "scale", "SQNR dB"):
        assert col in header
    row = next(line for line in out.splitlines() if line.startswith("model.layers.0.mlp.up_proj"))
    assert "BF16" in row and "[8, 4]" in row
    assert "Summary" in out and "would be quantized" in out


def test_json(tmp_path, run_cli):
    result = run_cli("inspect", _ckpt(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # stage and PASSED lines go to stderr
    assert data["kind"] == "checkpoint"
    by = {t["name"]: t for t in data["tensors"]}
    row = by["model.layers.0.mlp.up_proj.weight"]
    assert row["shape"] == [8, 4] and row["scale"] > 0 and row["sqnr_db"] > 20
    assert data["summary"]["tensors"] == 2


def test_plot(tmp_path, run_cli):
    png = tmp_path / "p.png"
    result = run_cli("inspect", _ckpt(tmp_path), "--plot", png)
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1024


def test_a_plot_format_it_cannot_write_is_a_usage_error(tmp_path, run_cli):
    ckpt = _ckpt(tmp_path)
    for name in ("x.pdf", "x"):
        result = run_cli("inspect", ckpt, "--plot", tmp_path / name)
        assert result.exit_code == 2, result.output
        assert "--plot writes .svg or .png" in result.stderr
        assert "Try 'fp8export inspect --help'" in result.stderr
    assert not (tmp_path / "x.pdf").exists()


def test_fp8_folder(tmp_path, run_cli):
    # the layout of docs/fp8-folder.md, written by hand
    d = tmp_path / "fp8"
    d.mkdir()
    w = torch.randn(8, 4) * 0.1
    scale = float(w.abs().max()) / 448
    q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    save_file({"model.layers.0.mlp.up_proj.weight": q,
               "model.layers.0.mlp.up_proj.weight_scale": torch.tensor([scale]),
               "model.layers.0.mlp.up_proj.input_scale": torch.tensor([0.01])},
              d / "model.safetensors")
    (d / "fp8export.json").write_text(json.dumps({"format_version": 1, "quantized": {
        "model.layers.0.mlp.up_proj": {"weight_scale": scale, "weight_scale_source": "weights",
                                       "weight_sqnr_db": 30.25, "input_scale": 0.01,
                                       "input_scale_source": "calibration"}}}))
    result = run_cli("inspect", d)
    assert result.exit_code == 0, result.output
    assert "FP8 folder" in result.output and "F8_E4M3" in result.output
    assert "weights/calibration" in result.output and "30.2" in result.output


def test_failing_onnx_check_exits_1(tmp_path, run_cli, monkeypatch):
    class Report:
        ok = False

        def to_text(self):
            return "MatMul /fc: input 1 is not fed by DequantizeLinear"

    monkeypatch.setitem(sys.modules, "fp8export.onnx.check",
                        types.SimpleNamespace(check_model=lambda p: Report()))
    (tmp_path / "m.onnx").write_bytes(b"\x08\x07")
    result = run_cli("inspect", tmp_path / "m.onnx")
    assert result.exit_code == 1
    assert "not fed by DequantizeLinear" in result.output and "Error:" in result.output
    assert "Traceback" not in result.output
