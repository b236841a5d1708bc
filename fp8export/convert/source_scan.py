"""One read of every safetensors source file: its sha256 and the amax of each selected weight.

Each file is read front to back in pieces of at most :data:`PIECE` bytes into one reused
buffer (positional reads of a file the guarded reader already validated); every piece updates
the file's sha256 and, when it belongs to a selected weight, that weight's running max|x|.
The sha256 is the one the manifest records and ``sha256sum`` prints (``verify`` compares it
with the reference's files), so it must be sha256 and must see the bytes in file order: a
file is therefore the unit of work, and ``workers`` files are scanned at once.

Only what :func:`fast_path_files` accepts comes here (every tensor in validated safetensors
files, no other weight file); anything else goes through the general reader.

This module needs no torch: :func:`start_early_scan` starts the reading in background threads
before the convert pipeline imports torch (about a second of start-up that the reading then
overlaps), and :func:`scan_sources` takes its results when they describe the same files.
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


@dataclass(frozen=True)
class SourceScan:
    sha256: dict[Path, str]  # every source file (weights and index)
    amax: dict[str, float]  # selected weight name -> max|x| (NaN when it holds NaN)


def _scan_file(path: Path, fd: int, spans: dict[str, tuple[int, int]], data_start: int,
               dtypes: dict[str, str], timings: Timings,
               stop: threading.Event) -> tuple[str, dict[str, float]]:
    """sha256 of the file and the amax of every float tensor in it (names in ``dtypes``)."""
    h = hashlib.sha256()
    amax: dict[str, float] = {}
    view = np.empty(PIECE, dtype=np.uint8)
    size = os.fstat(fd).st_size
    # The header, then every tensor in data order: safetensors tiles the file exactly
    # (checked when the header was read), so this is the whole file, in order.
    ranges = [(None, 0, data_start)] + sorted(
        ((name, b, e) for name, (b, e) in spans.items()), key=lambda r: r[1])
    if ranges[-1][2] != size:
        raise Fp8ExportError(f"{path}: its size changed while converting ({size} bytes now); "
                             "convert a checkpoint that nothing else is writing.")
    for name, begin, end in ranges:
        dtype = dtypes.get(name)
        item = _FLOAT_BITS[dtype][2] // 8 if dtype is not None else 1
        step = PIECE // item * item
        mag = 0
        for off in range(begin, end, step):
            if stop.is_set():
                return "", {}
            n = min(step, end - off)
            with timings.clock("scan: read source", n):
                got = pread_exact(fd, view[:n], off)
            if got != n:
                raise Fp8ExportError(f"{path}: cut short at byte {off + got} while reading "
                                     f"{name or 'the header'}; the file changed while converting "
                                     "or is truncated: re-download it.")
            with timings.clock("scan: sha256 of source", n):
                h.update(view[:n])
            if dtype is not None:
                with timings.clock("scan: amax", n):
                    mag = max(mag, _magnitude_bits(view[:n], dtype))
        if dtype is not None:
            amax[name] = _bits_to_amax(mag, dtype)
    return h.hexdigest(), amax


def _float_dtypes(infos) -> dict[str, str]:
    return {i.name: i.dtype for i in infos if i.dtype in _FLOAT_BITS}


def _identity(fd: int) -> tuple[int, int, int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class EarlyScan:
    """:func:`_scan_file` of every safetensors weight file of a checkpoint, started in
    background threads; ``take(path, fd)`` waits for one file's result, which counts only when
    that file is still the one ``fd`` (the pipeline's own validated descriptor) has open."""

    def __init__(self, files: list[Path], workers: int):
        self.timings = Timings()
        self.stop = threading.Event()
        self._pool = ThreadPoolExecutor(max(1, workers), "fp8export-scan")
        self._jobs = {}
        for path in sorted(files, key=lambda p: -os.path.getsize(p)):
            self._jobs[path] = self._pool.submit(self._one, path)

    def _one(self, path: Path):
        import stat

        infos, _meta, spans, data_start = read_header_spans(path)  # validated, guarded
        # Non-blocking and checked again on the descriptor: never a FIFO swapped in meanwhile.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise Fp8ExportError(f"{path}: not a regular file")
            ident = _identity(fd)
            sha, amax = _scan_file(path, fd, spans, data_start, _float_dtypes(infos),
                                   self.timings, self.stop)
            return ident, sha, amax
        finally:
            os.close(fd)

    def take(self, path: Path, fd: int) -> tuple[str, dict[str, float]] | None:
        job = self._jobs.get(path)
        if job is None:
            return None
        try:
            ident, sha, amax = job.result()
        except Exception:  # the pipeline reads the file itself and reports any problem
            return None
        return (sha, amax) if ident == _identity(fd) and sha else None

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


def scan_sources(ckpt: Checkpoint, files: dict[Path, SafetensorsFile], weights: Iterable[str],
                 *, workers: int, timings: Timings, early: EarlyScan | None = None,
                 on_file: Callable[[], None] | None = None) -> SourceScan:
    """sha256 of every source file and amax of every weight in ``weights``, ``workers`` files
    at a time (largest first, so the last file to finish is a small one); files that
    ``early`` already read are taken from it."""
    wanted = set(weights)
    stop = threading.Event()
    order = sorted(files.values(), key=lambda st: -os.path.getsize(st.path))
    sha: dict[Path, str] = {}
    amax: dict[str, float] = {}
    with ThreadPoolExecutor(max(1, workers), "fp8export-scan") as pool:
        futures = {}
        for st in order:
            done = early.take(st.path, st.fileno()) if early is not None else None
            if done is not None:
                futures[st] = done
            else:
                dtypes = {n: d for n, d in _float_dtypes(st.tensors).items() if n in wanted}
                futures[st] = pool.submit(_scan_file, st.path, st.fileno(), st.spans,
                                          st.data_start, dtypes, timings, stop)
        try:
            for st, fut in futures.items():
                sha[st.path], found = fut if isinstance(fut, tuple) else fut.result()
                amax.update({n: a for n, a in found.items() if n in wanted})
                if on_file is not None:
                    on_file()
        except BaseException:
            stop.set()
            raise
    if early is not None:
        timings.merge(early.timings)
    from fp8export.io.hashing import file_sha256

    for p in ckpt.source_files:  # the index (not a weight file): small, read whole
        if p not in sha:
            with timings.clock("scan: sha256 of source", p.stat().st_size):
                sha[p] = file_sha256(p)
    return SourceScan(sha256=sha, amax=amax)
