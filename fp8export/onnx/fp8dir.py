"""Read an FP8 folder (docs/fp8-folder.md) for export: config, manifest, E4M3 weights, scales.

Everything the exporter needs is checked here, before any tracing starts, so a bad folder fails
in a second with a message naming the layer: a missing manifest, a quantized layer whose weight
or ``weight_scale`` tensor is absent, a manifest that says a layer has a static input scale
while the tensor is missing, scales that are not positive finite numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp8export.checkpoint.manifest import read_manifest
from fp8export.checkpoint.model_config import read_model_config
from fp8export.errors import Fp8ExportError

MANIFEST = "fp8export.json"


def read_folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the FP8 folder's safetensors files, as stored, through the checkpoint
    readers (index and shard names kept inside the folder, headers validated)."""
    from fp8export.checkpoint.hf_folder import open_hf_folder

    with open_hf_folder(folder) as ckpt:
        return {info.name: ckpt.load(info.name) for info in ckpt.tensors()}


@dataclass(frozen=True)
class QuantLayer:
    """One quantized linear of the manifest, with its stored tensors."""

    name: str  # module path, e.g. "model.layers.0.self_attn.q_proj"
    weight: torch.Tensor  # float8_e4m3fn, stored layout
    layout: str  # "out_in" | "in_out"
    weight_scale: float | torch.Tensor  # dequantization factor; float32 [out] per channel
    input_scale: float | None  # static activation scale, None when activations are dynamic

    @property
    def weight_out_in(self) -> torch.Tensor:
        """The E4M3 weight as ``[out, in]`` (what ``nn.Linear`` holds)."""
        return self.weight.t() if self.layout == "in_out" else self.weight

    @property
    def weight_scale_out_in(self) -> float | torch.Tensor:
        """The weight scale broadcastable against :attr:`weight_out_in` ``[out, in]``."""
        ws = self.weight_scale
        return ws[:, None] if isinstance(ws, torch.Tensor) else ws

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``q * scale`` in float32, cast to ``dtype``, in the stored layout."""
        w = self.weight_out_in.to(torch.float32) * self.weight_scale_out_in
        return (w.t() if self.layout == "in_out" else w).contiguous().to(dtype)


@dataclass
class Fp8Folder:
    path: Path
    config: dict[str, Any]
    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor]  # every stored tensor, as stored
    layers: dict[str, QuantLayer]  # manifest order

    def model_state(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """State dict for the transformers model: quantized weights dequantized, scales dropped."""
        drop = set()
        state: dict[str, torch.Tensor] = {}
        for name, layer in self.layers.items():
            state[f"{name}.weight"] = layer.dequantized(dtype)
            drop.update({f"{name}.weight_scale", f"{name}.input_scale"})
        for name, t in self.tensors.items():
            if name in state or name in drop:
                continue
            state[name] = t.to(dtype) if t.is_floating_point() else t
        return state


def layout_axis(entry: dict[str, Any]) -> int:
    """Axis of a stored weight that holds its output channels."""
    return 1 if entry.get("layout", "out_in") == "in_out" else 0


def _weight_scale(t: torch.Tensor, tensor_name: str, folder: Path, out_features: int,
                  ) -> float | torch.Tensor:
    """A per-tensor scale (float), or per-channel scales (float32 ``[out]``, from ``[out, 1]``)."""
    if t.numel() == 1 or t.numel() != out_features:
        return _scalar_scale(t, tensor_name, folder, "one value, or one per output channel")
    v = t.to(torch.float32).reshape(-1).clone()
    if not bool(torch.isfinite(v).all()) or not bool((v > 0).all()):
        raise Fp8ExportError(
            f"{folder}: {tensor_name} holds a scale that is not a positive finite number "
            "(TensorRT rejects it). Re-convert, or exclude the layer with --exclude.")
    return v


def _scalar_scale(t: torch.Tensor, tensor_name: str, folder: Path,
                  allowed: str = "one value") -> float:
    if t.numel() != 1:
        raise Fp8ExportError(
            f"{folder}: {tensor_name} has shape {tuple(t.shape)}; export-onnx supports {allowed}."
            " Re-convert the folder with `fp8export convert`.")
    value = float(t.to(torch.float32).reshape(()))
    if not math.isfinite(value) or value <= 0.0:
        raise Fp8ExportError(
            f"{folder}: {tensor_name} is {value}; a scale must be a positive finite number "
            "(TensorRT rejects others). Re-convert, or exclude the layer with --exclude.")
    return value


def read_fp8_folder(path: str | Path) -> Fp8Folder:
    """Load and validate an FP8 folder written by ``fp8export convert``."""
    folder = Path(path)
    if not folder.is_dir():
        raise Fp8ExportError(f"{folder}: not a folder. export-onnx takes the FP8 folder written "
                             "by `fp8export convert`.")
    if not (folder / MANIFEST).is_file():
        raise Fp8ExportError(
            f"{folder}: no {MANIFEST} manifest, so which layers are FP8 and their scales are "
            "unknown. Convert the checkpoint first: `fp8export convert CKPT -o FP8DIR`.")
    manifest = read_manifest(folder)
    config = read_model_config(folder)
    if config is None:
        raise Fp8ExportError(f"{folder}: no config.json, so the architecture is unknown. Put the "
                             "model's config.json in the folder.")
    tensors = read_folder_tensors(folder)

    quantized = manifest.get("quantized")
    if not isinstance(quantized, dict) or not quantized:
        raise Fp8ExportError(
            f"{folder / MANIFEST}: no 'quantized' layers listed, so there is nothing to export "
            "in FP8. Re-run `fp8export convert` (check --exclude/--include).")
    layers: dict[str, QuantLayer] = {}
    for name, entry in quantized.items():
        entry = entry or {}
        wname = entry.get("weight", f"{name}.weight")
        if wname not in tensors:
            raise Fp8ExportError(f"{folder}: layer {name}: weight tensor {wname} is missing from "
                                 "the safetensors files. Re-run `fp8export convert`.")
        w = tensors[wname]
        if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
            raise Fp8ExportError(
                f"{folder}: layer {name}: {wname} is {w.dtype} {tuple(w.shape)}, expected a 2-D "
                "F8_E4M3 tensor. Re-run `fp8export convert`.")
        sname = f"{name}.weight_scale"
        if sname not in tensors:
            raise Fp8ExportError(
                f"{folder}: layer {name}: scale tensor {sname} is missing, so its FP8 weight "
                "cannot be dequantized. Re-run `fp8export convert` (or exclude the layer).")
        wscale = _weight_scale(tensors[sname], sname, folder, w.shape[layout_axis(entry)])
        iname = f"{name}.input_scale"
        iscale = None
        if iname in tensors:
            iscale = _scalar_scale(tensors[iname], iname, folder)
        elif entry.get("input_scale") is not None:
            raise Fp8ExportError(
                f"{folder}: layer {name}: the manifest records a static input scale but tensor "
                f"{iname} is missing. Re-run `fp8export convert`.")
        layout = entry.get("layout", "out_in")
        if layout not in ("out_in", "in_out"):
            raise Fp8ExportError(f"{folder}: layer {name}: unknown layout {layout!r} (expected "
                                 "out_in or in_out).")
        layers[name] = QuantLayer(name, w, layout, wscale, iscale)
    return Fp8Folder(folder, config, manifest, tensors, layers)
