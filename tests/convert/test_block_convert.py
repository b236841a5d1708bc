"""convert --weight-granularity block, end to end on a tiny real Llama whose MLP width (320) is
not a multiple of the 128x128 block: what is written in both dialects, what the one reader makes
of it, what is refused, and that reruns are byte-identical."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fp8export.convert.config import ConvertConfig
from fp8export.convert.pipeline import convert
from fp8export.errors import Fp8ExportError, UsageError
from fp8export.fp8dir.reader import read_fp8_folder
from fp8export.numerics.block import block_amax, quantize_blocks_sqnr
from fp8export.numerics.fp8 import amax_to_scales


@pytest.fixture(scope="module")
def ragged_llama(tmp_path_factory):
    """hidden 256, MLP 320 (= 2.5 blocks), k/v 128: ragged gate/up rows and down_proj columns."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=320, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    path = tmp_path_factory.mktemp("ragged") / "src"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def block_folders(ragged_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("block-out")
    out = {}
    for fmt in ("compressed-tensors", "vllm"):
        out[fmt] = (convert(ConvertConfig(checkpoint=ragged_llama, output=root / fmt,
                                          weight_granularity="block", format=fmt)), root / fmt)
    return out


def _tensors(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()))
                for k in f.keys()}


@pytest.mark.parametrize("fmt,scale_name", [("compressed-tensors", "weight_scale"),
                                            ("vllm", "weight_scale_inv")])
def test_tensors_are_the_block_grids_of_the_source(block_folders, ragged_llama, fmt, scale_name):
    result, folder = block_folders[fmt]
    src = load_file(str(ragged_llama / "model.safetensors"))
    names = _tensors(folder)
    assert result.quantized == 14 and result.activation_scheme == "dynamic"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name, grid in (("model.layers.0.mlp.gate_proj", (3, 2)),  # 320 rows: 2.5 blocks
                           ("model.layers.0.mlp.down_proj", (2, 3)),  # 320 columns
                           ("model.layers.1.self_attn.k_proj", (1, 2))):
            assert names[f"{name}.weight"][0] == "F8_E4M3"
            assert names[f"{name}.{scale_name}"] == ("F32", grid)
            assert f"{name}.input_scale" not in names and f"{name}.weight_scale" not in names \
                or scale_name == "weight_scale"
            w = src[f"{name}.weight"]
            want_s = amax_to_scales(block_amax(w, (128, 128)), name)
            if fmt == "compressed-tensors":  # held in the model's BF16 by transformers
                want_s = want_s.astype(ml_dtypes.bfloat16).astype(np.float32)
            want_q, _ = quantize_blocks_sqnr(w, want_s, (128, 128))
            assert np.array_equal(f.get_tensor(f"{name}.{scale_name}").numpy(), want_s)
            assert torch.equal(f.get_tensor(f"{name}.weight").view(torch.uint8),
                               want_q.view(torch.uint8))
    # everything else copied unchanged
    assert names["lm_head.weight"] == ("BF16", (512, 256))


def test_compressed_tensors_config_is_fp8_block_and_validates(block_folders):
    _, folder = block_folders["compressed-tensors"]
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert group["weights"] == {"num_bits": 8, "type": "float", "strategy": "block",
                                "block_structure": [128, 128], "symmetric": True,
                                "dynamic": False}
    assert group["input_activations"] == {"num_bits": 8, "type": "float", "strategy": "group",
                                          "group_size": 128, "symmetric": True, "dynamic": True}
    ct = pytest.importorskip("compressed_tensors.quantization")
    parsed = ct.QuantizationConfig.model_validate(qc)
    args = parsed.config_groups["group_0"]
    assert args.weights.strategy == "block" and args.weights.block_structure == [128, 128]
    assert args.input_activations.strategy == "group"
    assert args.input_activations.group_size == 128 and args.input_activations.dynamic is True


def test_vllm_dialect_is_the_fine_grained_format(block_folders):
    result, folder = block_folders["vllm"]
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128],
                  "ignored_layers": ["lm_head", "model.embed_tokens"]}
    # the dialect is what all three read; these ragged blocks none does (vLLM: gate/up rows
    # not whole blocks; transformers: partial edge blocks), and the label says so
    assert result.loaded_by == []
    assert not any("vLLM only" in n for n in result.notes)  # transformers reads the dialect
    from transformers.utils.quantization_config import FineGrainedFP8Config

    parsed = FineGrainedFP8Config.from_dict(dict(qc))
    assert list(parsed.weight_block_size) == [128, 128] and parsed.activation_scheme == "dynamic"
    assert parsed.modules_to_not_convert == ["lm_head", "model.embed_tokens"]


@pytest.mark.parametrize("fmt", ["compressed-tensors", "vllm"])
def test_manifest_and_the_reader_agree(block_folders, fmt):
    result, folder = block_folders[fmt]
    man = json.loads((folder / "fp8export.json").read_text())
    assert man["weight_granularity"] == "block" and man["block_size"] == [128, 128]
    assert man["dynamic_activations"] == "group" and man["activation_scheme"] == "dynamic"
    assert man["loaded_by"] == result.loaded_by
    entry = man["quantized"]["model.layers.0.mlp.gate_proj"]
    assert 0 < entry["weight_scale_min"] <= entry["weight_scale"] and entry["weight_sqnr_db"] > 28
    with read_fp8_folder(folder) as f:
        assert f.format.granularity == "block" and f.format.block_size == (128, 128)
        assert f.format.dynamic == "group" and f.format.group_size == 128 and f.format.ours
        layer = f.layers["model.layers.0.mlp.down_proj"]
        assert layer.granularity == "block" and layer.block == (128, 128)
        assert tuple(layer.weight_scale.shape) == (2, 3) and layer.dynamic == "group"
        assert layer.dequantized().shape == (256, 320)
    notes = " ".join(result.notes)
    assert "not a multiple of the 128x128 block" in notes and "mlp.down_proj" in notes
    assert "validate_fp8_block_shape" in notes and "mlp.gate_proj" in notes


def test_reruns_are_byte_identical(ragged_llama, block_folders, tmp_path):
    _, first = block_folders["vllm"]
    again = tmp_path / "again"
    convert(ConvertConfig(checkpoint=ragged_llama, output=again, weight_granularity="block",
                          format="vllm"))
    for p in sorted(first.iterdir()):
        assert (again / p.name).read_bytes() == p.read_bytes(), p.name


def test_block_size_option(ragged_llama, tmp_path):
    out = tmp_path / "b"
    convert(ConvertConfig(checkpoint=ragged_llama, output=out, weight_granularity="block",
                          block_size="64x32"))
    names = _tensors(out)
    assert names["model.layers.0.mlp.gate_proj.weight_scale"] == ("F32", (5, 8))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["block_structure"] == [64, 32]
    assert group["input_activations"]["group_size"] == 32


@pytest.mark.parametrize("options,match", [
    ({"format": "modelopt"}, "--format modelopt cannot hold block weight scales"),
    ({"scales": "calibrate", "calib_data": "x.txt"}, "static input scales cannot be used"),
    ({"dynamic_activations": "token"}, "drop --dynamic-activations token"),
    ({"weight_scales_from_history": True}, "--weight-scales-from-history"),
])
def test_refusals(ragged_llama, tmp_path, options, match):
    with pytest.raises(Fp8ExportError, match=match):
        convert(ConvertConfig(checkpoint=ragged_llama, output=tmp_path / "o",
                              weight_granularity="block", **options))
    assert not (tmp_path / "o").exists()


def test_option_pairs_that_need_block(ragged_llama, tmp_path):
    with pytest.raises(UsageError, match="--block-size sets the blocks"):
        ConvertConfig(checkpoint=ragged_llama, block_size="64")
    with pytest.raises(UsageError, match="--dynamic-activations group goes with"):
        ConvertConfig(checkpoint=ragged_llama, dynamic_activations="group")
    with pytest.raises(UsageError, match="--block-size: block size 'x'"):
        ConvertConfig(checkpoint=ragged_llama, weight_granularity="block", block_size="x")


def test_gpt2_conv1d_weights_are_refused(tiny_gpt2, tmp_path):
    with pytest.raises(Fp8ExportError, match=r"stored \[in, out\] \(GPT-2 Conv1D\)"):
        convert(ConvertConfig(checkpoint=tiny_gpt2, output=tmp_path / "o",
                              weight_granularity="block"))


def test_cli_prints_the_activations(ragged_llama, tmp_path, run_cli):
    r = run_cli("convert", ragged_llama, "-o", tmp_path / "o", "--weight-granularity", "block",
                "--block-size", "128x128", "--format", "vllm")
    assert r.exit_code == 0, r.output
    assert "[vllm: no engine loads it as written]" in r.stdout  # 320 = 2.5 blocks of 128
    assert "activations: dynamic per token group of 128" in r.stdout
    r = run_cli("convert", ragged_llama, "-o", tmp_path / "w", "--weight-granularity", "block",
                "--block-size", "64x64", "--format", "vllm")  # whole blocks everywhere
    assert "[vllm: loads in vllm and sglang and transformers (FineGrainedFP8)]" in r.stdout
    r = run_cli("convert", ragged_llama, "-o", tmp_path / "p", "--block-size", "64")
    assert r.exit_code == 2 and "--weight-granularity block" in r.output


def test_an_fp8_kv_cache_goes_with_block_weights(tmp_path):
    """--kv-cache fp8 calibrates keys and values; the linears stay dynamic per token group."""
    from pathlib import Path

    sample = Path(__file__).resolve().parents[2] / "samples" / "tiny-llama"
    out = tmp_path / "kv"
    result = convert(ConvertConfig(checkpoint=sample / "model", output=out,
                                   weight_granularity="block", kv_cache="fp8",
                                   calib_data=sample / "data" / "calib.txt", calib_samples=8,
                                   seq_len=32))
    assert result.activation_scheme == "dynamic" and not any(
        "--calib-data is not used" in n for n in result.notes)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == "tensor"
    assert qc["config_groups"]["group_0"]["input_activations"]["strategy"] == "group"
    from fp8export.runtime.fp8_model import load_fp8_model

    info = load_fp8_model(out, dtype=torch.float32, mode="emulate")[3]
    assert info["kv_cache"].startswith("fp8") and info["weight_granularity"] == "block"
