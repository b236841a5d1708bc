"""Reading the safetensors source files for convert: the amax of each selected weight, read
before anything is written, and the sha256 of files the writer does not hash itself.

The amax needs the weights only (their byte spans, read in pieces of at most :data:`PIECE`
bytes into one reused buffer); the writer needs it before it quantizes. The sha256 is the one
the manifest records and ``sha256sum`` prints (``verify`` compares it with the reference's
files), so it must be sha256 and see the whole file in order. Nothing needs it before the
manifest, and the parallel writer reads every source byte anyway, so it hashes each file from
those reads (``fp8dir/parallel_write.py``): one read of the source for writing and hashing,
where a separate hashing pass cost a third of convert's CPU time (bench/results/convert.md).
:func:`source_sha256` hashes what the writer did not (a file whose tensors are not stored in
header order, the index) and, when a check needs them before writing, all of them.

Only what :func:`fast_path_files` accepts comes here (every tensor in validated safetensors
files, no other weight file); anything else goes through the general reader.

This module needs no torch: :func:`start_early_scan` starts the amax reading in background
threads before the convert pipeline imports torch (about a second of start-up that the reading
then overlaps), and :func:`scan_sources` takes its results when they describe the same files.
The amax comes from the bit patterns: for IEEE-style floats, a larger magnitude is a larger
unsigned pattern once the sign is set aside, so max|x| is the larger of the largest pattern
among positives (a signed max) and among negatives (an unsigned max, minus the sign bit);
a pattern above the exponent-all-ones one is NaN, equal to it is inf. Two vectorised integer
reductions, exact, with the same result as ``max(-min(x), max(x))`` in floating point.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fp8export._timings import Timings
from fp8export.checkpoint.safetensors_reader import (
    SafetensorsFile,
    pread_exact,
    read_header_spans,
)
from fp8export.checkpoint.source import Checkpoint
from fp8export.errors import Fp8ExportError

PIECE = 16 << 20  # bytes per read: large enough for few syscalls, small enough to stay cheap


def default_workers() -> int:
    """All cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def fast_path_files(ckpt: Checkpoint) -> dict[Path, SafetensorsFile] | None:
    """The validated safetensors file behind every weight file of ``ckpt``, or None when any
    weight file is something else (a torch pickle, Keras, Transformer Engine state)."""
    files = ckpt.safetensors_files() if hasattr(ckpt, "safetensors_files") else None
    return None if files is None else {f.path: f for f in files}


# dtype -> (signed view, unsigned view, bits, exponent-all-ones pattern)
_FLOAT_BITS = {"BF16": (np.int16, np.uint16, 16, 0x7F80), "F16": (np.int16, np.uint16, 16, 0x7C00),
               "F32": (np.int32, np.uint32, 32, 0x7F800000),
               "F64": (np.int64, np.uint64, 64, 0x7FF0000000000000)}


def _magnitude_bits(raw: np.ndarray, dtype: str) -> int:
    """The largest |x| of ``raw`` (uint8, whole elements) as a sign-less bit pattern."""
    signed, unsigned, bits, _ = _FLOAT_BITS[dtype]
    if not len(raw):
        return 0
    top = 1 << (bits - 1)
    pos = int(raw.view(signed).max())  # largest pattern with the sign clear, if any
    neg = int(raw.view(unsigned).max())  # >= top when any sign is set: top + largest magnitude
    return max(pos if pos > 0 else 0, neg - top if neg >= top else 0)


def _bits_to_amax(m: int, dtype: str) -> float:
    signed, unsigned, bits, inf = _FLOAT_BITS[dtype]
    if m > inf:
        return math.nan
    if dtype == "BF16":
        return float(np.array([m << 16], dtype=np.uint32).view(np.float32)[0])
    float_type = {"F16": np.float16, "F32": np.float32, "F64": np.float64}[dtype]
    return float(np.array([m], dtype=unsigned).view(float_type)[0])


def _cut_short(path: Path, at: int, what: str) -> Fp8ExportError:
    return Fp8ExportError(f"{path}: cut short at byte {at} while reading {what}; the file "
                          "changed while converting or is truncated: re-download it.")


def _check_size(path: Path, fd: int, expected: int) -> None:
    size = os.fstat(fd).st_size
    if size != expected:
        raise Fp8ExportError(f"{path}: its size changed while converting ({size} bytes now); "
                             "convert a checkpoint that nothing else is writing.")


_LOCAL = threading.local()


def _piece_buffer() -> np.ndarray:
    """This thread's read buffer, reused from file to file (fresh pages cost a fault each)."""
    if getattr(_LOCAL, "piece", None) is None:
        _LOCAL.piece = np.empty(PIECE, dtype=np.uint8)
    return _LOCAL.piece


def _amax_file(path: Path, fd: int, spans: dict[str, tuple[int, int]], end: int,
               dtypes: dict[str, str], timings: Timings,
               stop: threading.Event) -> dict[str, float] | None:
    """The amax of every float tensor named in ``dtypes`` (only their bytes are read); None
    when ``stop`` was set. ``end``: the file's size, as its header says (safetensors tiles the
    file exactly, checked when the header was read)."""
    _check_size(path, fd, end)
    amax: dict[str, float] = {}
    view = _piece_buffer()
    for name, (begin, stop_at) in sorted(((n, spans[n]) for n in dtypes), key=lambda r: r[1][0]):
        dtype = dtypes[name]
        item = _FLOAT_BITS[dtype][2] // 8
        step = PIECE // item * item
        mag = 0
        for off in range(begin, stop_at, step):
            if stop.is_set():
                return None
            n = min(step, stop_at - off)
            with timings.clock("scan: read source", n):
                got = pread_exact(fd, view[:n], off)
            if got != n:
                raise _cut_short(path, off + got, name)
            with timings.clock("scan: amax", n):
                mag = max(mag, _magnitude_bits(view[:n], dtype))
        amax[name] = _bits_to_amax(mag, dtype)
    return amax


def _sha256_fd(path: Path, fd: int, size: int, timings: Timings,
               stop: threading.Event) -> str | None:
    """sha256 of the ``size`` bytes of ``fd`` (positional reads); None when ``stop`` was set."""
    h = hashlib.sha256()
    view = _piece_buffer()
    for off in range(0, size, len(view)):
        if stop.is_set():
            return None
        n = min(len(view), size - off)
        with timings.clock("hash: read source", n):
            got = pread_exact(fd, view[:n], off)
        if got != n:
            raise _cut_short(path, off + got, "it for its sha256")
        with timings.clock("hash: sha256 of source", n):
            h.update(view[:n])
    if os.fstat(fd).st_size != size:
        raise Fp8ExportError(f"{path}: its size changed while converting; convert a checkpoint "
                             "that nothing else is writing.")
    return h.hexdigest()


def _float_dtypes(infos) -> dict[str, str]:
    return {i.name: i.dtype for i in infos if i.dtype in _FLOAT_BITS}


def _identity(fd: int) -> tuple[int, int, int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _open_regular(path: Path) -> int:
    # Non-blocking and checked on the descriptor: never a FIFO swapped in after validation.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Fp8ExportError(f"{path}: not a regular file")
    return fd


def source_sha256(files: Iterable[SafetensorsFile], other: Iterable[Path], *,
                  timings: Timings, done: dict[Path, str] | None = None) -> dict[Path, str]:
    """The sha256 of every source file: ``done`` (hashed while writing), each of ``files``
    not in it (through its validated descriptor), and the small ``other`` files (the index)."""
    from fp8export.io.hashing import file_sha256

    out = dict(done or {})
    never = threading.Event()
    for st in files:
        if st.path not in out:
            size = max((e for _, e in st.spans.values()), default=st.data_start)
            out[st.path] = _sha256_fd(st.path, st.fileno(), size, timings, never)
    for p in other:
        if p not in out:
            with timings.clock("hash: sha256 of source", p.stat().st_size):
                out[p] = file_sha256(p)
    return out


@dataclass(frozen=True)
class SourceScan:
    amax: dict[str, float]  # selected weight name -> max|x| (NaN when it holds NaN)


class EarlyScan:
    """The amax of every float tensor of every safetensors weight file, started in background
    threads before the pipeline imports torch. ``take(path, fd)`` waits for one file's amaxes,
    which count only when that file is still the one ``fd`` (the pipeline's own validated
    descriptor) has open."""

    def __init__(self, files: list[Path], workers: int):
        self.timings = Timings()
        self.stop = threading.Event()
        self._pool = ThreadPoolExecutor(max(1, workers), "fp8export-scan")
        self._jobs = {}
        for path in sorted(files, key=lambda p: -os.path.getsize(p)):
            self._jobs[path] = self._pool.submit(self._one, path)

    def _one(self, path: Path):
        infos, _meta, spans, data_start = read_header_spans(path)  # validated, guarded
        fd = _open_regular(path)
        try:
            ident = _identity(fd)
            end = max((e for _, e in spans.values()), default=data_start)
            amax = _amax_file(path, fd, spans, end, _float_dtypes(infos), self.timings,
                              self.stop)
            return ident, amax
        finally:
            os.close(fd)

    def take(self, path: Path, fd: int) -> dict[str, float] | None:
        job = self._jobs.get(path)
        if job is None:
            return None
        try:
            ident, amax = job.result()
        except Exception:  # the pipeline reads the file itself and reports any problem
            return None
        return amax if ident == _identity(fd) and amax is not None else None

    def close(self) -> None:
        self.stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)


def start_early_scan(checkpoint: Path, workers: int | None) -> EarlyScan | None:
    """Start reading a safetensors checkpoint (a folder or one file) before the pipeline has
    imported torch; None for anything else. Errors are left to the pipeline's own reading."""
    from fp8export.checkpoint.hf_folder import weight_files

    try:
        path = Path(checkpoint)
        if path.is_dir():
            fmt, files, _index, _map = weight_files(path)
        elif path.is_file() and path.suffix == ".safetensors":
            fmt, files = "safetensors", [path]
        else:
            return None
        if fmt != "safetensors":
            return None
    except (Fp8ExportError, OSError):
        return None
    return EarlyScan(files, workers or default_workers())


def scan_sources(files: dict[Path, SafetensorsFile], weights: Iterable[str], *, workers: int,
                 timings: Timings, early: EarlyScan | None = None,
                 on_file: Callable[[], None] | None = None) -> SourceScan:
    """The amax of every weight in ``weights``, ``workers`` files at a time (largest first, so
    the last file to finish is a small one); files that ``early`` already read are taken from
    it. Only the weights' bytes are read: the files' sha256 come from the writer's reads."""
    wanted = set(weights)
    stop = threading.Event()
    order = sorted(files.values(), key=lambda st: -os.path.getsize(st.path))
    amax: dict[str, float] = {}
    with ThreadPoolExecutor(max(1, workers), "fp8export-scan") as pool:
        futures = {}
        for st in order:
            done = early.take(st.path, st.fileno()) if early is not None else None
            if done is not None:
                futures[st] = done
            else:
                dtypes = {n: d for n, d in _float_dtypes(st.tensors).items() if n in wanted}
                end = max((e for _, e in st.spans.values()), default=st.data_start)
                futures[st] = pool.submit(_amax_file, st.path, st.fileno(), st.spans, end,
                                          dtypes, timings, stop)
        try:
            for st, fut in futures.items():
                found = fut if isinstance(fut, dict) else fut.result()
                amax.update({n: a for n, a in found.items() if n in wanted})
                if on_file is not None:
                    on_file()
        except BaseException:
            stop.set()
            raise
    if early is not None:
        timings.merge(early.timings)
    return SourceScan(amax=amax)
