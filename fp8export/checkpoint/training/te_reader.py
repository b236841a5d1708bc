"""The reader of torch state dicts that carry FP8 training state (Transformer Engine, torchao).

Registered on import as ``"transformer-engine"`` ahead of the generic readers. It opens
``.pt`` / ``.pth`` / ``.bin`` files whose pickle names a TE ``_extra_state`` or a torchao
delayed-scaling buffer — ``can_open`` decides from the pickle's opcodes (``pickletools.genops``
over ``data.pkl``) without unpickling — and ``.safetensors`` files whose header lists such
names (TE 2.x extra states are uint8 tensors, so ``save_pretrained`` can store them there);
also Hugging Face folders and index files of either.

torchao checkpoints whose weights are torchao's float8 FSDP wrappers (dynamic scaling) are
opened too: the wrappers are rebuilt as inert stand-ins, unwrapped to their high-precision
tensors, and a note says there is no FP8 state to reuse (:mod:`.torchao`).

Loading the outer file: TE 0.12–1.13 stores each ``_extra_state`` as an ``io.BytesIO``, which
``torch.load(weights_only=True)`` refuses. We keep torch's weights-only unpickler (it already
refuses every other callable and checks tensor rebuilding) and allow exactly one more type,
``io.BytesIO``, through ``torch.serialization.safe_globals``: a BytesIO is an inert byte buffer,
and its contents are decoded by our own restricted path (:mod:`.te_unpickle`). A custom
``pickle_module`` would have meant re-implementing what the weights-only unpickler already
guarantees. Nothing in the checkpoint is ever executed and TE is never imported.

What the checkpoint presents: every tensor except the ``_extra_state`` entries and torchao's
``fp8_*`` buffers, with TE parameter names mapped to HF-style names (``fc1_weight`` →
``fc1.weight``, ``weight3`` → ``3.weight``; see :mod:`.te`), so that the histories' modules
match ``<module>.weight``.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8export.checkpoint.hf_folder import PT_INDEX, ST_INDEX, folder_config, weight_files
from fp8export.checkpoint.loader_files import loader_files
from fp8export.checkpoint.safetensors_reader import SafetensorsFile, read_header
from fp8export.checkpoint.source import Checkpoint, TensorInfo, register_reader
from fp8export.checkpoint.torch_reader import WRAPPER_KEYS, check_tensor, is_zip
from fp8export.checkpoint.training import torchao
from fp8export.checkpoint.training.base import TrainingState
from fp8export.checkpoint.training.te import EXTRA_STATE, plan_modules, te_training_state
from fp8export.checkpoint.training.torchao import (
    has_delayed_state,
    is_torchao_buffer,
    names_torchao_float8,
    torchao_training_state,
)
from fp8export.errors import Fp8ExportError

if TYPE_CHECKING:
    import torch

READER_NAME = "transformer-engine"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
# data.pkl holds names and storage references only (no tensor data): a few MB for the largest
# models. Larger ones are not scanned (the generic reader then opens or refuses the file).
MAX_SCAN_BYTES = 64 * 1024 * 1024
_MARKERS = (b"_extra_state", b"fp8_amax_history_", b"torchao.float8")


# ----------------------------------------------------------------------------- detection

def _data_pkl(path: Path) -> bytes | None:
    try:
        with zipfile.ZipFile(path) as zf:
            names = [i for i in zf.infolist()
                     if i.filename == "data.pkl" or i.filename.endswith("/data.pkl")]
            if len(names) != 1 or names[0].file_size > MAX_SCAN_BYTES:
                return None
            with zf.open(names[0]) as f:
                return f.read(MAX_SCAN_BYTES + 1)
    except (OSError, zipfile.BadZipFile, ValueError, RuntimeError, EOFError, NotImplementedError):
        return None


def _names_fp8_state(data: bytes) -> bool:
    """Whether the pickle has a string key naming TE extra state or a torchao history buffer."""
    if not any(m in data for m in _MARKERS):
        return False
    try:
        for op, arg, _pos in pickletools.genops(data):
            if isinstance(arg, str) and (arg == EXTRA_STATE or arg.endswith("." + EXTRA_STATE)
                                         or has_delayed_state([arg])
                                         or names_torchao_float8(arg)):
                return True
    except Exception:  # malformed pickle: not ours to open; the generic reader reports it
        return False
    return False


def file_has_fp8_state(path: Path) -> bool:
    """Cheap check of one weight file (no unpickling; for safetensors, the header only)."""
    if path.is_file() and path.suffix == ".safetensors":
        try:
            infos, _meta = read_header(path)
        except Fp8ExportError:  # the generic reader reports a broken file
            return False
        return any(_is_state_name(i.name) for i in infos)
    if not (path.is_file() and path.suffix in TORCH_SUFFIXES and is_zip(path)):
        return False
    data = _data_pkl(path)
    return data is not None and _names_fp8_state(data)


def can_open(path: Path) -> bool:
    if path.is_file():
        if path.name in (PT_INDEX, ST_INDEX):
            return can_open(path.parent)
        return file_has_fp8_state(path)
    if path.is_dir():
        try:
            _fmt, files, _index, _map = weight_files(path)
        except Fp8ExportError:
            return False
        return any(file_has_fp8_state(f) for f in files)
    return False


# ------------------------------------------------------------------------------- loading

def _load(path: Path) -> Any:
    import torch

    try:
        with torch.serialization.safe_globals([io.BytesIO, *torchao.safe_globals()]):
            return torch.load(path, weights_only=True, map_location="cpu",
                              mmap=is_zip(path))
    except pickle.UnpicklingError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        detail = next((ln for ln in lines if "GLOBAL" in ln or "global" in ln),
                      lines[0] if lines else "")
        hint = (" It holds Transformer Engine FP8 primary weights (Float8Tensor), which "
                "fp8export does not read; save the model with high-precision weights."
                if "float8_tensor" in detail.lower() or "Float8Tensor" in detail else "")
        raise Fp8ExportError(
            f"{path}: refused for safety — loading it would run code or build objects that are "
            f"not tensors ({detail[:240]}). Nothing from it was executed.{hint}") from exc
    except MemoryError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "no detail"
        raise Fp8ExportError(f"{path}: not a readable torch checkpoint ({type(exc).__name__}: "
                             f"{first}). It is truncated or corrupt: re-save it.") from exc


def _is_entry(value: Any) -> bool:
    import torch

    return isinstance(value, (torch.Tensor, io.BytesIO))


def _unwrap(obj: Any, path: Path, notes: list[str]) -> dict[str, Any]:
    while (isinstance(obj, dict) and not any(_is_entry(v) for v in obj.values())
           and (key := next((k for k in WRAPPER_KEYS if isinstance(obj.get(k), dict)), None))):
        notes.append(f"{path.name}: using the state dict under {key!r}")
        obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise Fp8ExportError(f"{path}: holds a {type(obj).__name__}, not a state dict with string "
                             "keys. Save model.state_dict() instead.")
    if obj and all(k.startswith("module.") for k in obj):
        obj = {k[len("module."):]: v for k, v in obj.items()}
        notes.append(f"{path.name}: stripped the 'module.' prefix (DataParallel) from every name")
    return obj


class _TorchSource:
    """One torch file, loaded (memory-mapped) once."""

    def __init__(self, path: Path, notes: list[str]):
        self.path = path
        self.entries = _unwrap(_load(path), path, notes)
        self.wrapped = torchao.unwrap_weights(self.entries)

    def names(self) -> list[str]:
        return list(self.entries)

    def value(self, name: str) -> Any:
        return self.entries[name]

    def close(self) -> None:
        self.entries = {}


class _SafetensorsSource:
    """One safetensors file (TE 2.x extra states are uint8 tensors, so they can live there)."""

    def __init__(self, path: Path, notes: list[str]):
        self.path = path
        self.file = SafetensorsFile(path)

    def names(self) -> list[str]:
        return [t.name for t in self.file.tensors]

    def value(self, name: str) -> Any:
        return self.file.load(name)

    def close(self) -> None:
        self.file.close()


def _is_state_name(name: str) -> bool:
    return name == EXTRA_STATE or name.endswith("." + EXTRA_STATE) or is_torchao_buffer(name)


def _naming(exc: Fp8ExportError, path: Path) -> Fp8ExportError:
    """The same error with the checkpoint path in front, unless it already names a file of it:
    layer names alone are ambiguous in multi-shard folders."""
    msg = str(exc)
    if path.name in msg:
        return exc
    return Fp8ExportError(f"{path}: {msg}")


class Fp8StateCheckpoint(Checkpoint):
    """State dict(s) with TE ``_extra_state`` or torchao FP8 buffers (see the module doc)."""

    def __init__(self, path: Path, files: list[Path], *, config: dict | None = None,
                 index: Path | None = None, aux_files: list[Path] | None = None):
        super().__init__(path=path, kind=READER_NAME, config=config,
                         source_files=[*files, *([index] if index else [])],
                         aux_files=list(aux_files or []))
        self.notes: list[str] = []
        self._sources: list[_TorchSource | _SafetensorsSource] = []
        try:
            self._open(files)
        except Fp8ExportError as exc:
            self.close()
            raise _naming(exc, path) from exc
        except BaseException:
            self.close()
            raise

    def _open(self, files: list[Path]) -> None:
        where: dict[str, _TorchSource | _SafetensorsSource] = {}
        for file in files:
            src = (_SafetensorsSource if file.suffix == ".safetensors" else _TorchSource)(
                file, self.notes)
            self._sources.append(src)
            for name in src.names():
                if name in where:
                    raise Fp8ExportError(f"{file}: {name!r} is also in {where[name].path.name}; "
                                         "shards must not repeat a name.")
                where[name] = src
        self._where = where
        plans = plan_modules(where)
        renames = {old: new for plan in plans.values() for old, new in plan.renames.items()}
        # FP8 state entries are small: read them now; weights stay where they are until loaded.
        state_entries = {n: src.value(n) for n, src in where.items() if _is_state_name(n)}
        self._stored: dict[str, str] = {}  # presented name → stored name
        self._infos: list[TensorInfo] = []
        ignored: list[str] = []
        for name, src in where.items():
            if _is_state_name(name):
                continue
            info = self._info(src, name)
            if info is None:
                ignored.append(name)
                continue
            shown = renames.get(name, name)
            self._stored[shown] = name
            self._infos.append(replace(info, name=shown))
        if ignored:
            self.notes.append(f"ignored non-tensor entries: {', '.join(ignored[:8])}"
                              + (f" and {len(ignored) - 8} more" if len(ignored) > 8 else ""))
        if renames:
            self.notes.append(f"Transformer Engine names mapped to HF style for {len(renames)} "
                              "tensor(s) (e.g. fc1_weight → fc1.weight, weight<i> → <i>.weight)")
        # Decode the FP8 state now: a hostile or corrupt extra state is refused at open time,
        # whatever --scales mode is used later.
        self._state: TrainingState | None
        if plans:
            self._state = te_training_state(state_entries, plans)
        else:
            self._state = torchao_training_state(state_entries)
        if self._state is None and any(getattr(s, "wrapped", None) for s in self._sources):
            self.notes.append(torchao.DYNAMIC_NOTE)
        self.kind = "transformer-engine" if plans else "torchao"

    @staticmethod
    def _info(src: _TorchSource | _SafetensorsSource, name: str) -> TensorInfo | None:
        if isinstance(src, _SafetensorsSource):
            return src.file.info(name)
        value = src.entries[name]
        if not _tensor(value):
            return None
        dtype = check_tensor(value, name, src.path)
        return TensorInfo(name=name, dtype=dtype, shape=tuple(value.shape), file=src.path)

    def tensors(self) -> list[TensorInfo]:
        return list(self._infos)

    def load(self, name: str) -> torch.Tensor:
        stored = self._stored.get(name)
        if stored is None:
            raise Fp8ExportError(f"{self.path}: no tensor named {name!r}.")
        return self._where[stored].value(stored)

    def training_state(self) -> TrainingState | None:
        return self._state

    def close(self) -> None:
        for src in self._sources:
            src.close()


def _tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def open_fp8_state_checkpoint(path: Path) -> Fp8StateCheckpoint:
    """Open a TE/torchao torch or safetensors file, its index, or a HF folder of them."""
    if path.is_file() and path.name in (PT_INDEX, ST_INDEX):
        path = path.parent
    if path.is_dir():
        _fmt, files, index, _weight_map = weight_files(path)
        return Fp8StateCheckpoint(path, files, config=folder_config(path), index=index,
                                  aux_files=loader_files(path))
    return Fp8StateCheckpoint(path, [path], config=folder_config(path.parent))


register_reader(READER_NAME, can_open, open_fp8_state_checkpoint, first=True)
