"""The one reader on FP8 folders fp8export did not write, made here by writers that follow each
format's own description (reference/fp8_checkpoint_formats.md), independently of fp8export's
writer: ModelOpt (hf_quant_config.json, 0-dim scales, static inputs, KV scales on k_proj/v_proj),
AutoFP8 (quant_method fp8, static), the fine-grained DeepSeek-V3 format (weight_scale_inv grids,
dynamic per-token-group inputs) and compressed-tensors with a KV-cache scheme; then what the
reader refuses: edits that break what the config promises, and formats it does not read.
(llm-compressor's own folders: tests/peers/test_llmcompressor_peer_block.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from foreign_folders import (
    autofp8_folder,
    ct_folder,
    deepseek_folder,
    edit,
    is_linear,
    modelopt_folder,
    transformers_fp8_folder,
    write,
)
from safetensors.torch import load_file

from fp8export.errors import Fp8ExportError
from fp8export.fp8dir.reader import fp8_folder_kind, read_fp8_folder
from fp8export.numerics.metrics import rel_l2
from fp8export.runtime.fp8_model import fp8_modules, load_fp8_model


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    path = tmp_path_factory.mktemp("foreign") / "src"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def _logits_close_to_bf16(folder: Path, src: Path, bound: float):
    from transformers import AutoModelForCausalLM

    model = load_fp8_model(folder, dtype=torch.float32, mode="emulate")[0]
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert rel_l2(ref(input_ids=ids).logits, model(input_ids=ids).logits) <= bound
    return model


@pytest.mark.parametrize("in_config", [False, True])
def test_modelopt_folder(src, tmp_path, in_config):
    folder = modelopt_folder(src, tmp_path / "mo", in_config)
    assert fp8_folder_kind(folder) == "foreign"
    with read_fp8_folder(folder) as f:
        fmt = f.format
        assert (fmt.dialect if in_config else "modelopt") == "modelopt"
        assert fmt.producer == ("modelopt" if in_config else "modelopt 0.47.0")
        assert (fmt.granularity, fmt.activations, fmt.ours) == ("tensor", "static", False)
        layer = f.layers["model.layers.0.self_attn.q_proj"]
        assert layer.input_scale == pytest.approx(4.0 / 448) and layer.granularity == "tensor"
        kv = f.manifest["kv_cache"]["layers"]["model.layers.0.self_attn"]
        assert kv == {"k_scale_tensor": "model.layers.0.self_attn.k_proj.k_scale",
                      "v_scale_tensor": "model.layers.0.self_attn.v_proj.v_scale"}
    model = _logits_close_to_bf16(folder, src, 0.2)  # FP8 KV cache at fixed amax 2 and 3
    assert len(fp8_modules(model)) == 14


def test_fine_grained_deepseek_folder(src, tmp_path):
    folder = deepseek_folder(src, tmp_path / "ds")
    with read_fp8_folder(folder) as f:
        fmt = f.format
        assert fmt.producer == "quant_method fp8, fine-grained (DeepSeek-V3 style)"
        assert (fmt.dialect, fmt.granularity, fmt.block_size) == ("vllm", "block", (32, 32))
        assert (fmt.activations, fmt.dynamic, fmt.group_size) == ("dynamic", "group", 32)
        entry = f.manifest["quantized"]["model.layers.1.mlp.down_proj"]
        assert entry["weight_scale_tensor"].endswith(".weight_scale_inv")
        layer = f.layers["model.layers.1.mlp.down_proj"]  # in = 96 = 3 blocks
        assert tuple(layer.weight_scale.shape) == (2, 3) and layer.block == (32, 32)
        raw = load_file(str(src / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
        assert rel_l2(raw.float(), layer.dequantized()) < 0.05
    model = _logits_close_to_bf16(folder, src, 0.1)
    layer = fp8_modules(model)["model.layers.0.mlp.gate_proj"]
    assert layer.block == (32, 32) and layer.dynamic == "group" and layer.group_size == 32


@pytest.mark.parametrize("writer", ["fine-grained", "compressed-tensors"])
def test_non_square_blocks_keep_their_axes(src, tmp_path, writer):
    """16 rows x 32 columns: the first number of weight_block_size / block_structure blocks the
    output rows, the second the input columns and the input groups. Every layer's dequantized
    weight is its codes times its own tile's scale, expanded here without fp8export code."""
    bn, bk = 16, 32
    folder = (deepseek_folder(src, tmp_path / "f", block=(bn, bk)) if writer == "fine-grained"
              else ct_folder(src, tmp_path / "f", strategy="block", block=(bn, bk),
                             static=False))
    stored = load_file(str(folder / "model.safetensors"))
    suffix = "weight_scale_inv" if writer == "fine-grained" else "weight_scale"
    with read_fp8_folder(folder) as f:
        assert f.format.block_size == (bn, bk) and f.format.group_size == bk
        for name, layer in f.layers.items():
            q, s = stored[f"{name}.weight"], stored[f"{name}.{suffix}"].float()
            out, inp = q.shape
            assert layer.block == (bn, bk)
            assert tuple(layer.weight_scale.shape) == (-(-out // bn), -(-inp // bk)), name
            full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:out, :inp]
            assert torch.equal(layer.dequantized(), q.float() * full), name
    model = _logits_close_to_bf16(folder, src, 0.1)
    layer = fp8_modules(model)["model.layers.1.mlp.down_proj"]  # 64 x 96: 4 x 3 blocks
    assert layer.block == (bn, bk) and layer.group_size == bk


def test_autofp8_static_folder(src, tmp_path):
    folder = autofp8_folder(src, tmp_path / "af")
    with read_fp8_folder(folder) as f:
        assert f.format.producer == "quant_method fp8 (AutoFP8 / vLLM)"
        assert (f.format.granularity, f.format.activations) == ("tensor", "static")
        # q/k/v and gate/up with their own weight scales: what vLLM does with them is said
        assert any("4 fused group(s)" in n and "vLLM re-quantizes" in n
                   for n in f.manifest["notes"])
    _logits_close_to_bf16(folder, src, 0.1)


def test_compressed_tensors_with_a_kv_cache_scheme_and_weight_only_layers(src, tmp_path):
    """A hand-written compressed-tensors folder: per-channel static weights with per-token
    dynamic inputs for attention, weight-only FP8 (no input quantization) for the MLP."""
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not is_linear(name):
            tensors[name] = t
            continue
        s = t.float().abs().amax(dim=1, keepdim=True) / 448
        tensors[name] = (t.float() / s).to(torch.float8_e4m3fn)
        tensors[name[: -len(".weight")] + ".weight_scale"] = s.to(torch.bfloat16)
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([2.0 / 448])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([3.0 / 448])
    w = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
         "dynamic": False}
    attn = [f"model.layers.{i}.self_attn.{p}" for i in range(2)
            for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    mlp = [f"model.layers.{i}.mlp.{p}" for i in range(2)
           for p in ("gate_proj", "up_proj", "down_proj")]
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "version": "0.9.9",
          "config_groups": {
              "group_0": {"targets": attn, "weights": w, "input_activations": {
                  "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}},
              "group_1": {"targets": mlp, "weights": w, "input_activations": None}},
          "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                              "dynamic": False}, "ignore": ["lm_head"]}
    folder = write(src, tmp_path / "ct", tensors, qc)
    with read_fp8_folder(folder) as f:
        assert f.format.producer == "compressed-tensors 0.9.9"
        assert f.format.granularity == "channel" and f.format.dynamic == "mixed"
        assert f.layers["model.layers.0.self_attn.q_proj"].dynamic == "token"
        assert f.layers["model.layers.0.mlp.up_proj"].dynamic == "none"
        assert len(f.manifest["kv_cache"]["layers"]) == 2
    model = _logits_close_to_bf16(folder, src, 0.2)
    up = fp8_modules(model)["model.layers.1.mlp.up_proj"]
    x = torch.randn(3, 64)
    assert torch.equal(up(x), (x @ (up.weight.float() * up.weight_scale[:, None]).t()))


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("change,match", [
    (lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight_scale_inv", torch.ones(2, 2)),
     r"down_proj.weight_scale_inv has shape \[2, 2\], but the vllm config declares block "
     r"weight scales .* allocate as the \[2, 3\] grid of 32x32 blocks"),
    (lambda t: t["model.layers.0.mlp.down_proj.weight_scale_inv"].__setitem__((0, 0), -1.0),
     "down_proj.weight_scale_inv holds a scale that is not a positive finite number"),
    (lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight_scale", torch.ones(())),
     r"up_proj.weight_scale is stored but vllm and sglang and transformers \(FineGrainedFP8\) "
     r"do not read it \(they read model.layers.0.mlp.up_proj.weight_scale_inv\)"),
    (lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight",
                             t["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e5m2)),
     "up_proj.weight is F8_E5M2"),
    (lambda t: t.__setitem__("model.layers.0.mlp.experts",
                             torch.zeros(2, 4, 4, dtype=torch.float8_e4m3fn)),
     r"model.layers.0.mlp.experts is F8_E4M3 \[2, 4, 4\]"),
    (lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight_scale_inv",
                             torch.full((2, 3), 3, dtype=torch.uint8)),
     r"down_proj.weight_scale_inv is U8; engines read a scale as a float"),
    (lambda t: t.__setitem__("model.layers.0.mlp.up_proj.input_scale", torch.ones(())),
     r"up_proj.input_scale is stored but .* do not read it \(the config declares dynamic "
     r"inputs\)"),
])
def test_edits_that_break_the_format_are_refused(src, tmp_path, change, match):
    folder = edit(deepseek_folder(src, tmp_path / "ds"), change)
    with pytest.raises(Fp8ExportError, match=match):
        read_fp8_folder(folder)


def test_static_without_input_scales_and_undecidable_groups(src, tmp_path):
    folder = edit(autofp8_folder(src, tmp_path / "af"),
                   lambda t: t.pop("model.layers.1.self_attn.o_proj.input_scale"))
    with pytest.raises(Fp8ExportError, match="o_proj has no input_scale, but the vllm config "
                                             "declares static activations"):
        read_fp8_folder(folder)
    # compressed-tensors groups targeted by regular expressions: matched from the start as
    # compressed-tensors matches them, each layer read with its own group's inputs
    ds = edit(deepseek_folder(src, tmp_path / "ds"), lambda t: t.update(
        {k.replace("_inv", ""): t.pop(k) for k in list(t) if k.endswith("weight_scale_inv")}))
    w = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [32, 32]}
    inputs = {"num_bits": 8, "type": "float", "dynamic": True}
    cfg = json.loads((ds / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "config_groups": {
            "a": {"targets": ["re:.*self_attn.*"], "weights": w,
                  "input_activations": {**inputs, "strategy": "token"}},
            "b": {"targets": ["re:.*mlp.*"], "weights": w,
                  "input_activations": {**inputs, "strategy": "group", "group_size": 32}}}}
    (ds / "config.json").write_text(json.dumps(cfg))
    with read_fp8_folder(ds) as f:
        assert f.layers["model.layers.0.self_attn.q_proj"].dynamic == "token"
        assert f.layers["model.layers.0.mlp.up_proj"].dynamic == "group"
    # two groups matching one layer equally specifically with different schemes: undefined
    cfg["quantization_config"]["config_groups"]["b"]["targets"] = ["re:.*layers.*"]
    (ds / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Fp8ExportError, match=r"config groups \['a', 'b'\] target it equally"):
        read_fp8_folder(ds)


def test_formats_it_does_not_read(src, tmp_path):
    folder = deepseek_folder(src, tmp_path / "int4")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert fp8_folder_kind(folder) is None
    from fp8export.verify.candidates import candidate_kind

    with pytest.raises(Fp8ExportError, match="is not FP8 in a dialect fp8export reads"):
        candidate_kind(folder)
    mo = modelopt_folder(src, tmp_path / "nvfp4")
    hf = json.loads((mo / "hf_quant_config.json").read_text())
    hf["quantization"]["quant_algo"] = "NVFP4"
    (mo / "hf_quant_config.json").write_text(json.dumps(hf))
    assert fp8_folder_kind(mo) is None


def test_the_modelopt_file_is_read_through_the_guarded_opener(src, tmp_path):
    mo = modelopt_folder(src, tmp_path / "mo")
    outside = tmp_path / "elsewhere.json"
    shutil.move(mo / "hf_quant_config.json", outside)
    (mo / "hf_quant_config.json").symlink_to(outside)
    with pytest.raises(Fp8ExportError, match="hf_quant_config.json"):
        read_fp8_folder(mo)


def test_a_foreign_folder_is_never_a_reference(src, tmp_path, run_cli):
    folder = deepseek_folder(src, tmp_path / "ds")
    r = run_cli("verify", folder, src)
    assert r.exit_code == 1 and "the reference is an FP8 folder" in r.stderr
    r = run_cli("inspect", folder)
    assert r.exit_code == 0
    assert "written by    quant_method fp8, fine-grained (DeepSeek-V3 style)" in r.stdout
    assert "weights       block scales, 32x32 blocks" in r.stdout
    assert "activations   dynamic per token group of 32" in r.stdout
    assert "loads in vllm and sglang and transformers (FineGrainedFP8)" in r.stdout


SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "tiny-llama"


def test_verify_runs_a_fine_grained_folder_written_elsewhere(tmp_path, run_cli):
    folder = deepseek_folder(SAMPLE / "model", tmp_path / "ds", block=(16, 16))
    r = run_cli("verify", SAMPLE / "model", folder, "--data", SAMPLE / "data" / "eval.txt",
                "--samples", "8", "--report-dir", tmp_path / "rep")
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["metrics"]["top1_agreement"] > 0.97 and rep["metrics"]["kl_mean"] < 1e-3
    assert any("block 16x16 weights, dynamic per-token-group(16)" in n for n in rep["notes"])


_TRANSFORMERS_WEIGHTS = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
torch.save({n: p.detach() for n, p in model.named_parameters() if n.endswith("proj.weight")},
           sys.argv[2])
"""


@pytest.mark.slow
@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_transformers_own_quantizer_folders_dequantize_as_transformers_does(src, tmp_path,
                                                                           scale_fmt):
    """Folders written by transformers' own FineGrainedFP8 quantize op, F32 and UE8M0 (F8_E8M0
    power-of-two) scales: the reader's dequantized weights are the ones transformers'
    default from_pretrained builds from them, bit for bit in BF16."""
    import subprocess
    import sys

    folder = transformers_fp8_folder(src, tmp_path / scale_fmt, block=(32, 32),
                                     scale_fmt=scale_fmt)
    theirs = tmp_path / "theirs.pt"
    run = subprocess.run([sys.executable, "-c", _TRANSFORMERS_WEIGHTS, str(folder), str(theirs)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    weights = torch.load(theirs, weights_only=True)
    with read_fp8_folder(folder) as f:
        assert f.format.block_size == (32, 32) and len(f.layers) == 14
        if scale_fmt == "ue8m0":
            scale = f.tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]
            assert scale.dtype == torch.float8_e8m0fnu
            assert f.loaders.ok == ("transformers (FineGrainedFP8)",)
        for name, layer in f.layers.items():
            assert torch.equal(layer.dequantized(torch.bfloat16), weights[f"{name}.weight"]), name
    _logits_close_to_bf16(folder, src, 0.1)


def test_ue8m0_scales_are_written_as_transformers_writes_them(src, tmp_path, run_cli):
    """convert --scale-format ue8m0: F8_E8M0 power-of-two block scales, each rounded up from
    amax/448 (no weight clips), and the very tensors transformers' own quantizer writes for
    the same weights (a power of two divides exactly, so its multiply by the reciprocal and our
    divide give the same codes)."""
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig
    from fp8export.errors import UsageError

    ours = tmp_path / "ours"
    convert(ConvertConfig(checkpoint=src, output=ours, weight_granularity="block",
                          block_size=(32, 32), format="vllm", scale_format="ue8m0"))
    theirs = transformers_fp8_folder(src, tmp_path / "theirs", block=(32, 32),
                                     scale_fmt="ue8m0")
    qc = json.loads((ours / "config.json").read_text())["quantization_config"]
    assert qc["scale_fmt"] == "ue8m0" and qc["weight_block_size"] == [32, 32]
    a, b = load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors"))
    source = load_file(str(src / "model.safetensors"))
    scales = [k for k in a if k.endswith("weight_scale_inv")]
    assert len(scales) == 14
    for k in scales:
        assert a[k].dtype == torch.float8_e8m0fnu and torch.equal(a[k], b[k]), k
        w = k.removesuffix("_scale_inv")
        assert torch.equal(a[w].view(torch.uint8), b[w].view(torch.uint8)), w
        from fp8export.numerics.block import block_amax

        amax = torch.from_numpy(block_amax(source[w], (32, 32)))
        assert bool((a[k].double() * 448 >= amax).all())  # rounded up: nothing clips
    with read_fp8_folder(ours) as f:
        assert f.loaders.ok == ("transformers (FineGrainedFP8)",)
    r = run_cli("inspect", ours)
    assert "block scales, 32x32 blocks" in r.stdout
    with pytest.raises(UsageError, match="--scale-format ue8m0 stores block weight scales"):
        ConvertConfig(checkpoint=src, scale_format="ue8m0", weight_granularity="block")
