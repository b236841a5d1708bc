"""The one reader of an FP8 folder (docs/fp8-folder.md): manifest, config, tensors, layers.

Every consumer (export-onnx, the torch FP8 runner, verify, inspect) reads the folder here.
Tensors are read from the safetensors files when they are looked up, one at a time, so a
consumer that needs a few tensors does not load the whole model. Opening checks what every
consumer relies on, before any tracing or model building starts, so a bad folder fails in a
second with a message naming the layer: a missing manifest, a quantized layer whose weight or
``weight_scale`` tensor is absent or of the wrong type, a manifest that says a layer has a
static input scale while the tensor is missing, scales that are not positive finite numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8export.checkpoint.model_config import read_model_config
from fp8export.checkpoint.source import Checkpoint, TensorInfo
from fp8export.errors import Fp8ExportError
from fp8export.fp8dir.manifest import MANIFEST_NAME, read_manifest

if TYPE_CHECKING:  # torch loads only when a tensor is read
    import torch

_CONVERT_FIRST = "Convert the checkpoint first: `fp8export convert CKPT -o FP8DIR`."


def is_fp8_folder(path: str | Path) -> bool:
    """A folder holding the manifest ``fp8export convert`` writes."""
    p = Path(path)
    return p.is_dir() and (p / MANIFEST_NAME).is_file()


def manifest_if_any(path: str | Path) -> dict[str, Any] | None:
    """The folder's validated manifest, or None when ``path`` is no FP8 folder of ours."""
    return read_manifest(Path(path)) if is_fp8_folder(path) else None


def read_folder_manifest(path: str | Path) -> dict[str, Any]:
    """The validated manifest of the FP8 folder ``path``; a clear error when there is none."""
    folder = Path(path)
    if not folder.is_dir():
        raise Fp8ExportError(f"{folder}: not a folder. Give the FP8 folder written by "
                             f"`fp8export convert`. {_CONVERT_FIRST}")
    if not (folder / MANIFEST_NAME).is_file():
        raise Fp8ExportError(
            f"{folder}: no {MANIFEST_NAME} manifest, so this is not an FP8 folder written by "
            f"`fp8export convert` (which layers are FP8 and their scales are unknown). "
            f"{_CONVERT_FIRST}")
    return read_manifest(folder)


def read_folder_config(path: str | Path) -> dict[str, Any]:
    """The folder's ``config.json`` (required: it names the architecture)."""
    config = read_model_config(Path(path))
    if config is None:
        raise Fp8ExportError(f"{path}: no config.json, so the architecture is unknown. Put the "
                             "model's config.json in the folder.")
    return config


class FolderTensors(Mapping[str, "torch.Tensor"]):
    """The folder's stored tensors by name (E4M3 stays E4M3), each read from its safetensors
    file when looked up and not kept: iterate names and ``infos`` freely, load what you use."""

    def __init__(self, ckpt: Checkpoint):
        self._ckpt = ckpt
        self.infos: dict[str, TensorInfo] = {i.name: i for i in ckpt.tensors()}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.infos:
            raise KeyError(name)
        return self._ckpt.load(name)

    def __contains__(self, name: object) -> bool:
        return name in self.infos

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(i.shape) for n, i in self.infos.items()}

    def close(self) -> None:
        self._ckpt.close()

    def __enter__(self) -> FolderTensors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_folder_tensors(path: str | Path) -> FolderTensors:
    """The folder's tensors through the checkpoint readers (index and shard names kept inside
    the folder, headers validated). Close it, or use it as a context manager."""
    from fp8export.checkpoint.hf_folder import open_hf_folder

    return FolderTensors(open_hf_folder(Path(path)))


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
        import torch

        ws = self.weight_scale
        return ws[:, None] if isinstance(ws, torch.Tensor) else ws

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``q * scale`` in float32, cast to ``dtype`` (default float32), in the stored layout."""
        import torch

        w = self.weight_out_in.to(torch.float32) * self.weight_scale_out_in
        w = w.t() if self.layout == "in_out" else w
        return w.contiguous().to(dtype or torch.float32)


@dataclass(frozen=True)
class _LayerEntry:
    name: str
    weight: str  # tensor name of the E4M3 weight
    layout: str
    weight_scale: float | torch.Tensor  # float32 [out] per channel
    input_scale: float | None


class FolderLayers(Mapping[str, QuantLayer]):
    """The manifest's quantized layers (manifest order); a layer's weight is read on lookup."""

    def __init__(self, entries: dict[str, _LayerEntry], tensors: FolderTensors):
        self._entries, self._tensors = entries, tensors

    def __getitem__(self, name: str) -> QuantLayer:
        e = self._entries[name]
        return QuantLayer(e.name, self._tensors[e.weight], e.layout, e.weight_scale,
                          e.input_scale)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class Fp8Folder:
    """An opened FP8 folder. Use as a context manager: ``close`` releases the file handles."""

    path: Path
    config: dict[str, Any]
    manifest: dict[str, Any]
    tensors: FolderTensors  # every stored tensor, as stored, read on lookup
    layers: FolderLayers  # manifest order

    def model_state(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """State dict for the transformers model: quantized weights dequantized, scales dropped."""
        drop = set()
        state: dict[str, torch.Tensor] = {}
        for name, layer in self.layers.items():
            state[f"{name}.weight"] = layer.dequantized(dtype)
            drop.update({f"{name}.weight_scale", f"{name}.input_scale"})
        for name in self.tensors:
            if name in state or name in drop:
                continue
            t = self.tensors[name]
            state[name] = t.to(dtype) if t.is_floating_point() else t
        return state

    def close(self) -> None:
        self.tensors.close()

    def __enter__(self) -> Fp8Folder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def layout_axis(entry: dict[str, Any]) -> int:
    """Axis of a stored weight that holds its output channels."""
    return 1 if entry.get("layout", "out_in") == "in_out" else 0


def _weight_scale(t: torch.Tensor, tensor_name: str, folder: Path, out_features: int,
                  ) -> float | torch.Tensor:
    """A per-tensor scale (float), or per-channel scales (float32 ``[out]``, from ``[out, 1]``)."""
    import torch

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
    value = float(t.float().reshape(()))
    if not math.isfinite(value) or value <= 0.0:
        raise Fp8ExportError(
            f"{folder}: {tensor_name} is {value}; a scale must be a positive finite number "
            "(TensorRT rejects others). Re-convert, or exclude the layer with --exclude.")
    return value


def read_fp8_folder(path: str | Path) -> Fp8Folder:
    """Open and validate an FP8 folder written by ``fp8export convert`` (reads the headers and
    the scales; weights are read when a consumer looks them up)."""
    folder = Path(path)
    manifest = read_folder_manifest(folder)
    config = read_folder_config(folder)
    quantized = manifest.get("quantized")
    if not isinstance(quantized, dict) or not quantized:
        raise Fp8ExportError(
            f"{folder / MANIFEST_NAME}: no 'quantized' layers listed, so there is nothing to "
            "export in FP8. Re-run `fp8export convert` (check --exclude/--include).")
    tensors = open_folder_tensors(folder)
    try:
        entries = {name: _layer_entry(folder, name, entry or {}, tensors)
                   for name, entry in quantized.items()}
    except BaseException:
        tensors.close()
        raise
    return Fp8Folder(folder, config, manifest, tensors, FolderLayers(entries, tensors))


def _layer_entry(folder: Path, name: str, entry: dict[str, Any], tensors: FolderTensors
                 ) -> _LayerEntry:
    wname = entry.get("weight", f"{name}.weight")
    info = tensors.infos.get(wname)
    if info is None:
        raise Fp8ExportError(f"{folder}: layer {name}: weight tensor {wname} is missing from "
                             "the safetensors files. Re-run `fp8export convert`.")
    if info.dtype != "F8_E4M3" or len(info.shape) != 2:
        dtype = "torch.float8_e4m3fn" if info.dtype == "F8_E4M3" else tensors[wname].dtype
        raise Fp8ExportError(
            f"{folder}: layer {name}: {wname} is {dtype} {tuple(info.shape)}, expected a 2-D "
            "F8_E4M3 tensor. Re-run `fp8export convert`.")
    sname = f"{name}.weight_scale"
    if sname not in tensors:
        raise Fp8ExportError(
            f"{folder}: layer {name}: scale tensor {sname} is missing, so its FP8 weight "
            "cannot be dequantized. Re-run `fp8export convert` (or exclude the layer).")
    wscale = _weight_scale(tensors[sname], sname, folder, info.shape[layout_axis(entry)])
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
    return _LayerEntry(name, wname, layout, wscale, iscale)
