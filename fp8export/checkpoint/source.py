"""The reader interface every checkpoint format implements, and the registry that picks one.

A ``Checkpoint`` lists tensors without loading them and loads them one at a time, so convert
never holds the whole model in memory. Readers register with :func:`register_reader`; the
first whose ``can_open(path)`` is true opens the path. Tensor names are Hugging Face style
(``model.layers.0.self_attn.q_proj.weight``) and 2-D linear weights are ``[out, in]``: a reader
whose framework stores ``[in, out]`` (Keras kernels, GPT-2 Conv1D) says so in
``TensorInfo.transposed`` and ``load`` returns the stored layout; ``load_linear_weight``
returns ``[out, in]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8export.errors import Fp8ExportError

if TYPE_CHECKING:
    import torch

    from fp8export.checkpoint.training.base import TrainingState


# Larger than any real tensor's dimension or rank; far below int64 overflow (a shape of
# [2^63, 0] has 0 elements, so its byte count checks out, but nothing can index it).
MAX_DIM = 1 << 40
MAX_RANK = 16


@dataclass(frozen=True)
class TensorInfo:
    """Metadata of one stored tensor, read without loading its data."""

    name: str
    dtype: str  # safetensors spelling: "BF16", "F16", "F32", "F8_E4M3", "I64", ...
    shape: tuple[int, ...]
    file: Path  # the file holding it (for shard mirroring and messages)
    transposed: bool = False  # stored as [in, out] (Keras kernel, GPT-2 Conv1D)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Checkpoint(ABC):
    """An opened checkpoint. Use as a context manager; ``close`` releases file handles."""

    path: Path
    kind: str  # "hf-folder", "safetensors", "torch", "keras", ...
    config: dict[str, Any] | None = None  # the model's config.json, when there is one
    source_files: list[Path] = field(default_factory=list)  # weight files (hashed in the manifest)
    # Files loaders read besides the weights, inside the checkpoint folder (copied to the same
    # relative path; a folder entry is an empty folder to create). See loader_files.
    aux_files: list[Path] = field(default_factory=list)

    @abstractmethod
    def tensors(self) -> list[TensorInfo]:
        """Every tensor, in a stable order (the source's own order within each file)."""

    @abstractmethod
    def load(self, name: str) -> torch.Tensor:
        """Load one tensor (as stored), on CPU. Raise Fp8ExportError naming file and tensor."""

    def training_state(self) -> TrainingState | None:
        """FP8 training state (amax histories) found in the checkpoint, or None."""
        return None

    def shard_groups(self) -> list[tuple[str, list[str]]]:
        """Source file name → tensor names, in order, so writers can mirror the sharding."""
        groups: dict[str, list[str]] = {}
        for info in self.tensors():
            groups.setdefault(info.file.name, []).append(info.name)
        return list(groups.items())

    def info(self, name: str) -> TensorInfo:
        for t in self.tensors():
            if t.name == name:
                return t
        raise Fp8ExportError(f"{self.path}: no tensor named {name!r}.")

    def close(self) -> None:  # readers holding handles override
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


Reader = tuple[Callable[[Path], bool], Callable[[Path], Checkpoint]]
_READERS: list[tuple[str, Callable[[Path], bool], Callable[[Path], Checkpoint]]] = []


def register_reader(name: str, can_open: Callable[[Path], bool],
                    open_fn: Callable[[Path], Checkpoint], *, first: bool = False) -> None:
    """Add a reader. ``first=True`` puts it ahead of the generic ones (e.g. Keras, TE)."""
    entry = (name, can_open, open_fn)
    if first:
        _READERS.insert(0, entry)
    else:
        _READERS.append(entry)


_BUILTINS_LOADED = False


def _load_builtin_readers() -> None:
    # Importing a reader module registers it. Keep the list here so the order is explicit:
    # readers registered with first=True (Keras, Transformer Engine) go ahead of the generic ones.
    # Optional dependencies are imported when a reader opens a path, never here.
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    from fp8export.checkpoint import readers  # noqa: F401
    from fp8export.checkpoint.training import te_reader  # noqa: F401


def check_checkpoint_path(path: str | Path) -> Path:
    """Refuse a checkpoint path that does not exist (cheap: commands call it before any work)."""
    p = Path(path)
    if not p.exists():
        raise Fp8ExportError(f"{p}: no such file or folder. Give a Hugging Face folder, a "
                             ".safetensors file, a .pt/.pth/.bin state dict or a .keras file.")
    return p


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open ``path`` with the first reader that accepts it, or explain what was expected."""
    p = check_checkpoint_path(path)
    _load_builtin_readers()
    for _name, can_open, open_fn in _READERS:
        if can_open(p):
            ckpt = open_fn(p)
            try:
                check_shapes(ckpt.tensors())
            except BaseException:
                ckpt.close()
                raise
            return ckpt
    raise Fp8ExportError(
        f"{p}: no weights found. Expected a folder with model.safetensors / "
        "model-*.safetensors (+ model.safetensors.index.json) or pytorch_model*.bin, a single "
        ".safetensors file, a .pt/.pth state dict, or a Keras .keras / .weights.h5 file (or a "
        "folder holding one)."
    )


def check_shapes(tensors: list[TensorInfo]) -> None:
    """Every reader's tensors within :data:`MAX_DIM` and :data:`MAX_RANK` (safetensors, torch
    files, Keras, Transformer Engine alike), before any size is computed from them."""
    for t in tensors:
        if len(t.shape) > MAX_RANK or any(d < 0 or d > MAX_DIM for d in t.shape):
            raise Fp8ExportError(
                f"{t.file}: tensor {t.name!r} has shape {list(t.shape)}: a dimension below 0 or "
                f"above 2^40, or more than {MAX_RANK} dimensions; no real tensor has. The file "
                "is corrupt or hostile; re-save the checkpoint.")
