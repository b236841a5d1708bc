"""The one reader of an FP8 folder (docs/fp8-folder.md): manifest, config, tensors, layers.

Every consumer (export-onnx, the torch FP8 runner, verify, inspect) reads the folder here.
Tensors are read from the safetensors files when they are looked up, one at a time, so a
consumer that needs a few tensors does not load the whole model. Opening checks what every
consumer relies on, before any tracing or model building starts, so a bad folder fails in a
second with a message naming the layer: a missing manifest, a quantized layer whose weight or
``weight_scale`` tensor is absent or of the wrong type, a manifest that says a layer has a
static input scale while the tensor is missing, scales that are not positive finite numbers,
and anything the engines the folder's config names would read differently than its tensors
say (``fp8dir/engines.py``: every folder, ours and other tools', is read as they read it;
``Fp8Folder.loaders`` names the engines that load it as what it is). No size from a header is
believed before it is checked against the weight it describes: a scale's shape must fit its
weight before the scale is read, and a block side longer than the weight's is the weight's.
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
from fp8export.fp8dir.formats import declared_dynamic
from fp8export.fp8dir.manifest import MANIFEST_NAME, read_manifest

if TYPE_CHECKING:  # torch loads only when a tensor is read
    import torch

    from fp8export.fp8dir.engines import Loaders

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
    """One quantized linear of the folder, with its stored tensors."""

    name: str  # module path, e.g. "model.layers.0.self_attn.q_proj"
    weight: torch.Tensor  # float8_e4m3fn, stored layout
    layout: str  # "out_in" | "in_out"
    weight_scale: float | torch.Tensor  # dequantization factor; float32 [out] per channel,
    # [ceil(out/bn), ceil(in/bk)] per block
    input_scale: float | None  # static activation scale, None when activations are dynamic
    block: tuple[int, int] | None = None  # (bn, bk) of a block-scaled weight
    dynamic: str = "tensor"  # without input_scale: "tensor" | "token" | "group" (per token
    # and group of ``group_size`` input elements)
    group_size: int | None = None

    @property
    def granularity(self) -> str:
        """"tensor", "channel" or "block"."""
        if self.block is not None:
            return "block"
        return "tensor" if isinstance(self.weight_scale, float) else "channel"

    @property
    def weight_out_in(self) -> torch.Tensor:
        """The E4M3 weight as ``[out, in]`` (what ``nn.Linear`` holds)."""
        return self.weight.t() if self.layout == "in_out" else self.weight

    @property
    def weight_scale_out_in(self) -> float | torch.Tensor:
        """The weight scale broadcastable against :attr:`weight_out_in` ``[out, in]`` (a block
        grid is expanded over its tiles)."""
        import torch

        from fp8export.numerics.block import expand_blocks

        ws = self.weight_scale
        if self.block is not None:
            return expand_blocks(ws, tuple(self.weight_out_in.shape), self.block)
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
    weight_scale: float | torch.Tensor  # float32 [out] per channel, [gr, gc] per block
    input_scale: float | None
    block: tuple[int, int] | None = None
    dynamic: str = "tensor"
    group_size: int | None = None


class FolderLayers(Mapping[str, QuantLayer]):
    """The manifest's quantized layers (manifest order); a layer's weight is read on lookup."""

    def __init__(self, entries: dict[str, _LayerEntry], tensors: FolderTensors):
        self._entries, self._tensors = entries, tensors

    def __getitem__(self, name: str) -> QuantLayer:
        e = self._entries[name]
        return QuantLayer(e.name, self._tensors[e.weight], e.layout, e.weight_scale,
                          e.input_scale, e.block, e.dynamic, e.group_size)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class FolderFormat:
    """What kind of FP8 folder this is, as the reader found it (inspect and verify print it)."""

    producer: str  # "fp8export 0.1.0", "compressed-tensors 0.19.0", "modelopt 0.47.0", ...
    dialect: str  # "compressed-tensors" | "vllm" (quant_method fp8) | "modelopt"
    granularity: str  # weights: "tensor" | "channel" | "block" | "mixed"
    block_size: tuple[int, int] | None
    activations: str  # "static" | "dynamic" | "mixed"
    dynamic: str | None  # how dynamic layers scale their input: "tensor" | "token" | "group"
    group_size: int | None  # of "group"
    ours: bool  # written by fp8export convert (has fp8export.json)

    def describe(self) -> str:
        """One line: ``compressed-tensors, block 128x128 weights, dynamic per-token-group(128)
        activations (written by compressed-tensors 0.19.0)``."""
        weights = self.granularity
        if self.block_size:
            weights += f" {self.block_size[0]}x{self.block_size[1]}"
        acts = self.activations
        if self.dynamic and self.activations != "static":
            acts += {"group": " per-token-group", "none": " (weight-only layers: none)"}.get(
                self.dynamic, f" per-{self.dynamic}")
            acts += f"({self.group_size})" if self.group_size else ""
        return (f"{self.dialect}, {weights} weights, {acts} activations "
                f"(written by {self.producer})")

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["block_size"] = list(self.block_size) if self.block_size else None
        return d


@dataclass
class Fp8Folder:
    """An opened FP8 folder. Use as a context manager: ``close`` releases the file handles.

    ``manifest`` is fp8export.json for a folder convert wrote, or the same structure built from
    the config and the tensors of a folder another tool wrote; either way every entry of
    ``manifest["quantized"]`` names its ``weight_scale_tensor`` and ``input_scale_tensor`` (or
    null) and carries its ``block_size``, ``dynamic`` and ``group_size``.
    """

    path: Path
    config: dict[str, Any]
    manifest: dict[str, Any]
    tensors: FolderTensors  # every stored tensor, as stored, read on lookup
    layers: FolderLayers  # manifest order
    format: FolderFormat | None = None
    loaders: Loaders | None = None  # which engines load it as what it is (fp8dir.engines)

    def model_state(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """State dict for the transformers model: quantized weights dequantized, scales dropped."""
        drop = set()
        state: dict[str, torch.Tensor] = {}
        quantized = self.manifest.get("quantized") or {}
        for name, layer in self.layers.items():
            state[f"{name}.weight"] = layer.dequantized(dtype)
            entry = quantized.get(name) or {}
            drop.update({entry.get("weight_scale_tensor") or f"{name}.weight_scale",
                         entry.get("input_scale_tensor") or f"{name}.input_scale"})
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


def _weight_scale(t: torch.Tensor, tensor_name: str, folder: Path, shape: tuple[int, int],
                  layout: str = "out_in", block: tuple[int, int] | None = None,
                  ) -> float | torch.Tensor:
    """A per-tensor scale (float), per-channel scales (float32 ``[out]``, from ``[out]`` or
    ``[out, 1]``), or a block grid (float32 ``[ceil(out/bn), ceil(in/bk)]``)."""
    import torch

    from fp8export.numerics.block import grid_shape

    out_features = shape[1] if layout == "in_out" else shape[0]
    if block is not None:
        want = grid_shape((shape[1], shape[0]) if layout == "in_out" else shape, block)
        if tuple(t.shape) != want:
            raise Fp8ExportError(
                f"{folder}: {tensor_name} has shape {tuple(t.shape)}, but a {shape[0]}x"
                f"{shape[1]} weight in blocks of {block[0]}x{block[1]} needs a {want[0]}x"
                f"{want[1]} grid. The folder is corrupt or was edited; re-convert it.")
        v = t.to(torch.float32).clone()
    elif t.numel() == 1 or t.numel() != out_features or t.dim() > 2 or (
            t.dim() == 2 and t.shape[1] != 1):
        return _scalar_scale(t, tensor_name, folder,
                             "one value, one per output channel, or a block grid")
    else:
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
            f"{folder}: {tensor_name} has shape {tuple(t.shape)}; fp8export reads {allowed}. "
            "Re-convert the folder with `fp8export convert`.")
    value = float(t.float().reshape(()))
    if not math.isfinite(value) or value <= 0.0:
        raise Fp8ExportError(
            f"{folder}: {tensor_name} is {value}; a scale must be a positive finite number "
            "(TensorRT rejects others). Re-convert, or exclude the layer with --exclude.")
    return value


def read_fp8_folder(path: str | Path) -> Fp8Folder:
    """Open and validate an FP8 folder (reads the headers and the scales; weights are read when
    a consumer looks them up): one written by ``fp8export convert``, or one another tool wrote
    in a dialect this reader knows (compressed-tensors, ``quant_method: fp8`` with or without
    ``weight_block_size``, ModelOpt FP8), described from its config and tensors."""
    folder = Path(path)
    kind = fp8_folder_kind(folder)
    if kind is None:
        read_folder_manifest(folder)  # raises the "not an FP8 folder" error
    config = read_folder_config(folder)
    tensors = open_folder_tensors(folder)
    try:
        if kind == "fp8export":
            raw = read_manifest(folder)
            _validate(folder, raw, config, tensors)
            manifest, found = _our_manifest(folder, raw, config, tensors)
        else:
            from fp8export.fp8dir.engines import Loaders
            from fp8export.fp8dir.foreign import foreign_manifest

            manifest = foreign_manifest(folder, config, tensors)
            found = Loaders(tuple(manifest["loaded_by"]), dict(manifest["not_loaded_by"]))
        entries = {name: _layer_entry(folder, name, entry, tensors)
                   for name, entry in manifest["quantized"].items()}
    except BaseException:
        tensors.close()
        raise
    return Fp8Folder(folder, config, manifest, tensors, FolderLayers(entries, tensors),
                     folder_format(manifest, config), found)


def validate_written_folder(path: str | Path) -> None:
    """fp8dir.validate's checks alone on a folder convert wrote, for one the reader cannot open
    as a model because it has no config.json (converted from a source without one): its layers
    and scales can still be vouched for."""
    folder = Path(path)
    raw = read_manifest(folder)
    with open_folder_tensors(folder) as tensors:
        _validate(folder, raw, read_model_config(folder), tensors)  # None: no config.json


def _validate(folder: Path, manifest: dict[str, Any], config: dict[str, Any] | None,
              tensors: FolderTensors) -> None:
    """fp8dir.validate's checks on a folder convert wrote, before anything is built from it:
    every FP8 tensor a listed layer's own weight, every scale a sane float equal to the
    manifest's, config.json's quantization_config the manifest's."""
    from fp8export.fp8dir.validate import validate_folder

    infos = {n: (i.dtype, tuple(i.shape)) for n, i in tensors.infos.items()}
    validate_folder(folder, manifest, config, infos,
                    lambda name: tensors[name].float().reshape(-1).numpy())


def fp8_folder_kind(path: str | Path) -> str | None:
    """``"fp8export"`` (written by convert: fp8export.json), ``"foreign"`` (no manifest, but
    config.json or hf_quant_config.json declares FP8 in a dialect the reader knows), or None.
    Reads the small JSON files only, through the guarded opener."""
    p = Path(path)
    if not p.is_dir():
        return None
    if (p / MANIFEST_NAME).is_file():
        return "fp8export"
    from fp8export.fp8dir.foreign import declared_fp8

    return "foreign" if declared_fp8(p) else None


def folder_format(manifest: dict[str, Any], config: dict[str, Any]) -> FolderFormat:
    """The :class:`FolderFormat` of a normalized manifest."""
    from fp8export.fp8dir.formats import dialect_of

    quantized = manifest.get("quantized") or {}
    kinds = set()
    blocks = set()
    for entry in quantized.values():
        kinds.add(entry.get("granularity", "tensor"))
        if entry.get("block_size"):
            blocks.add(tuple(entry["block_size"]))
    dynamic = sorted({e["dynamic"] for e in quantized.values() if not e.get("input_scale_tensor")})
    groups = {e.get("group_size") for e in quantized.values() if e.get("dynamic") == "group"}
    tool = manifest.get("tool") or {}
    producer = manifest.get("producer") or f"{tool.get('name', 'fp8export')} " \
                                            f"{tool.get('version', '')}".strip()
    return FolderFormat(
        producer=str(producer),
        dialect=dialect_of(config.get("quantization_config")) or str(
            manifest.get("output_format")),
        granularity=kinds.pop() if len(kinds) == 1 else "mixed",
        block_size=blocks.pop() if len(blocks) == 1 else None,
        activations=str(manifest.get("activation_scheme")),
        dynamic=dynamic[0] if len(dynamic) == 1 else ("mixed" if dynamic else None),
        group_size=groups.pop() if len(groups) == 1 else None,
        ours=not manifest.get("foreign"))


def _our_manifest(folder: Path, manifest: dict[str, Any], config: dict[str, Any],
                  tensors: FolderTensors) -> tuple[dict[str, Any], Loaders]:
    """fp8export.json with every quantized entry completed (see :class:`Fp8Folder`), and the
    engines that load the folder: its config.json is read as they read it, and must say what
    the manifest says (fp8dir.engines)."""
    from fp8export.checkpoint.model_config import is_keras_config
    from fp8export.fp8dir.engines import FP8EXPORT_ONLY, Loaders, judge_layers, loaders
    from fp8export.fp8dir.foreign import folder_reading

    quantized = manifest.get("quantized") or {}  # none: every layer kept in high precision
    # a Keras model's config no serving engine reads: fp8export's own runtimes run it
    if is_keras_config(config) or not isinstance(config.get("quantization_config"), dict):
        read_as, found = {}, Loaders((FP8EXPORT_ONLY,), {})
    else:
        reading = folder_reading(folder, config, tensors.infos)
        layouts = {m: (e or {}).get("layout", "out_in") for m, e in quantized.items()}
        read_as = judge_layers(folder, reading, tensors.infos, config, layouts)
        if set(read_as) != set(quantized):
            odd = sorted(set(read_as) ^ set(quantized))
            raise Fp8ExportError(
                f"{folder}: config.json and {MANIFEST_NAME} disagree on which layers are FP8 "
                f"(e.g. {odd[0]}). Re-run `fp8export convert`; the folder was edited.")
        scale_dtypes = {r.weight_scale_tensor: tensors.infos[r.weight_scale_tensor].dtype
                        for r in read_as.values()}
        found = loaders(reading, read_as, config, scale_dtypes)
    granularity = manifest.get("weight_granularity", "tensor")
    block = None
    if granularity == "block":
        block = _manifest_block(folder, manifest.get("block_size"))
    # what config.json declares is what engines run, so it is what the runtime runs
    dynamic = declared_dynamic(config.get("quantization_config")) if block is None else None
    dynamic = dynamic or manifest.get("dynamic_activations", "tensor")
    if dynamic not in ("tensor", "token", "group") or (dynamic == "group") != (block is not None):
        raise Fp8ExportError(f"{folder / MANIFEST_NAME}: dynamic_activations {str(dynamic)[:20]!r}"
                             f" does not fit weight_granularity {str(granularity)[:20]!r}. "
                             "Re-run `fp8export convert`.")
    out = {}
    for name, entry in quantized.items():
        entry = dict(entry or {})
        wscale = [n for n in (f"{name}.weight_scale", f"{name}.weight_scale_inv") if n in tensors]
        iname = f"{name}.input_scale"
        if name in read_as:
            wscale = [read_as[name].weight_scale_tensor]
        entry.update(
            weight_scale_tensor=wscale[0] if len(wscale) == 1 else f"{name}.weight_scale",
            input_scale_tensor=iname if iname in tensors else None,
            block_size=list(block) if block else None, dynamic=dynamic,
            group_size=block[1] if block else None)
        entry.setdefault("granularity", granularity if granularity in ("block", "channel")
                         else "tensor")
        out[name] = entry
    return {**manifest, "quantized": out, "loaded_by": list(found.ok),
            "not_loaded_by": dict(found.not_ok)}, found


def _manifest_block(folder: Path, value: Any) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 16 for v in value)):
        raise Fp8ExportError(f"{folder / MANIFEST_NAME}: weight_granularity is block but "
                             f"block_size is {str(value)[:40]!r}, not two positive integers. "
                             "Re-run `fp8export convert`.")
    return value[0], value[1]


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
    sname = entry["weight_scale_tensor"]
    if sname not in tensors:
        raise Fp8ExportError(
            f"{folder}: layer {name}: scale tensor {sname} is missing, so its FP8 weight "
            "cannot be dequantized. Re-run `fp8export convert` (or exclude the layer).")
    layout = entry.get("layout", "out_in")
    if layout not in ("out_in", "in_out"):
        raise Fp8ExportError(f"{folder}: layer {name}: unknown layout {layout!r} (expected "
                             "out_in or in_out).")
    block = tuple(entry["block_size"]) if entry.get("block_size") else None
    if block is not None and layout != "out_in":
        raise Fp8ExportError(f"{folder}: layer {name}: block scales need an [out, in] weight.")
    if not _scale_fits(tensors.infos[sname].shape, tuple(info.shape), layout, block):
        raise Fp8ExportError(
            f"{folder}: {sname} has shape {list(tensors.infos[sname].shape)}, which is no scale "
            f"of the {list(info.shape)} weight {wname} (one value, one per output channel, or "
            "its block grid). The folder is corrupt or was edited; re-convert it.")
    wscale = _weight_scale(tensors[sname], sname, folder, tuple(info.shape), layout, block)
    iname = entry.get("input_scale_tensor")
    iscale = _scalar_scale(tensors[iname], iname, folder) if iname else None
    group = entry.get("group_size")
    if block is not None:  # a side longer than the weight's is one tile: the same numbers
        block = (min(block[0], info.shape[0]), min(block[1], info.shape[1]))
        group = min(group, info.shape[1]) if group else group
    return _LayerEntry(name, wname, layout, wscale, iscale, block, entry["dynamic"], group)


def _scale_fits(sshape: Any, shape: tuple[int, int], layout: str,
                block: tuple[int, int] | None) -> bool:
    """Whether a scale of ``sshape`` (a header's, not yet read) can belong to the weight: the
    reader reads a scale only after this, so a forged header cannot make it allocate more than
    the weight's own size."""
    from fp8export.numerics.block import grid_shape

    sshape = tuple(int(d) for d in sshape)
    numel = 1
    for d in sshape:
        numel *= d
    out_features = shape[1] if layout == "in_out" else shape[0]
    if block is not None:
        return sshape == grid_shape(shape, block)
    return numel == 1 or sshape in ((out_features,), (out_features, 1))
