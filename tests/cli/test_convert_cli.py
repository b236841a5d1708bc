"""``fp8export convert`` through the real CLI: summary text, exit codes, nothing left on failure."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from fp8export.checkpoint import source as _source

_source._load_builtin_readers()  # see tests/checkpoint/conftest.py


def _ckpt(tmp_path, tensors=None):
    d = tmp_path / "ckpt"
    d.mkdir()
    torch.manual_seed(0)
    tensors = tensors or {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, dtype=torch.bfloat16),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 8, dtype=torch.bfloat16),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(4, 8, dtype=torch.bfloat16),
        "model.embed_tokens.weight": torch.randn(16, 8, dtype=torch.bfloat16),
        "model.norm.weight": torch.ones(8, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(16, 8, dtype=torch.bfloat16)}
    save_file(tensors, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return d


def test_convert_ok_summary(tmp_path, run_cli):
    ckpt = _ckpt(tmp_path)
    result = run_cli("convert", ckpt)
    assert result.exit_code == 0, result.output
    out = result.output
    assert (f"wrote {tmp_path / 'ckpt-fp8'}  [compressed-tensors: loads in vllm and transformers "
            "(with compressed-tensors)]") in out
    assert "quantized: 3 linear layer(s) to FP8 E4M3" in out
    assert "weights only: activations are dynamic (no training history or calibration data)" \
        in out
    assert "output head (kept in high precision by default): lm_head.weight" in out
    assert "PASSED | convert" in out
    assert (tmp_path / "ckpt-fp8" / "fp8export.json").is_file()


def test_existing_output_exit_1_untouched_and_force_replaces_only_ours(tmp_path, run_cli):
    ckpt = _ckpt(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("mine")
    result = run_cli("convert", ckpt, "-o", out)
    assert result.exit_code == 1
    assert "already exists. Pass --force" in result.output and "FAILED | convert" in result.output
    assert [p.name for p in out.iterdir()] == ["x"]
    # --force replaces only a folder fp8export wrote: "x" is someone else's file
    result = run_cli("convert", ckpt, "-o", out, "--force", "--format", "vllm")
    assert result.exit_code == 1
    assert "holds files fp8export did not write (x)" in result.output
    assert [p.name for p in out.iterdir()] == ["x"]
    (out / "x").unlink()
    assert run_cli("convert", ckpt, "-o", out, "--force").exit_code == 0  # an empty folder
    result = run_cli("convert", ckpt, "-o", out, "--force", "--format", "vllm")
    assert result.exit_code == 0, result.output  # and an earlier output, with --force
    assert '"quant_method": "fp8"' in (out / "config.json").read_text()


def test_nan_and_integer_weights_exit_1_one_message_nothing_left(tmp_path, run_cli):
    w = torch.randn(8, 8, dtype=torch.bfloat16)
    w[0, 0] = float("nan")
    ckpt = _ckpt(tmp_path, {"model.layers.0.mlp.down_proj.weight": w})
    result = run_cli("convert", ckpt)
    assert result.exit_code == 1
    assert result.output.count("Error:") == 1 and "Traceback" not in result.output
    assert "model.layers.0.mlp.down_proj.weight" in result.output and "NaN" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]

    ints = tmp_path / "ints"
    ints.mkdir()
    save_file({"model.layers.0.mlp.up_proj.weight": torch.ones(4, 4, dtype=torch.int32)},
              ints / "model.safetensors")
    (ints / "config.json").write_text('{"model_type": "llama"}')
    result = run_cli("convert", ints)
    assert result.exit_code == 1
    assert "model.layers.0.mlp.up_proj.weight" in result.output and "I32" in result.output
    assert not (tmp_path / "ints-fp8").exists()


def test_usage_errors_exit_2_and_missing_checkpoint_exit_1(tmp_path, run_cli):
    assert run_cli("convert", tmp_path, "--format", "onnx").exit_code == 2
    assert run_cli("convert", tmp_path, "--margin", "-1").exit_code == 2
    result = run_cli("convert", tmp_path / "nope")
    assert result.exit_code == 1 and "no such file or folder" in result.output
    result = run_cli("convert", tmp_path, "--scales", "calibrate")
    assert result.exit_code == 2 and "--calib-data" in result.output


def test_exclude_and_no_fuse_flags(tmp_path, run_cli):
    ckpt = _ckpt(tmp_path)
    result = run_cli("convert", ckpt, "--exclude", "*.v_proj", "--no-fuse-scales")
    assert result.exit_code == 0, result.output
    assert "quantized: 2 linear layer(s)" in result.output
    assert "excluded by --exclude '*.v_proj'" in result.output
    man = json.loads((tmp_path / "ckpt-fp8" / "fp8export.json").read_text())
    assert man["options"]["fuse_scales"] is False and man["options"]["exclude"] == ["*.v_proj"]


def test_converting_an_fp8_folder_again_is_one_short_error(tmp_path, run_cli):
    first = run_cli("convert", _ckpt(tmp_path), "-o", tmp_path / "fp8")
    assert first.exit_code == 0, first.output
    again = run_cli("convert", tmp_path / "fp8", "-o", tmp_path / "again")
    assert again.exit_code == 1, again.output
    errors = [line for line in again.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and len(errors[0]) < 400, errors
    assert "already quantized to FP8" in errors[0] and "fp8export verify" in errors[0]
    assert errors[0].count("already F8_E4M3") == 1 and "--exclude" not in errors[0]
    assert not (tmp_path / "again").exists()


def _notes(run, out):
    return [ln for ln in run.stdout.splitlines() if ln.startswith("note:")] + [
        ln for ln in run.stderr.splitlines() if ln.startswith("note:")]


def test_advice_for_tensorrt_fits_what_was_given(tmp_path, run_cli, markov_llama):
    """Block weights: --calib-data is unused, so the way to static scales is another
    granularity; a GPTQ run that gave --calib-data only needs --scales calibrate."""
    import numpy as np
    from fp8_folders import markov_tokens

    calib = tmp_path / "calib.npz"
    np.savez(calib, input_ids=markov_tokens(256, 8, 32, seed=5).numpy())
    block = run_cli("convert", markov_llama, "-o", tmp_path / "block", "--weight-granularity",
                    "block", "--block-size", "32", "--calib-data", calib)
    assert block.exit_code == 0, block.output
    text = " ".join(_notes(block, tmp_path / "block"))
    assert "--calib-data is not used" in text
    assert "convert with --calib-data FILE" not in text
    assert "--weight-granularity tensor --scales calibrate" in text
    gptq = run_cli("convert", markov_llama, "-o", tmp_path / "gptq", "--scales", "weights",
                   "--weight-rounding", "gptq", "--calib-data", calib)
    assert gptq.exit_code == 0, gptq.output
    text = " ".join(_notes(gptq, tmp_path / "gptq"))
    assert "convert with --calib-data FILE" not in text
    assert "for TensorRT convert with --scales calibrate" in text and "calib.npz" in text
