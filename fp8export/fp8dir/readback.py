"""Read the written FP8 folder back before publishing it, and fail loudly on any defect: the one
read-back of both writers, with a policy (:class:`~fp8export.config.ReadBack`).

Common to every policy: each output shard is reopened from disk, its header validated again
(``read_header_spans``: JSON, dtypes, shapes, offsets tiling the data area exactly, file size)
and the file opened with the real ``safetensors.safe_open``, which reports each tensor's dtype
and shape. Checked: the tensor names are exactly those planned, each dtype and shape is as
planned (F8_E4M3 weights, F32 scales), every scale read from disk is finite, > 0 and equal to
the scale we computed, every quantized weight's SQNR (computed while quantizing, from all of
its FP8 values) is at least :data:`MIN_WEIGHT_SQNR_DB`, and the index (when sharded) maps every
tensor to the shard that holds it. All problems are collected into one Fp8ExportError.

``ReadBack.FULL`` (the general writer's only mode, :func:`verify_output`; on request for the
parallel writer): every byte is read from the file. The general writer records a sha256 of
every tensor's bytes as handed to the file (:class:`~fp8export.fp8dir.write.WriteRecord`) and
each tensor read back must match its digest; the parallel writer records the sha256 of each
whole file, and the file read back must match it. Either way a weight that matches carries
exactly the FP8 values its SQNR was computed from, and any flipped byte, truncation or
misplaced tensor fails. Without a record (``record=None``: a caller that did not write the
folder itself), each weight's SQNR is recomputed from the source checkpoint and the bytes read
back, the slower reference path.

``ReadBack.SAMPLED`` (the parallel writer's default, :func:`verify_parallel_output`): from every
tensor, three 4 KiB samples (start, middle, end) are read from disk (``O_DIRECT`` where allowed:
from the device, not the page cache) and compared with the source: copied bytes must be equal,
FP8 bytes must equal an independent elementwise quantization of the same source elements
(``numerics.lut.quantize_values``, not the table the writer used). A defect outside the samples
goes unseen; measured on the 2.1 GB benchmark, full read-back costs an extra pass over the
output (``bench/convert.py``, stage "read-back"). ``FULL`` on the parallel writer adds the
whole-file check to the samples.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from fp8export.checkpoint.safetensors_reader import (
    SafetensorsFile,
    pread_exact,
    read_header_spans,
)
from fp8export.checkpoint.source import Checkpoint
from fp8export.config import ReadBack
from fp8export.errors import Fp8ExportError
from fp8export.fp8dir.write import INDEX_NAME, ShardPlan, WriteRecord, index_json, scale_of
from fp8export.io import safetensors_dtypes
from fp8export.io.hashing import digest
from fp8export.io.safetensors_dtypes import ST_BYTES
from fp8export.numerics import lut
from fp8export.numerics.block import blocks_roundtrip_sqnr
from fp8export.numerics.channel import channels_roundtrip_sqnr
from fp8export.scales.weights import MIN_WEIGHT_SQNR_DB, roundtrip_sqnr

if TYPE_CHECKING:  # torch is imported where a function needs it (lazily: convert's
    pass  # default path runs without it)

_MAX_LISTED = 10
SAMPLE = 4096  # bytes per read-back sample
_NP_FLOAT = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64}


def verify_output(out_dir: Path, plans: list[ShardPlan], ckpt: Checkpoint,
                  weight_scales: dict[str, np.float32], input_scales: dict[str, np.float32],
                  *, record: WriteRecord | None = None,
                  min_sqnr_db: float = MIN_WEIGHT_SQNR_DB,
                  early: dict[str, Future] | None = None,
                  kv_scales: dict[str, np.float32] | None = None,
                  block: tuple[int, int] | None = None) -> dict[str, float]:
    """Check ``out_dir`` against the plan; return the SQNR (dB) of each module read back.

    With ``record`` (what :func:`~fp8export.fp8dir.write.write_shards` returned), every
    tensor's bytes on disk must have the digest recorded when they were written, and the SQNRs
    are the recorded ones; without it, SQNRs are recomputed from ``ckpt``. ``early`` maps shard
    names to the result of :func:`verify_shard` already started on them (e.g. in a thread as
    soon as each shard was fsynced); the others are checked here.
    """
    problems: list[str] = []
    sqnr: dict[str, float] = {}
    for plan in plans:
        if early is not None and plan.file_name in early:
            found, values = early[plan.file_name].result()
        else:
            found, values = verify_shard(out_dir, plan, ckpt, weight_scales, input_scales,
                                         record=record, min_sqnr_db=min_sqnr_db,
                                         kv_scales=kv_scales, block=block)
        problems.extend(found)
        sqnr.update(values)
    index = out_dir / INDEX_NAME
    if len(plans) > 1:
        problems.extend(_check_index(index, plans))
    elif index.exists():
        problems.append(f"{INDEX_NAME}: present, but the output has a single shard")
    raise_problems(problems)
    return sqnr


def raise_problems(problems: list[str]) -> None:
    """The one read-back failure: every defect found (the first few named), and the fix."""
    if not problems:
        return
    shown = "; ".join(problems[:_MAX_LISTED])
    more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
    raise Fp8ExportError(
        f"read-back verification of the FP8 output failed, so nothing was written: {shown}"
        f"{more}. A weight with low SQNR has outliers FP8 cannot hold per-tensor: leave it "
        "in high precision with --exclude (or, for a q/k/v or gate/up member whose siblings "
        "are much larger, give it its own scale with --no-fuse-scales); any other failure "
        "is a bug or a failing disk.")


def verify_shard(out_dir: Path, plan: ShardPlan, ckpt: Checkpoint,
                 weight_scales: dict[str, np.float32], input_scales: dict[str, np.float32], *,
                 record: WriteRecord | None = None, min_sqnr_db: float = MIN_WEIGHT_SQNR_DB,
                 kv_scales: dict[str, np.float32] | None = None,
                 block: tuple[int, int] | None = None,
                 ) -> tuple[list[str], dict[str, float]]:
    """Read one written shard back (see the module docstring): (problems, module -> SQNR)."""
    sqnr: dict[str, float] = {}
    return _verify_shard(out_dir / plan.file_name, plan, ckpt, weight_scales, input_scales,
                         record, min_sqnr_db, sqnr, kv_scales, block), sqnr


def _verify_shard(path: Path, plan: ShardPlan, ckpt: Checkpoint,
                  weight_scales: dict[str, np.float32], input_scales: dict[str, np.float32],
                  record: WriteRecord | None, min_sqnr_db: float,
                  sqnr: dict[str, float], kv_scales: dict | None = None,
                  block: tuple[int, int] | None = None) -> list[str]:
    import torch
    from safetensors import SafetensorError, safe_open

    fname = plan.file_name
    try:
        _infos, _meta, spans, _start = read_header_spans(path)
        with safe_open(str(path), framework="pt", device="cpu") as f:  # the real reader's view
            found = {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape()))
                     for name in f.keys()}
    except (Fp8ExportError, SafetensorError, OSError) as exc:
        return [f"{fname}: cannot be reopened ({exc})"]
    problems: list[str] = []
    planned = {e.tensor.name: e for e in plan.entries}
    missing = sorted(set(planned) - set(found))
    extra = sorted(set(found) - set(planned))
    if missing or extra:
        problems.append(f"{fname}: tensors differ from the plan "
                        f"(missing {missing[:3]}, unexpected {extra[:3]})")
    digests = record.digests.get(fname, {}) if record is not None else None
    disk_scale: dict[str, Any] = {}  # module -> weight scale(s) as read from disk
    disk = _DiskReader(path)
    try:
        # Scales first (a weight's SQNR uses its scale as read from disk), then the rest.
        order = sorted(planned.values(), key=lambda e: e.kind == "weight")
        for entry in order:
            name = entry.tensor.name
            if name not in found or name not in spans:
                continue
            dtype, shape = found[name]
            if dtype != entry.tensor.dtype or shape != entry.tensor.shape:
                problems.append(f"{fname}: {name} is {dtype} {list(shape)}, expected "
                                f"{entry.tensor.dtype} {list(entry.tensor.shape)}")
                continue
            begin, end = spans[name]
            raw = disk.read(begin, end)
            if raw is None:
                problems.append(f"{fname}: {name} is cut short on disk")
                continue
            if digests is not None and digests.get(name) != digest(raw.numpy()):
                problems.append(f"{fname}: the bytes of {name} on disk differ from those "
                                "written (digest mismatch)")
            if entry.kind in ("weight_scale", "input_scale", "kv_scale"):
                values = (raw.view(torch.float8_e8m0fnu).float() if dtype == "F8_E8M0"
                          else raw.view(torch.float32)).numpy().copy()
                want = np.asarray(scale_of(entry, weight_scales, input_scales, kv_scales),
                                  dtype=np.float32).reshape(-1)
                value = float(values[0]) if values.size == 1 else values
                if not (np.all(np.isfinite(values)) and np.all(values > 0.0)):
                    bad = float(values[~(np.isfinite(values) & (values > 0.0))][0])
                    problems.append(f"{fname}: {name} = {bad} is not a finite positive scale")
                elif values.size == 1 and want.size == 1 and value != float(want[0]):
                    problems.append(f"{fname}: {name} = {value!r} but {float(want[0])!r} was "
                                    "computed")
                elif not np.array_equal(values, want):
                    problems.append(f"{fname}: {name} differs from the per-channel scales that "
                                    "were computed")
                if entry.kind == "weight_scale":
                    disk_scale[entry.source] = values.reshape(shape) if block is not None \
                        else value
            elif entry.kind == "weight":
                problem = _check_weight(entry, raw, disk_scale, ckpt, record, min_sqnr_db, sqnr,
                                        fname, block)
                if problem:
                    problems.append(problem)
            del raw
    finally:
        disk.close()
    return problems


_ALIGN = 4096


class _DiskReader:
    """Reads byte ranges of a written shard into one reused buffer, with ``O_DIRECT`` where
    the file system allows it: the bytes come from the device, not from pages cached while
    writing, and no page cache is filled for them. Elsewhere, ordinary positional reads.
    ``read`` returns a uint8 tensor valid until the next call, or None when the file ends
    first."""

    def __init__(self, path: Path):
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        self.fd = os.open(path, flags)
        self.direct = None
        if hasattr(os, "O_DIRECT"):
            try:
                self.direct = os.open(path, flags | os.O_DIRECT)
            except OSError:
                self.direct = None
        self._map = None
        self._buf = None

    def _buffer(self, size: int):
        import mmap

        if self._map is None or len(self._map) < size:
            self._release()
            self._map = mmap.mmap(-1, max(size, _ALIGN))  # page-aligned, as O_DIRECT needs
        return self._map

    def read(self, begin: int, end: int):
        import torch


        n = end - begin
        if n == 0:  # an empty tensor: nothing to read (frombuffer refuses a count of 0)
            return torch.empty(0, dtype=torch.uint8)
        if self.direct is not None:
            start = begin - begin % _ALIGN
            length = -(-(end - start) // _ALIGN) * _ALIGN
            buf = self._buffer(length)
            try:
                got = pread_exact(self.direct, memoryview(buf)[:length], start)
            except OSError:  # EINVAL: direct reads refused here after all
                os.close(self.direct)
                self.direct = None
            else:
                if got < end - start:
                    return None
                return torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=begin - start)
        if self._buf is None or self._buf.numel() < n:
            self._buf = None
            self._buf = torch.empty(n, dtype=torch.uint8)
        raw = self._buf[:n]
        return raw if pread_exact(self.fd, raw.numpy(), begin) == n else None

    def _release(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still held: let GC unmap it
                pass
            self._map = None

    def close(self) -> None:
        for fd in (self.fd, self.direct):
            if fd is not None:
                os.close(fd)
        self.fd = self.direct = None
        self._release()
        self._buf = None


def _check_weight(entry, raw, disk_scale: dict[str, Any], ckpt: Checkpoint,
                  record: WriteRecord | None, min_sqnr_db: float, sqnr: dict[str, float],
                  fname: str, block: tuple[int, int] | None = None) -> str | None:
    name = entry.tensor.name
    module = name[: -len(".weight")]
    scale = disk_scale.get(module)
    if scale is None or not (np.all(np.isfinite(scale)) and np.all(np.asarray(scale) > 0.0)):
        return None  # reported with the scale itself
    if record is not None:
        value = record.sqnr.get(module)
        if value is None:
            return f"{name}: no SQNR was recorded when it was written"
    else:
        q = raw.view(safetensors_dtypes.ST_TO_TORCH["F8_E4M3"]).reshape(entry.tensor.shape)
        if np.ndim(scale) == 2:
            value = blocks_roundtrip_sqnr(ckpt.load(entry.source), q, scale, block)
        elif np.ndim(scale):
            value = channels_roundtrip_sqnr(ckpt.load(entry.source), q, scale, entry.layout)
        else:
            value = roundtrip_sqnr(ckpt.load(entry.source), q, scale)
    sqnr[module] = value
    if not value >= min_sqnr_db:
        return (f"{name}: the FP8 weight read back from {fname} has SQNR {value:.1f} dB against "
                f"the source (minimum {min_sqnr_db:.0f} dB)")
    return None


def _check_index(index: Path, plans: list[ShardPlan]) -> list[str]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{INDEX_NAME}: unreadable ({exc})"]
    want = {e.tensor.name: p.file_name for p in plans for e in p.entries}
    if weight_map != want:
        wrong = sorted(k for k in set(want) | set(weight_map) if weight_map.get(k) != want.get(k))
        return [f"{INDEX_NAME}: weight_map disagrees with the shards for {wrong[:3]}"]
    return []


# --- the parallel writer's output: sampled, or full --------------------------------------


def _sample_ranges(nbytes: int, itemsize: int) -> list[tuple[int, int]]:
    """Start, middle and end of a tensor's bytes, SAMPLE bytes each (element-aligned)."""
    if nbytes <= 3 * SAMPLE:
        return [(0, nbytes)] if nbytes else []
    mid = (nbytes // 2) // itemsize * itemsize
    return [(0, SAMPLE), (mid, mid + SAMPLE), (nbytes - SAMPLE, nbytes)]


class _DeviceReader:
    """Byte ranges of a written file, read with ``O_DIRECT`` where the file system allows it
    (the bytes the device holds, not pages cached while writing), else ordinary reads."""

    CHUNK = 16 << 20  # of the whole-file hash

    def __init__(self, path: Path):
        import mmap

        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.direct = None
        if hasattr(os, "O_DIRECT"):
            try:
                self.direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                self.direct = None
        self.buf = mmap.mmap(-1, 4 * _ALIGN)  # page-aligned, as O_DIRECT needs

    def read(self, begin: int, end: int) -> bytes | None:
        if self.direct is not None:
            start = begin - begin % _ALIGN
            length = -(-(end - start) // _ALIGN) * _ALIGN
            try:
                got = pread_exact(self.direct, memoryview(self.buf)[:length], start)
            except OSError:
                os.close(self.direct)
                self.direct = None
            else:
                return self.buf[begin - start:end - start] if got >= end - start else None
        out = bytearray(end - begin)
        return bytes(out) if pread_exact(self.fd, out, begin) == end - begin else None

    def sha256(self, size: int) -> str | None:
        """sha256 of the file's first ``size`` bytes; None when it is shorter."""
        import hashlib
        import mmap

        h = hashlib.sha256()
        big = mmap.mmap(-1, self.CHUNK)  # page-aligned, as O_DIRECT needs
        try:
            view = memoryview(big)
            for off in range(0, size, self.CHUNK):
                n = min(self.CHUNK, size - off)
                want = -(-n // _ALIGN) * _ALIGN if self.direct is not None else n
                fd = self.direct if self.direct is not None else self.fd
                try:
                    got = pread_exact(fd, view[:want], off)
                except OSError:  # O_DIRECT refused after all: ordinary reads from here on
                    if self.direct is None:
                        raise
                    os.close(self.direct)
                    self.direct = None
                    got = pread_exact(self.fd, view[:n], off)
                if got < n:
                    return None
                h.update(view[:n])
            view.release()
        finally:
            big.close()
        return h.hexdigest()

    def close(self) -> None:
        for fd in (self.fd, self.direct):
            if fd is not None:
                os.close(fd)
        self.buf.close()


def _verify_parallel_shard(path: Path, plan: ShardPlan, where: dict[str, SafetensorsFile],
                           weight_scales: dict, input_scales: dict, record: Any,
                           min_sqnr_db: float, policy: ReadBack) -> list[str]:
    from safetensors import SafetensorError, safe_open

    fname = plan.file_name
    try:
        _infos, _meta, spans, _start = read_header_spans(path)
        with safe_open(str(path), framework="numpy") as f:
            found = {n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape()))
                     for n in f.keys()}
    except (Fp8ExportError, SafetensorError, OSError) as exc:
        return [f"{fname}: cannot be reopened ({exc})"]
    planned = {e.tensor.name: e for e in plan.entries}
    if set(found) != set(planned):
        missing, extra = sorted(set(planned) - set(found)), sorted(set(found) - set(planned))
        return [f"{fname}: tensors differ from the plan (missing {missing[:3]}, unexpected "
                f"{extra[:3]})"]
    problems: list[str] = []
    disk = _DeviceReader(path)
    try:
        if policy is ReadBack.FULL:
            size = max(end for _b, end in spans.values()) if spans else _start
            got = disk.sha256(size)
            if got is None:
                problems.append(f"{fname}: cut short on disk")
            elif got != record.files.get(fname):
                problems.append(f"{fname}: the bytes on disk differ from those written (its "
                                "sha256 differs from the one taken while writing)")
        for name, entry in planned.items():
            dtype, shape = found[name]
            if (dtype, shape) != (entry.tensor.dtype, entry.tensor.shape):
                problems.append(f"{fname}: {name} is {dtype} {list(shape)}, expected "
                                f"{entry.tensor.dtype} {list(entry.tensor.shape)}")
                continue
            begin, end = spans[name]
            if entry.kind in ("weight_scale", "input_scale"):
                raw = disk.read(begin, end)
                value = float(np.frombuffer(raw, dtype="<f4")[0]) if raw else math.nan
                want = float((weight_scales if entry.kind == "weight_scale"
                              else input_scales)[entry.source])
                if not (math.isfinite(value) and value > 0.0):
                    problems.append(f"{fname}: {name} = {value} is not a finite positive scale")
                elif value != want:
                    problems.append(f"{fname}: {name} = {value!r} but {want!r} was computed")
                continue
            st = where[entry.source]
            info = st.info(entry.source)
            itemsize = ST_BYTES[info.dtype]
            out_itemsize = 1 if entry.kind == "weight" else itemsize
            src_begin, _ = st.spans[entry.source]
            for a, b in _sample_ranges(end - begin, out_itemsize):
                got = disk.read(begin + a, begin + b)
                if got is None:
                    problems.append(f"{fname}: {name} is cut short on disk")
                    break
                k = itemsize // out_itemsize
                src = bytearray((b - a) * k)
                pread_exact(st.fileno(), src, src_begin + a * k)
                if entry.kind == "weight":
                    x = np.frombuffer(src, dtype=_NP_FLOAT[info.dtype]).astype(np.float32)
                    module = entry.source[: -len(".weight")]
                    # the elementwise reference arithmetic, not the table the writer used
                    want = lut.quantize_values(x, weight_scales[module])
                    if want.tobytes() != got:
                        problems.append(f"{fname}: the FP8 bytes of {name} on disk (bytes "
                                        f"{a}-{b}) differ from a fresh quantization of the "
                                        "source")
                        break
                elif bytes(src) != got:
                    problems.append(f"{fname}: the bytes of {name} on disk (bytes {a}-{b}) "
                                    "differ from the source")
                    break
            if entry.kind == "weight":
                module = entry.source[: -len(".weight")]
                value = record.sqnr.get(module)
                if value is None:
                    problems.append(f"{name}: no SQNR was recorded when it was written")
                elif not value >= min_sqnr_db:
                    problems.append(f"{name}: the FP8 weight in {fname} has SQNR {value:.1f} dB "
                                    f"against the source (minimum {min_sqnr_db:.0f} dB)")
    finally:
        disk.close()
    return problems


def verify_parallel_output(out_dir: Path, plans: list[ShardPlan],
                           where: dict[str, SafetensorsFile], weight_scales: dict,
                           input_scales: dict, record: Any, *, workers: int,
                           policy: ReadBack = ReadBack.SAMPLED,
                           min_sqnr_db: float = MIN_WEIGHT_SQNR_DB) -> dict[str, float]:
    """Read back what ``parallel_write.write_shards_parallel`` wrote (its ``record``: SQNRs and
    file digests); return the SQNR of each module. ``where`` maps source tensor names to their
    safetensors files. See the module docstring for what each ``policy`` reads.

    All problems are collected into one Fp8ExportError.
    """
    with ThreadPoolExecutor(max(1, workers), "fp8export-verify") as pool:
        results = list(pool.map(lambda p: _verify_parallel_shard(
            out_dir / p.file_name, p, where, weight_scales, input_scales, record, min_sqnr_db,
            policy), plans))
    problems = [p for found in results for p in found]
    index = out_dir / INDEX_NAME
    want = index_json(plans)
    if want is not None:
        try:
            got = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            got = None
            problems.append(f"{INDEX_NAME}: unreadable ({exc})")
        if got is not None and got != want:
            problems.append(f"{INDEX_NAME}: does not match the shards written")
    elif index.exists():
        problems.append(f"{INDEX_NAME}: present, but the output has a single shard")
    raise_problems(problems)
    return dict(record.sqnr)


def check_json_files(folder: Path, names: set[str]) -> None:
    """Every JSON file fp8export wrote (``names``: config, index, manifest, format files)
    parses back. Copies of the source's files are not ours to judge: they are carried byte for
    byte."""
    for path in sorted(folder / n for n in names if n.endswith(".json") and (folder / n).exists()):
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise Fp8ExportError(f"read-back of {path.name} failed ({exc}); nothing was "
                                 "written. This is a bug or a failing disk.") from exc
