"""Reading ``.safetensors`` files: header validation, then tensor-by-tensor positional reads.

``safe_open`` already rejects truncated files, non-JSON headers, offsets outside the data,
overlapping or gapped offsets, shape/dtype/byte-length mismatches and unknown dtypes (tried on
crafted files with safetensors 0.8). We still parse the header ourselves first, because:
- its messages do not say which tensor is wrong for a shape/length mismatch, nor what to do;
- it accepts headers up to 100 MB and dtypes torch has no use for here (C64, F4, F6_*);
  we cap the header at :data:`MAX_HEADER_BYTES` *before* reading it;
- it silently keeps the last of two duplicate names in a header.
The header is small (a few hundred bytes per tensor), so parsing it twice costs nothing.

Bulk data is not read through ``safe_open`` (which memory-maps the file: every page a load
touches stays in the process's RSS as file-backed memory until the handle closes, which for a
multi-GB shard is most of the shard). ``safe_open`` still opens each file once, on the first
load, as a second structural check of the header we validated; the tensor bytes are then read
with ``os.preadv`` at the offsets of that validated header into a fresh buffer, so each tensor
is ordinary anonymous memory, freed when the caller drops it. A short read (the file shrank
while we read it) is an error naming the file and tensor.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8export.checkpoint.source import MAX_DIM, MAX_RANK, TensorInfo
from fp8export.errors import Fp8ExportError
from fp8export.io.guarded import WEIGHTS, open_input, parse_json

if TYPE_CHECKING:
    import torch

# A header entry is ~100 bytes, so 16 MiB holds ~150k tensors — more than any one shard has.
MAX_HEADER_BYTES = 16 * 1024 * 1024

# safetensors dtype → bytes per element, for the dtypes fp8export reads: float sources, FP8
# (an FP8 folder; F8_E8M0: UE8M0 power-of-two block scales), integer/bool buffers (passed
# through).
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})


@dataclass(frozen=True)
class _Entry:
    info: TensorInfo
    begin: int
    end: int


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate name {key!r}")
        seen[key] = value
    return seen


def read_header(path: Path) -> tuple[list[TensorInfo], dict[str, str]]:
    """Validate the safetensors header of ``path``; return its tensors (in data order) and metadata.

    Raises Fp8ExportError naming the file (and tensor) for every defect listed in the module
    docstring. Reads only the header, never the tensor data.
    """
    infos, metadata, _spans, _start = read_header_spans(path)
    return infos, metadata


def read_header_spans(path: Path) -> tuple[list[TensorInfo], dict[str, str],
                                          dict[str, tuple[int, int]], int]:
    """:func:`read_header` plus each tensor's absolute ``(begin, end)`` byte span in the file
    and the offset where the data area starts."""
    try:
        with open_input(path, WEIGHTS) as f:  # a regular file: never a FIFO or a device
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise Fp8ExportError(
                    f"{path}: {size} bytes, too small to be a safetensors file (it needs an 8-byte "
                    "header length first). The file is truncated or not safetensors: re-download "
                    "or re-save it.")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise Fp8ExportError(
                    f"{path}: declares a {n}-byte header, over the {MAX_HEADER_BYTES}-byte limit "
                    "(real headers are a few hundred bytes per tensor). The file is corrupt or "
                    "hostile; refused without reading it.")
            if n > size - 8:
                raise Fp8ExportError(
                    f"{path}: declares a {n}-byte header but the file has only {size - 8} bytes "
                    "after the length. The file is truncated or not safetensors: re-download it.")
            raw = f.read(n)
    except OSError as exc:
        raise Fp8ExportError(f"{path}: cannot read ({exc.strerror}).") from exc
    try:
        header = parse_json(raw, path, "the safetensors header",
                            object_pairs_hook=_no_duplicate_keys)
    except Fp8ExportError as exc:
        raise Fp8ExportError(f"{exc} The file is corrupt: re-download or re-save it.") from exc
    if not isinstance(header, dict):
        raise Fp8ExportError(f"{path}: the safetensors header is not a JSON object; the file is "
                             "corrupt: re-download or re-save it.")
    data_size = size - 8 - n
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise Fp8ExportError(f"{path}: '__metadata__' must map strings to strings; the header is "
                             "corrupt: re-save the file.")
    entries = [_entry(path, name, spec) for name, spec in header.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    # safetensors requires the tensors to tile the data area exactly: no gaps, no overlap.
    cursor = 0
    for e in entries:
        if e.begin != cursor:
            what = "overlaps the previous tensor" if e.begin < cursor else "leaves a gap before it"
            raise Fp8ExportError(
                f"{path}: tensor {e.info.name!r} has data_offsets [{e.begin}, {e.end}] which "
                f"{what} (expected to start at {cursor}). The header lies about its offsets: the "
                "file is corrupt; re-download or re-save it.")
        cursor = e.end
    if cursor > data_size:
        last = entries[-1].info.name
        raise Fp8ExportError(
            f"{path}: tensor {last!r} ends at byte {cursor} of the data but the file holds only "
            f"{data_size} data bytes. The file is truncated: re-download or re-save it.")
    if cursor < data_size:
        raise Fp8ExportError(
            f"{path}: {data_size - cursor} bytes after the last tensor are not described by the "
            "header. The file is corrupt (or two files were concatenated): re-save it.")
    start = 8 + n
    spans = {e.info.name: (start + e.begin, start + e.end) for e in entries}
    return [e.info for e in entries], metadata, spans, start


def _entry(path: Path, name: str, spec: Any) -> _Entry:
    def bad(problem: str) -> Fp8ExportError:
        return Fp8ExportError(f"{path}: tensor {name!r}: {problem}. The header is corrupt: "
                              "re-download or re-save the file.")

    if not isinstance(spec, dict):
        raise bad("its header entry is not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad("missing 'dtype'")
    if dtype not in DTYPE_BYTES:
        raise Fp8ExportError(
            f"{path}: tensor {name!r} has dtype {dtype!r}, which fp8export does not read "
            f"(supported: {', '.join(DTYPE_BYTES)}). Convert it to BF16/F16/F32 first.")
    if (not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if any(d > MAX_DIM for d in shape) or len(shape) > MAX_RANK:
        # beside a 0 the byte count still matches (0 elements), but no reader or writer can
        # represent such a shape (an int64 overflows at 2^63)
        raise bad(f"shape {shape!r} has a dimension above 2^40 or more than {MAX_RANK} "
                  "dimensions; no real tensor has")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]):
        raise bad(f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
    info = TensorInfo(name=name, dtype=dtype, shape=tuple(shape), file=path)
    expected = info.numel * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != expected:
        raise bad(f"dtype {dtype} and shape {list(shape)} need {expected} bytes but its "
                  f"data_offsets {offsets} span {offsets[1] - offsets[0]}")
    return _Entry(info, offsets[0], offsets[1])


def pread_exact(fd: int, buf, offset: int) -> int:
    """Fill the writable buffer ``buf`` from ``fd`` at ``offset``; return the bytes read
    (fewer than ``len(buf)`` only at end of file)."""
    view = memoryview(buf).cast("B")
    done, n = 0, len(view)
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


class SafetensorsFile:
    """One validated ``.safetensors`` file; ``load`` reads a single tensor with positional reads."""

    def __init__(self, path: Path):
        self.path = path
        self.tensors, self.metadata, self.spans, self.data_start = read_header_spans(path)
        self._dtypes = {t.name: t for t in self.tensors}
        self._fd: int | None = None

    def info(self, name: str) -> TensorInfo:
        info = self._dtypes.get(name)
        if info is None:
            raise Fp8ExportError(f"{self.path}: no tensor named {name!r}.")
        return info

    def _open(self) -> int:
        if self._fd is None:
            from safetensors import SafetensorError, safe_open

            try:  # structural check only: no tensor is read through the mapping
                with safe_open(str(self.path), framework="numpy") as handle:
                    handle.keys()
                self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except SafetensorError as exc:
                raise Fp8ExportError(f"{self.path}: cannot be opened as safetensors ({exc}). "
                                     "The file is corrupt: re-download it.") from exc
        return self._fd

    def fileno(self) -> int:
        """The file's descriptor, for positional reads (opened once, after the structural check)."""
        return self._open()

    def read_raw(self, name: str, out=None) -> torch.Tensor:
        """The stored bytes of tensor ``name`` as a flat uint8 tensor (into ``out`` if given)."""
        import torch

        begin, end = self.spans[name]
        buf = torch.empty(end - begin, dtype=torch.uint8) if out is None else out
        try:
            got = pread_exact(self._open(), buf.numpy(), begin) if end > begin else 0
        except OSError as exc:
            raise Fp8ExportError(f"{self.path}: cannot read tensor {name!r} "
                                 f"({exc.strerror or exc}).") from exc
        if got != end - begin:
            raise Fp8ExportError(f"{self.path}: tensor {name!r} is cut short ({got} of "
                                 f"{end - begin} bytes). The file is truncated or changed while "
                                 "reading: re-download it.")
        return buf

    def load(self, name: str, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``name`` as stored. With ``scratch`` (a flat uint8 tensor at least as large
        as its bytes) it is read into that buffer instead of a new one: reusing one buffer
        saves faulting fresh pages in for every tensor."""
        from fp8export.io.safetensors_dtypes import ST_TO_TORCH

        info = self._dtypes.get(name)
        if info is None:
            raise Fp8ExportError(f"{self.path}: no tensor named {name!r}.")
        begin, end = self.spans[name]
        raw = self.read_raw(name, None if scratch is None else scratch[:end - begin])
        return raw.view(ST_TO_TORCH[info.dtype]).reshape(info.shape)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
