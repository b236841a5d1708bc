"""Reading torch state dicts (``.pt`` / ``.pth`` / ``.bin``) without ever running their pickles.

``torch.load(weights_only=True)`` only rebuilds tensors and plain containers; a pickle that
names any other callable (``os.system``, ``eval``, a class with ``__reduce__``) fails with
``pickle.UnpicklingError`` before anything runs, and we turn that into a refusal. Zip-format
files (everything ``torch.save`` wrote since PyTorch 1.6) are memory-mapped, so tensors are
paged in only when used; legacy files cannot be mapped and are read whole.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8export.checkpoint.source import TensorInfo
from fp8export.errors import Fp8ExportError
from fp8export.io.guarded import WEIGHTS, open_input

if TYPE_CHECKING:
    import torch

# Training scripts wrap the model's state dict; these keys hold it (Lightning, plain loops,
# DeepSpeed). Unwrapped only when the outer dict holds no tensors of its own.
WRAPPER_KEYS = ("state_dict", "model_state_dict", "model", "module")
TE_HINT = ("It looks like a Transformer Engine checkpoint (it has '_extra_state' FP8 metadata), "
           "which the Transformer Engine reader opens; if you see this, that reader is missing "
           "or did not recognise the file.")



def is_zip(path: Path) -> bool:
    """``zipfile.is_zipfile`` whose failures are ours: a corrupt ZIP64 locator (e.g. a
    multi-disk marker) makes the stdlib raise BadZipFile instead of answering. Such a file's
    directory is inconsistent, so it is refused rather than guessed at (it might hide FP8
    training state that a lenient reader would silently skip)."""
    try:
        return zipfile.is_zipfile(path)
    except zipfile.BadZipFile as exc:
        raise Fp8ExportError(
            f"{path}: corrupt zip container ({exc}); the torch checkpoint is damaged. "
            "Re-save it with torch.save, or convert an intact copy."
        ) from exc
    except (OSError, ValueError, EOFError):
        return False

def _dtype_name(dtype: torch.dtype) -> str | None:
    import torch

    return {
        torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
        torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
        torch.uint8: "U8", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
        torch.bool: "BOOL",
    }.get(dtype)


def load_state_dict(path: Path) -> Any:
    """``torch.load`` the file safely (weights only, CPU, mmap when possible); errors named."""
    import torch

    open_input(path, WEIGHTS).close()  # a regular file: torch would block on a FIFO
    mmap = is_zip(path)
    try:
        return torch.load(path, weights_only=True, mmap=mmap, map_location="cpu")
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "BytesIO" in text:  # TE <= 1.x pickles its FP8 metadata as io.BytesIO
            raise Fp8ExportError(f"{path}: holds pickled Python objects that are not tensors. "
                                 f"{TE_HINT}") from exc
        detail = next((ln.strip() for ln in text.splitlines()
                       if "GLOBAL" in ln or "global" in ln), text.splitlines()[0] if text else "")
        raise Fp8ExportError(
            f"{path}: refused for safety — loading it would run code or build objects that are "
            f"not tensors ({detail}). Nothing from it was executed. Re-save the weights with "
            "torch.save(model.state_dict()) or as safetensors from a trusted environment."
        ) from exc
    except MemoryError:
        raise
    except Exception as exc:  # torch raises RuntimeError/KeyError/EOFError/... on corrupt files
        raise Fp8ExportError(
            f"{path}: not a readable torch checkpoint ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}). The file is truncated, "
            "corrupt, or not a torch.save file: re-download or re-save it.") from exc


# Nested state dicts are a few levels deep (wrapper → model → submodule); deeper is hostile.
MAX_NESTING = 64


def _flatten(obj: Any, path: Path, out: dict[str, Any], ignored: list[str]) -> None:
    """Tensors of nested dicts by dotted name (iterative: a hostile nesting is refused, not a
    RecursionError)."""
    import torch

    stack = [("", obj, 0)]
    while stack:
        prefix, value, depth = stack.pop()
        if isinstance(value, torch.Tensor):
            out[prefix] = value
        elif isinstance(value, dict):
            if depth >= MAX_NESTING:
                raise Fp8ExportError(f"{path}: dicts nested more than {MAX_NESTING} deep (at "
                                     f"{prefix[:80]!r}…); not a state dict. Save "
                                     "model.state_dict().")
            items = [(f"{prefix}.{key}" if prefix else str(key), v, depth + 1)
                     for key, v in value.items()]
            stack.extend(reversed(items))
        else:
            ignored.append(prefix or "<root>")


def check_tensor(t: torch.Tensor, name: str, path: Path) -> str:
    """The safetensors dtype name of a tensor read from a torch file, after refusing what no
    state dict holds: meta or nested tensors, sparse/quantized layouts, and views whose
    storage is smaller than their shape implies (stride 0 or overlapping strides: a tiny file
    that expands to 10^12 elements)."""
    where = f"{path}: tensor {name!r}"
    if t.is_nested:
        raise Fp8ExportError(f"{where} is a nested tensor; a state dict holds dense tensors. "
                             "Save model.state_dict().")
    import torch

    if t.is_quantized or t.layout != torch.strided:
        raise Fp8ExportError(f"{where} is sparse or quantized; save it dense "
                             "(tensor.to_dense() / dequantize()) first.")
    if t.device.type == "meta":
        raise Fp8ExportError(f"{where} is a meta tensor: the file holds its shape but no data. "
                             "Save the real weights.")
    dtype = _dtype_name(t.dtype)
    if dtype is None:
        raise Fp8ExportError(
            f"{where} has dtype {t.dtype}, which fp8export does not read. Convert it to "
            "bfloat16/float16/float32 first.")
    if t.numel() == 0:
        return dtype
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1)
    reach = 1
    for st, sz in dims:
        if st < reach:
            raise Fp8ExportError(
                f"{where} has shape {tuple(t.shape)} with strides {t.stride()}: its elements "
                "overlap (a stride-0 or overlapping view), so the file holds far fewer values "
                "than the shape says. Refused; save tensor.contiguous() instead.")
        reach = st * sz
    stored = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    if t.numel() * t.element_size() > stored:
        raise Fp8ExportError(f"{where} needs {t.numel() * t.element_size()} bytes but its "
                             f"storage holds {stored}; the file is corrupt.")
    return dtype


def unwrap(obj: Any, path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensors of a (possibly wrapped or nested) state dict, and notes on what was skipped."""
    import torch

    notes: list[str] = []
    while (isinstance(obj, dict) and not any(isinstance(v, torch.Tensor) for v in obj.values())
           and (key := next((k for k in WRAPPER_KEYS if isinstance(obj.get(k), dict)), None))):
        others = [str(k) for k in obj if k != key]
        notes.append(f"{path.name}: using the state dict under {key!r}"
                     + (f"; ignoring {', '.join(others)}" if others else ""))
        obj = obj[key]
    if not isinstance(obj, dict):
        raise Fp8ExportError(f"{path}: holds a {type(obj).__name__}, not a state dict of tensors. "
                             "Save model.state_dict() instead of the model or a list.")
    tensors: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    _flatten(obj, path, tensors, ignored)
    if ignored:
        more = f" and {len(ignored) - 8} more" if len(ignored) > 8 else ""
        shown = ", ".join(ignored[:8]) + more
        notes.append(f"{path.name}: ignored non-tensor entries: {shown}")
    if not tensors:
        raise Fp8ExportError(f"{path}: contains no tensors (keys: "
                             f"{', '.join(map(str, list(obj)[:8]))}). Give the model's state dict.")
    # DataParallel/DDP prefix every name with "module."; the model's own names have none.
    if all(k.startswith("module.") for k in tensors):
        tensors = {k[len("module."):]: v for k, v in tensors.items()}
        notes.append(f"{path.name}: stripped the 'module.' prefix (DataParallel) from every name")
    extra = [k for k in tensors if k.endswith("_extra_state")]
    if extra:
        raise Fp8ExportError(f"{path}: has {extra[0]!r}. {TE_HINT}")
    return tensors, notes


class TorchFile:
    """One torch state-dict file, loaded (memory-mapped) once; ``load`` returns one tensor."""

    def __init__(self, path: Path):
        self.path = path
        self._tensors, self.notes = unwrap(load_state_dict(path), path)
        self.tensors: list[TensorInfo] = []
        for name, t in self._tensors.items():
            dtype = check_tensor(t, name, path)
            self.tensors.append(TensorInfo(name=name, dtype=dtype, shape=tuple(t.shape), file=path))

    def load(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def close(self) -> None:
        self._tensors = {}
