"""Test-only writers of FP8 folders other tools write, following each format's own description
(reference/fp8_checkpoint_formats.md) and independent of fp8export's writer: ModelOpt
(hf_quant_config.json, 0-dim scales, static inputs, KV scales on k_proj/v_proj), AutoFP8
(quant_method fp8, static), the fine-grained DeepSeek-V3 format (weight_scale_inv grids, dynamic
per-token-group inputs); ``edit`` changes a written folder's tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS


def tile_scales(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """amax / 448 of each bn x bk tile, written out with reshape (no fp8export code)."""
    out, inp = w.shape
    pad = torch.nn.functional.pad(w.float().abs(), (0, -inp % bk, 0, -out % bn))
    return pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).amax(dim=(1, 3)) / 448


def write(src: Path, out: Path, tensors: dict, quantization_config: dict | None,
           extra: dict | None = None) -> Path:
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    for name, content in (extra or {}).items():
        (out / name).write_text(json.dumps(content))
    return out


def modelopt_folder(src: Path, out: Path, in_config: bool = False) -> Path:
    """ModelOpt's HF export: 0-dim F32 weight_scale/input_scale, weights cast without clamp
    after dividing by the scale, k/v scales on k_proj/v_proj, hf_quant_config.json."""
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not is_linear(name):
            tensors[name] = t
            continue
        m = name[: -len(".weight")]
        s = t.float().abs().max() / 448
        tensors[name] = (t.float() / s).to(torch.float8_e4m3fn)
        tensors[f"{m}.weight_scale"] = s.reshape(())
        tensors[f"{m}.input_scale"] = torch.tensor(4.0 / 448)
        if m.endswith("self_attn.k_proj"):
            tensors[f"{m}.k_scale"] = torch.tensor(2.0 / 448)
        if m.endswith("self_attn.v_proj"):
            tensors[f"{m}.v_scale"] = torch.tensor(3.0 / 448)
    hf = {"producer": {"name": "modelopt", "version": "0.47.0"},
          "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                           "exclude_modules": ["lm_head"]}}
    qc = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"],
          "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}
    return write(src, out, tensors, qc if in_config else None,
                  None if in_config else {"hf_quant_config.json": hf})


def deepseek_folder(src: Path, out: Path, block=(32, 32)) -> Path:
    """DeepSeek-V3's format: weight_scale_inv [ceil(out/bn), ceil(in/bk)] F32 dequantization
    factors, quant_method fp8 with weight_block_size, dynamic activations."""
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not is_linear(name):
            tensors[name] = t
            continue
        s = tile_scales(t, *block)
        full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        full = full[: t.shape[0], : t.shape[1]]
        tensors[name] = (t.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[name[: -len(".weight")] + ".weight_scale_inv"] = s
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
          "weight_block_size": list(block)}
    return write(src, out, tensors, qc)


def autofp8_folder(src: Path, out: Path) -> Path:
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not is_linear(name):
            tensors[name] = t
            continue
        m = name[: -len(".weight")]
        s = t.float().abs().max() / 448
        tensors[name] = (t.float() / s).to(torch.float8_e4m3fn)
        tensors[f"{m}.weight_scale"] = s.reshape(())
        tensors[f"{m}.input_scale"] = torch.tensor(5.0 / 448)
    qc = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    return write(src, out, tensors, qc)


def edit(folder: Path, change) -> Path:
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


FP8_ARGS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}


def ct_folder(src: Path, out: Path, *, strategy: str = "tensor", block=(32, 32),
              static: bool = True, config: dict | None = None, quantize=is_linear) -> Path:
    """compressed-tensors as llm-compressor writes it, by its documented key names:
    ``weight_scale`` (``[1]``, ``[out, 1]`` or the block grid, BF16), static ``input_scale``
    ``[1]`` or dynamic inputs; ``config`` updates the quantization_config; ``quantize(name)``
    picks the 2-D weights stored in FP8."""
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not quantize(name):
            tensors[name] = t
            continue
        m = name[: -len(".weight")]
        w = t.float()
        if strategy == "tensor":
            s = (w.abs().max() / 448).reshape(1)
            full = s
        elif strategy == "channel":
            s = w.abs().amax(dim=1, keepdim=True) / 448
            full = s
        else:
            s = tile_scales(w, *block)
            full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
            full = full[: w.shape[0], : w.shape[1]]
        tensors[name] = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[f"{m}.weight_scale"] = s.to(torch.bfloat16)
        if static:
            tensors[f"{m}.input_scale"] = torch.tensor([4.0 / 448], dtype=torch.bfloat16)
    weights = {**FP8_ARGS, "strategy": strategy,
               **({"block_structure": list(block)} if strategy == "block" else {})}
    if static:
        inputs = {**FP8_ARGS, "strategy": "tensor"}
    elif strategy == "block":
        inputs = {**FP8_ARGS, "strategy": "group", "group_size": block[1], "dynamic": True}
    else:
        inputs = {**FP8_ARGS, "strategy": "token", "dynamic": True}
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "version": "0.19.0",
          "quantization_status": "compressed", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                        "input_activations": inputs}},
          **(config or {})}
    return write(src, out, tensors, qc)


def transformers_fp8_folder(src: Path, out: Path, block=(32, 32), scale_fmt: str = "float"
                            ) -> Path:
    """What transformers' own fine-grained quantize op writes (``Fp8Quantize``, the op its
    ``FineGrainedFP8Config`` runs when it quantizes a model): E4M3 weights and
    ``weight_scale_inv`` grids, F32 or, with ``scale_fmt="ue8m0"``, power-of-two F8_E8M0."""
    from types import SimpleNamespace

    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    qc = FineGrainedFP8Config(weight_block_size=tuple(block), scale_fmt=scale_fmt)
    op = Fp8Quantize(SimpleNamespace(quantization_config=qc))
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        tensors.update(op.convert({name: t}) if is_linear(name) else {name: t})
    config = {"quant_method": "fp8", "activation_scheme": "dynamic",
              "weight_block_size": list(block), "scale_fmt": scale_fmt,
              "modules_to_not_convert": ["lm_head"]}
    return write(src, out, tensors, config)
