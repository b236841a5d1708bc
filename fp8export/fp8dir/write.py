"""Lay out and write the FP8 folder's safetensors shards, one tensor in memory at a time.

Output shards mirror the source's file grouping: each source weight file becomes one output
file (``model.safetensors`` for one, ``model-0000i-of-0000n.safetensors`` for several, plus
``model.safetensors.index.json``). Inside a shard, tensors keep the source order; a quantized
``<m>.weight`` (F8_E4M3, source layout) is followed by ``<m>.weight_scale`` and, with static
activations, ``<m>.input_scale`` (F32, shape ``[1]``, or 0-dim for ModelOpt; a per-channel
``weight_scale`` is ``[out, 1]``, a block one ``[ceil(out/bn), ceil(in/bk)]`` and named
``weight_scale_inv`` in the fine-grained vllm dialect). Beside the shards: the index, config.json
and the dialect's files (:func:`write_configs`), and the source's loader files
(:func:`copy_loader_files`).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fp8export.checkpoint.source import Checkpoint
from fp8export.errors import Fp8ExportError
from fp8export.fp8dir.safetensors_writer import PlannedTensor, write_safetensors
from fp8export.io import safetensors_dtypes
from fp8export.numerics.block import quantize_blocks_sqnr
from fp8export.numerics.channel import quantize_channels_sqnr
from fp8export.scales.select import Target
from fp8export.scales.weights import quantize_weight_sqnr

if TYPE_CHECKING:  # torch is imported where a function needs it (lazily: convert's
    import torch  # default path runs without it)

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class Planned:
    """One output tensor and where its data comes from."""

    tensor: PlannedTensor
    kind: str  # "copy" | "weight" | "weight_scale" | "input_scale" | "kv_scale"
    source: str  # source tensor name ("weight"/"copy"), module name (scales), or the KV
    # scale's own name
    layout: str = "out_in"  # of a quantized weight: where its output channels are


@dataclass
class ShardPlan:
    file_name: str
    source_file: str
    entries: list[Planned] = field(default_factory=list)


def shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def plan_shards(ckpt: Checkpoint, targets: dict[str, Target], weight_scales: dict[str, np.float32],
                input_scales: dict[str, np.float32], scale_shape: tuple[int, ...],
                kv_after: dict[str, list[str]] | None = None,
                weight_scale_name: str = "weight_scale",
                weight_scale_dtype: str = "F32") -> list[ShardPlan]:
    """The output files and their tensors, in order. ``targets`` is keyed by weight name.
    ``kv_after``: KV-cache scale tensors to write right after a source tensor (by its name).
    ``weight_scale_name``: the suffix of the weight scale tensors (``formats.weight_scale_name``);
    ``weight_scale_dtype``: their dtype (F32, or F8_E8M0 for power-of-two UE8M0 scales).
    """
    infos = {i.name: i for i in ckpt.tensors()}
    groups = ckpt.shard_groups()
    plans = [ShardPlan(name, src) for name, (src, _) in zip(shard_names(len(groups)), groups)]
    clashes: list[str] = []
    for plan, (_, names) in zip(plans, groups):
        for name in names:
            info = infos[name]
            t = targets.get(name)
            kv = [Planned(PlannedTensor(k, "F32", scale_shape), "kv_scale", k)
                  for k in (kv_after or {}).get(name, ())]
            clashes.extend(e.tensor.name for e in kv if e.tensor.name in infos)
            if t is None or t.module not in weight_scales:
                plan.entries.append(Planned(PlannedTensor(name, info.dtype, tuple(info.shape)),
                                            "copy", name))
                plan.entries.extend(kv)
                continue
            plan.entries.append(Planned(PlannedTensor(name, "F8_E4M3", tuple(info.shape)),
                                        "weight", name, t.layout))
            extra = ["weight_scale"] + (["input_scale"] if t.module in input_scales else [])
            for kind in extra:
                scale_name = f"{t.module}.{weight_scale_name if kind == 'weight_scale' else kind}"
                if scale_name in infos:
                    clashes.append(scale_name)
                shape = scale_shape
                ndim = np.ndim(weight_scales[t.module])
                if kind == "weight_scale" and ndim == 1:
                    shape = (np.size(weight_scales[t.module]), 1)  # per channel: [out, 1]
                elif kind == "weight_scale" and ndim == 2:
                    shape = tuple(np.shape(weight_scales[t.module]))  # per block: the grid
                dtype = weight_scale_dtype if kind == "weight_scale" else "F32"
                plan.entries.append(Planned(PlannedTensor(scale_name, dtype, shape),
                                            kind, t.module))
            plan.entries.extend(kv)
    if clashes:
        raise Fp8ExportError(
            f"{ckpt.path}: already holds {', '.join(clashes[:5])}; it looks like a quantized "
            "checkpoint. Convert the original bf16/fp16/fp32 checkpoint instead.")
    return plans


class _BufferPool:
    """FP8 output buffers handed back once written, reused for later weights (a fresh large
    buffer is a fresh mapping whose pages must all be faulted in). Holds at most
    :data:`_POOL_KEEP` buffers; the writer thread returns them, the main thread takes them."""

    def __init__(self) -> None:

        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> torch.Tensor:
        import torch

        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:  # the smallest that fits (list.remove would compare tensors by value)
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(nbytes, dtype=torch.uint8)

    def put(self, tensor: torch.Tensor) -> None:
        import torch

        base = tensor.view(torch.uint8).reshape(-1)
        storage = torch.empty(0, dtype=torch.uint8).set_(base.untyped_storage())
        with self._lock:
            self._free.append(storage)
            if len(self._free) > _POOL_KEEP:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


_POOL_KEEP = 3


@dataclass
class WriteRecord:
    """What :func:`write_shards` wrote: the digest of every tensor's bytes, per output file, the
    SQNR of every quantized weight, computed from exactly those bytes while quantizing, and the
    sha256 of every output file, computed from the bytes as they were written."""

    digests: dict[str, dict[str, str]] = field(default_factory=dict)  # file -> tensor -> digest
    sqnr: dict[str, float] = field(default_factory=dict)  # module -> dB
    files: dict[str, str] = field(default_factory=dict)  # file -> sha256 of all its bytes


def scale_tensor(value: np.float32 | np.ndarray, shape: tuple[int, ...], dtype: str = "F32"
                 ) -> torch.Tensor:
    """A scale as the tensor to write: float32, or F8_E8M0 (its values are powers of two, so
    the cast is exact)."""
    import torch

    t = torch.from_numpy(np.array(value, dtype=np.float32).reshape(shape))
    return t.to(torch.float8_e8m0fnu) if dtype == "F8_E8M0" else t


def write_shards(out_dir: Path, plans: list[ShardPlan], ckpt: Checkpoint,
                 weight_scales: dict[str, np.float32], input_scales: dict[str, np.float32],
                 *, kv_scales: dict[str, np.float32] | None = None,
                 on_tensor: Callable[[], None] | None = None,
                 on_file: Callable[[ShardPlan, WriteRecord], None] | None = None,
                 block: tuple[int, int] | None = None) -> WriteRecord:
    """Write every shard, one tensor in memory at a time; return the digests and SQNRs.

    ``on_file(plan, record)`` is called when a shard is complete and fsynced (read-back of that
    shard can start while the next one is written). ``block``: the ``(bn, bk)`` of block-scaled
    weights (their scales are ``[gr, gc]`` grids).
    """

    record = WriteRecord()
    weight_module: dict[str, str] = {}  # weight tensor name -> module (from its scale entry)
    for p in plans:
        for e in p.entries:
            if e.kind == "weight_scale":
                weight_module[f"{e.source}.weight"] = e.source

    def produce(entry: Planned) -> torch.Tensor:
        if on_tensor is not None:
            on_tensor()
        if entry.kind == "copy":
            t = ckpt.load(entry.source)
            st = safetensors_dtypes.TORCH_TO_ST.get(t.dtype)
            if st != entry.tensor.dtype or tuple(t.shape) != entry.tensor.shape:
                raise Fp8ExportError(
                    f"{ckpt.path}: tensor {entry.source} loads as {st} {tuple(t.shape)} but the "
                    f"file header says {entry.tensor.dtype} {entry.tensor.shape}; the file is "
                    "corrupt or changed during conversion.")
            return t
        if entry.kind == "weight":
            module = weight_module[entry.source]
            w = load_scratch(entry.source)  # dropped before the next weight is loaded
            scale = weight_scales[module]
            if np.ndim(scale) == 2:
                q, record.sqnr[module] = quantize_blocks_sqnr(w, scale, block)
            elif np.ndim(scale):
                q, record.sqnr[module] = quantize_channels_sqnr(w, scale, entry.layout)
            else:
                q, record.sqnr[module] = quantize_weight_sqnr(w, scale, out=pool.get(w.numel()))
            del w
            return q
        return scale_tensor(scale_of(entry, weight_scales, input_scales, kv_scales),
                            entry.tensor.shape, entry.tensor.dtype)

    load_scratch = getattr(ckpt, "load_scratch", ckpt.load)
    pool = _BufferPool()
    for plan in plans:
        by_name = {e.tensor.name: e for e in plan.entries}
        digests = record.digests.setdefault(plan.file_name, {})
        file_hash = hashlib.sha256()
        write_safetensors(out_dir / plan.file_name, [e.tensor for e in plan.entries],
                          lambda pt, by_name=by_name: produce(by_name[pt.name]), digests=digests,
                          release=lambda pt, t, by_name=by_name: (
                              pool.put(t) if by_name[pt.name].kind == "weight" else None),
                          file_hash=file_hash)
        record.files[plan.file_name] = file_hash.hexdigest()
        if on_file is not None:
            on_file(plan, record)
    return record


def scale_of(entry: Planned, weight_scales: dict, input_scales: dict,
             kv_scales: dict | None) -> np.float32 | np.ndarray:
    """The value a planned scale tensor holds."""
    table = {"weight_scale": weight_scales, "input_scale": input_scales,
             "kv_scale": kv_scales or {}}[entry.kind]
    return table[entry.source]


def index_json(plans: list[ShardPlan]) -> dict | None:
    """``model.safetensors.index.json`` content when there are several shards, else None."""
    if len(plans) < 2:
        return None
    weight_map = {e.tensor.name: p.file_name for p in plans for e in p.entries}
    total = sum(e.tensor.nbytes for p in plans for e in p.entries)
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def write_configs(tmp: Path, plans: list[ShardPlan], config: dict | None,
                  quantization_config: dict, extra: dict[str, dict]) -> tuple[set[str], set[str]]:
    """The index, ``config.json`` (the source's with ``quantization_config``; none without a
    source config) and the dialect's ``extra`` files (``formats.extra_files``) into ``tmp``;
    returns (every name written, including the shards and the manifest to come, and those of
    them fp8export wrote)."""
    from fp8export.fp8dir.manifest import MANIFEST_NAME, write_json

    index = index_json(plans)
    if index is not None:
        write_json(tmp / INDEX_NAME, index)
    written = {p.file_name for p in plans} | {INDEX_NAME, MANIFEST_NAME, "config.json"}
    if config is not None:
        write_json(tmp / "config.json", {**config, "quantization_config": quantization_config})
    for name, content in extra.items():
        write_json(tmp / name, content)
        written.add(name)
    return written, set(written)


def copy_loader_files(tmp: Path, ckpt: Checkpoint, written: set[str]) -> None:
    """The checkpoint's tokenizer and other loader files, byte for byte, at their relative
    paths (not over a name in ``written``), each through the guarded reader: a loader file that
    is a FIFO, a device or a link out of the checkpoint is refused, not copied."""
    import os

    from fp8export.io.atomic import OUTPUT_MODE, fsync_dir
    from fp8export.io.guarded import TOKENIZER, copy_input

    root = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
    for aux in sorted(ckpt.aux_files):
        rel = aux.relative_to(root).as_posix()
        if rel in written:
            continue
        if aux.is_dir():  # an empty module folder, e.g. sentence-transformers' Normalize
            (tmp / rel).mkdir(parents=True, exist_ok=True)
        else:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            copy_input(aux, tmp / rel, TOKENIZER, root=root, mode=OUTPUT_MODE)
            with open(tmp / rel, "rb") as f:
                os.fsync(f.fileno())
        written.add(rel)
    for sub in sorted({p.parent for p in tmp.rglob("*")} - {tmp}):
        fsync_dir(sub)  # the atomic publish syncs the top folder only
