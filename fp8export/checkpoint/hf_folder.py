"""Checkpoints made of weight files: Hugging Face folders, one safetensors file, torch state dicts.

A Hugging Face folder holds, in the order we look for them:
``model.safetensors.index.json`` + shards, ``model.safetensors``, ``model-*.safetensors``
(shards without an index), ``pytorch_model.bin.index.json`` + shards, ``pytorch_model.bin``,
``pytorch_model-*.bin``. ``config.json`` is parsed when present; the files loaders read besides
the weights (tokenizer, generation config, sentence-transformers modules, …: see
:mod:`fp8export.checkpoint.loader_files`) are listed in ``aux_files`` for the writers to copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fp8export.checkpoint.loader_files import loader_files
from fp8export.checkpoint.model_config import read_model_config
from fp8export.checkpoint.safetensors_reader import SafetensorsFile
from fp8export.checkpoint.source import Checkpoint, TensorInfo
from fp8export.checkpoint.torch_reader import TorchFile
from fp8export.errors import Fp8ExportError
from fp8export.io.descriptors import reserve
from fp8export.io.guarded import INDEX, read_json
from fp8export.io.paths import check_symlink, contained

if TYPE_CHECKING:
    import torch

ST_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")



class WeightFile(Protocol):
    path: Path
    tensors: list[TensorInfo]

    def load(self, name: str) -> torch.Tensor: ...
    def close(self) -> None: ...


def open_weight_file(path: Path) -> WeightFile:
    if path.suffix == ".safetensors":
        return SafetensorsFile(path)
    return TorchFile(path)


class WeightFilesCheckpoint(Checkpoint):
    """A checkpoint whose tensors live in one or more weight files (each read lazily).

    ``notes`` holds plain sentences for the user (what was unwrapped, skipped or assumed).
    """

    def __init__(self, path: Path, kind: str, files: list[Path], *,
                 config: dict[str, Any] | None = None, index: Path | None = None,
                 index_map: dict[str, str] | None = None, aux_files: list[Path] | None = None,
                 notes: list[str] | None = None):
        super().__init__(path=path, kind=kind, config=config,
                         source_files=[*files, *([index] if index else [])],
                         aux_files=list(aux_files or []))
        self.notes: list[str] = list(notes or [])
        self._files: list[WeightFile] = []
        self._where: dict[str, WeightFile] = {}
        self._infos: list[TensorInfo] = []
        self._by_name: dict[str, TensorInfo] = {}
        self._scratch: torch.Tensor | None = None
        reserve(len(files), f"{path}: reading its {len(files)} weight files")
        try:
            for file_path in files:
                wf = open_weight_file(file_path)
                self._files.append(wf)
                self.notes.extend(getattr(wf, "notes", []))
                for info in wf.tensors:
                    if info.name in self._where:
                        raise Fp8ExportError(
                            f"{file_path}: tensor {info.name!r} is also in "
                            f"{self._where[info.name].path.name}; shards must not repeat a name. "
                            "Remove the stray shard or regenerate the checkpoint.")
                    self._where[info.name] = wf
                    self._by_name[info.name] = info
                    self._infos.append(info)
            if index is not None and index_map is not None:
                self._check_index(index, index_map)
        except BaseException:
            self.close()
            raise

    def _check_index(self, index: Path, index_map: dict[str, str]) -> None:
        for name, shard in index_map.items():
            wf = self._where.get(name)
            if wf is None:
                raise Fp8ExportError(
                    f"{index}: lists tensor {name!r} in {shard}, but no shard holds it. The index "
                    "and the shards disagree: regenerate the index or restore the shard.")
            if wf.path.name != Path(shard).name:
                raise Fp8ExportError(
                    f"{index}: lists tensor {name!r} in {shard}, but it is in {wf.path.name}. "
                    "The index and the shards disagree: regenerate the index.")
        unlisted = [i.name for i in self._infos if i.name not in index_map]
        if unlisted:
            self.notes.append(f"{index.name}: {len(unlisted)} tensor(s) in the shards are not in "
                              f"its weight_map (e.g. {unlisted[0]!r}); they are read anyway")

    def tensors(self) -> list[TensorInfo]:
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        info = self._by_name.get(name)
        if info is None:
            raise Fp8ExportError(f"{self.path}: no tensor named {name!r}.")
        return info

    def load(self, name: str) -> torch.Tensor:
        wf = self._where.get(name)
        if wf is None:
            raise Fp8ExportError(f"{self.path}: no tensor named {name!r}.")
        return wf.load(name)

    def safetensors_files(self) -> list[SafetensorsFile] | None:
        """The weight files, when every one is safetensors (else None: a pickle is among them)."""
        if self._files and all(isinstance(wf, SafetensorsFile) for wf in self._files):
            return list(self._files)
        return None

    def load_scratch(self, name: str) -> torch.Tensor:
        """Like :meth:`load`, but safetensors data lands in one buffer reused by the next
        ``load_scratch`` call: use the tensor (not a view of it) before loading another."""
        wf = self._where.get(name)
        if not isinstance(wf, SafetensorsFile):
            return self.load(name)
        begin, end = wf.spans[name]
        if self._scratch is None or self._scratch.numel() < end - begin:
            import torch

            self._scratch = None  # free the old one first
            self._scratch = torch.empty(end - begin, dtype=torch.uint8)
        return wf.load(name, scratch=self._scratch)

    def load_pinned(self, name: str) -> torch.Tensor:
        """Like :meth:`load`, into page-locked memory (for a copy to a GPU): safetensors data
        is read straight into it, other files copied once."""
        import torch

        wf = self._where.get(name)
        if not isinstance(wf, SafetensorsFile):
            return self.load(name).pin_memory()
        begin, end = wf.spans[name]
        return wf.load(name, scratch=torch.empty(end - begin, dtype=torch.uint8,
                                                 pin_memory=True))

    def close(self) -> None:
        self._scratch = None
        for wf in self._files:
            wf.close()


# ---------------------------------------------------------------------------------- discovery

def folder_config(folder: Path) -> dict[str, Any] | None:
    return read_model_config(folder)


def _index(folder: Path, index: Path) -> tuple[list[Path], dict[str, str]]:
    data = read_json(index, INDEX, root=folder)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise Fp8ExportError(f"{index}: has no 'weight_map' object mapping tensor names to shard "
                             "files. Regenerate the index (save_pretrained writes it).")
    # Shard files in name order (model-00001-of-… first), whatever order the map lists them in.
    shards = sorted({contained(folder, shard, named_by=index) for shard in weight_map.values()})
    for path in shards:
        if not path.is_file():
            raise Fp8ExportError(f"{index}: names shard {path.name}, which is missing from "
                                 f"{folder}. Download the missing shard or regenerate the index.")
    return shards, weight_map


def weight_files(folder: Path) -> tuple[str, list[Path], Path | None, dict[str, str] | None]:
    """(format, weight files, index, weight_map) of a Hugging Face folder, or raise."""
    for index_name, single, shard_glob, fmt in (
            (ST_INDEX, "model.safetensors", "model-*.safetensors", "safetensors"),
            (PT_INDEX, "pytorch_model.bin", "pytorch_model-*.bin", "torch")):
        index = folder / index_name
        if index.is_file():
            check_symlink(index, folder)
            shards, weight_map = _index(folder, index)
            return fmt, shards, index, weight_map
        if (folder / single).is_file():
            path = folder / single
            check_symlink(path, folder)
            return fmt, [path], None, None
        shards = sorted(p for p in folder.glob(shard_glob) if p.is_file())
        if shards:
            for p in shards:
                check_symlink(p, folder)
            return fmt, shards, None, None
    raise Fp8ExportError(
        f"{folder}: no weights found. Expected model.safetensors, model-*.safetensors with "
        f"{ST_INDEX}, or pytorch_model*.bin in the folder.")


def has_weights(folder: Path) -> bool:
    """Whether ``folder`` looks like a Hugging Face folder (cheap: names only)."""
    names = (ST_INDEX, "model.safetensors", PT_INDEX, "pytorch_model.bin")
    return (any((folder / n).exists() for n in names)
            or any(folder.glob("model-*.safetensors")) or any(folder.glob("pytorch_model-*.bin")))


def open_hf_folder(folder: Path) -> WeightFilesCheckpoint:
    """Open a Hugging Face model folder (see the module docstring)."""
    if not folder.is_dir():
        raise Fp8ExportError(f"{folder}: no such folder. Give the path of a Hugging Face model "
                             "folder (with config.json and model*.safetensors).")
    fmt, files, index, weight_map = weight_files(folder)
    notes = [] if index or len(files) == 1 else [
        f"{folder.name}: {len(files)} shards and no index file; reading all of them"]
    return WeightFilesCheckpoint(folder, "hf-folder", files, config=folder_config(folder),
                                 index=index, index_map=weight_map,
                                 aux_files=loader_files(folder), notes=notes)


def open_safetensors_file(path: Path) -> WeightFilesCheckpoint:
    """Open one ``.safetensors`` file; a ``config.json`` beside it is used when present."""
    return WeightFilesCheckpoint(path, "safetensors", [path], config=folder_config(path.parent))


def open_torch_file(path: Path) -> WeightFilesCheckpoint:
    """Open one torch state dict (``.pt``/``.pth``/``.bin``); ``config.json`` beside it is used."""
    return WeightFilesCheckpoint(path, "torch", [path], config=folder_config(path.parent))


def open_index_file(path: Path) -> WeightFilesCheckpoint:
    """An index file given directly: open its folder."""
    return open_hf_folder(path.parent)
