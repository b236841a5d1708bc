"""Write the FP8 shards with ``workers`` threads, tensor by tensor, into preallocated files.

Every output tensor's place is known before any data is produced: the plan fixes each shard's
header and so every tensor's byte range. So each shard is created at its final size with its
header in place, and the tensors become independent jobs that any worker may run in any
order: read the source tensor (positional reads), quantize it and compute its SQNR
(one thread per tensor, so the values do not depend on the number of workers), and ``pwrite``
the bytes at their offset; copied tensors are read into the same kind of buffer and written
the same way. The output is byte-identical whatever ``workers`` is.

The sha256 of each output file (the manifest's ``files``) is computed from these buffers, not
by reading the files again: jobs start in file order, and a tensor finished before the one in
front of it is parked until that one is hashed (``io.hashing.OrderedSha256``). The sha256 of
each source file (the manifest's ``source.files``) comes from the same reads, the same way,
for every source file whose tensors the plan lists in the order of their bytes (what
safetensors writes): each source byte is then read once for writing and hashing together (the
amax scan before it reads the weights only). A file in another order is hashed by the caller.

Memory: each worker holds a source buffer (the largest quantized weight it read) and an output
buffer (the largest output tensor it wrote: FP8 bytes or a copied tensor); besides, at most
max(64 MiB, the largest source or output tensor) of finished tensors parked for hashing, and as
much in spare buffers kept for reuse.

Read-back is ``readback.verify_parallel_output`` (sampled by default, or full).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fp8export._timings import Timings
from fp8export.checkpoint.safetensors_reader import (
    SafetensorsFile,
    pread_exact,
)
from fp8export.errors import Fp8ExportError
from fp8export.fp8dir.safetensors_writer import header_bytes
from fp8export.fp8dir.write import Planned, ShardPlan
from fp8export.io.atomic import OUTPUT_MODE
from fp8export.io.hashing import HashBudget, OrderedSha256
from fp8export.io.safetensors_dtypes import ST_BYTES
from fp8export.numerics import lut

_ALIGN = 4096


@dataclass
class ParallelRecord:
    sqnr: dict[str, float] = field(default_factory=dict)  # module -> dB, from all FP8 values
    files: dict[str, str] = field(default_factory=dict)  # output file -> sha256 of its bytes
    sources: dict[Path, str] = field(default_factory=dict)  # source file -> sha256 (see above)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set_sqnr(self, module: str, value: float) -> None:
        with self._lock:
            self.sqnr[module] = value


@dataclass(frozen=True)
class _Job:
    shard: int
    entry: Planned
    offset: int  # absolute offset of the tensor's bytes in the output file


def _size_class(size: int) -> int:
    """Buffers come in powers of two from 1 MiB: a spare then fits most later tensors."""
    return max(1 << 20, 1 << (max(size, 1) - 1).bit_length())


class _Held:
    """A worker's buffer and who still needs it: the worker and up to two hashers (the source
    file's and the output file's) that parked its bytes. Back to the pool when the last lets go."""

    __slots__ = ("buf", "refs")

    def __init__(self, buf: mmap.mmap):
        self.buf, self.refs = buf, 1


class _Buffers:
    """Page-aligned buffers (``O_DIRECT`` needs them) in power-of-two sizes. A worker's buffer
    whose bytes are parked for hashing leaves the worker and comes back here once hashed, for
    reuse (a fresh mapping costs a page fault per 4 KiB). The spare ones kept hold at most
    ``limit`` bytes (or one buffer)."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.limit = 64 << 20

    def get(self, size: int) -> mmap.mmap:
        size = _size_class(size)
        with self._lock:
            fits = [m for m in self._free if len(m) >= size]
            if fits:
                best = min(fits, key=len)
                self._free.remove(best)
                return best
        return mmap.mmap(-1, size)

    def put(self, buf: object) -> None:
        if isinstance(buf, mmap.mmap):
            with self._lock:
                self._free.append(buf)
                while len(self._free) > 1 and sum(map(len, self._free)) > self.limit:
                    self._free.remove(min(self._free, key=len))  # unmapped once unused

    def release(self, held: object) -> None:
        """One holder of ``held`` (a :class:`_Held`) is done with it."""
        if isinstance(held, _Held):
            with self._lock:
                held.refs -= 1
                last = held.refs == 0
            if last:
                self.put(held.buf)

    def share(self, held: _Held) -> None:
        with self._lock:
            held.refs += 1


class _Workspace(threading.local):
    src: _Held | None = None
    out: _Held | None = None

    def _take(self, which: str, n: int, pool: _Buffers) -> _Held:
        held = getattr(self, which)
        if held is None or len(held.buf) < n:
            if held is not None:
                pool.release(held)
            held = _Held(pool.get(n))
            setattr(self, which, held)
        return held

    def source_buffer(self, n: int, pool: _Buffers) -> np.ndarray:
        return np.frombuffer(self._take("src", n, pool).buf, dtype=np.uint8, count=n)

    def out_buffer(self, n: int, phase: int, pool: _Buffers) -> np.ndarray:
        """n bytes starting ``phase`` bytes into a page: byte i then sits at a page boundary
        exactly where output byte i does (O_DIRECT needs page-aligned memory)."""
        held = self._take("out", n + _ALIGN, pool)
        return np.frombuffer(held.buf, dtype=np.uint8, count=n, offset=phase)

    def settle(self, which: str, pool: _Buffers) -> None:
        """After hashing: a buffer some hasher still holds is no longer this worker's."""
        held = getattr(self, which)
        if held is not None and held.refs > 1:
            setattr(self, which, None)
            pool.release(held)


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def in_byte_order(plan: ShardPlan, st: SafetensorsFile) -> bool:
    """Whether ``plan`` takes every tensor of its source file ``st``, in the order of their
    bytes (so its jobs, started in plan order, read the file front to back)."""
    read = [e.source for e in plan.entries if e.kind in ("copy", "weight")]
    return sorted(read) == sorted(st.spans) and \
        read == sorted(st.spans, key=lambda n: st.spans[n][0])


class _Writer:
    def __init__(self, out_dir: Path, plans: list[ShardPlan], where: dict[str, SafetensorsFile],
                 weight_scales: dict, input_scales: dict, timings: Timings, workers: int,
                 hash_sources: bool = True):
        self.out_dir, self.plans, self.where, self.workers = out_dir, plans, where, workers
        self.hash_sources = hash_sources
        self.weight_scales, self.input_scales, self.timings = weight_scales, input_scales, timings
        self.record = ParallelRecord()
        self.ws = _Workspace()
        self.buffers = _Buffers()
        self.hashes: list[OrderedSha256] = []
        self.sizes: list[int] = []
        self.sources: dict[Path, tuple[SafetensorsFile, OrderedSha256 | bytes]] = {}
        self.budget: HashBudget | None = None
        self._tables: dict[tuple[float, str], np.ndarray] = {}  # (scale, dtype) -> E4M3 LUT
        self._tables_lock = threading.Lock()
        self.stop = threading.Event()
        self.fds: list[int] = []
        self.direct: list[int | None] = []  # O_DIRECT descriptors, where allowed

    def open_shards(self) -> list[_Job]:
        jobs: list[_Job] = []
        for i, plan in enumerate(self.plans):
            head = header_bytes([e.tensor for e in plan.entries])
            size = len(head) + sum(e.tensor.nbytes for e in plan.entries)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(self.out_dir / plan.file_name, flags, OUTPUT_MODE)
            self.fds.append(fd)
            if hasattr(os, "posix_fallocate") and size:
                try:  # allocated extents: cheaper writes, and a full disk fails here, early
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise
            os.ftruncate(fd, size)
            _pwrite_all(fd, head, 0)
            self.sizes.append(size)
            try:
                self.direct.append(os.open(self.out_dir / plan.file_name,
                                           os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC))
            except (OSError, AttributeError):  # tmpfs and some network file systems
                self.direct.append(None)
            offset = len(head)
            for entry in plan.entries:
                jobs.append(_Job(i, entry, offset))
                offset += entry.tensor.nbytes
            self.hashes.append(head)  # replaced below, once the budget is known
            st = self.where.get(next((e.source for e in plan.entries
                                      if e.kind in ("copy", "weight")), ""))
            if self.hash_sources and st is not None and st.path not in self.sources \
                    and in_byte_order(plan, st):
                with self.timings.clock("hash: read source", st.data_start):
                    src_head = bytearray(st.data_start)
                    got = pread_exact(st.fileno(), src_head, 0)
                if got != st.data_start:
                    raise Fp8ExportError(f"{st.path}: cut short at byte {got} while reading its "
                                         "header; the file changed while converting or is "
                                         "truncated: re-download it.")
                self.sources[st.path] = (st, bytes(src_head))
        largest = max((max(j.entry.tensor.nbytes, self._source_bytes(j)) for j in jobs),
                      default=0)
        self.budget = HashBudget(max(64 << 20, largest), self.buffers.release)
        # Spares kept: as many bytes as can be in use at once (two buffers per worker, parked
        # bytes rounded up to their size class). Fewer meant fresh mappings, and on the
        # benchmark VM a fresh page costs more than the bytes put in it (bench/convert.py:
        # 0.8 GB of fresh buffers was a third of the CPU time before).
        self.buffers.limit = 2 * (self.workers * _size_class(largest) + self.budget.limit)
        self.hashes = [OrderedSha256(head, self.budget) for head in self.hashes]
        self.sources = {p: (st, OrderedSha256(head, self.budget))
                        for p, (st, head) in self.sources.items()}
        return jobs  # in file order: tensors are hashed in that order as they finish

    def _source_bytes(self, job: _Job) -> int:
        if job.entry.kind not in ("copy", "weight"):
            return 0
        begin, end = self.where[job.entry.source].spans[job.entry.source]
        return end - begin

    def source_digests(self) -> dict[Path, str]:
        """The sha256 of every source file hashed from the writer's reads (all jobs done)."""
        out = {}
        for path, (st, hasher) in self.sources.items():
            size = max((e for _, e in st.spans.values()), default=st.data_start)
            if os.fstat(st.fileno()).st_size != size:
                raise Fp8ExportError(f"{path}: its size changed while converting; convert a "
                                     "checkpoint that nothing else is writing.")
            out[path] = hasher.hexdigest(size)
        return out

    def run(self, job: _Job) -> None:
        if self.stop.is_set():
            return
        entry, fd = job.entry, self.fds[job.shard]
        name = entry.tensor.name
        try:
            if entry.kind == "copy":
                self._copy(job, fd)
            elif entry.kind == "weight":
                self._weight(job, fd)
            else:
                scales = self.weight_scales if entry.kind == "weight_scale" else self.input_scales
                t = np.array(scales[entry.source], dtype="<f4").reshape(entry.tensor.shape)
                data = t.reshape(-1).view(np.uint8)
                _pwrite_all(fd, data, job.offset)
                self._hash(job, data, owner=None)
        except Fp8ExportError:
            raise
        except EOFError as exc:
            st = self.where[entry.source]
            raise Fp8ExportError(f"{st.path}: tensor {entry.source!r} is cut short; the file "
                                 "changed while converting or is truncated: re-download it."
                                 ) from exc
        except OSError as exc:
            raise Fp8ExportError(
                f"{self.out_dir.name}/{self.plans[job.shard].file_name}: writing tensor {name!r} "
                f"failed: {exc.strerror or exc}. Nothing was written and the previous state is "
                "unchanged; free disk space or choose another -o/--output.") from exc
        except Exception as exc:  # a bug: still one clear error that names the tensor
            raise Fp8ExportError(f"converting tensor {name!r} failed ({type(exc).__name__}: "
                                 f"{exc}); nothing was written. This is a bug: please report it."
                                 ) from exc

    def _copy(self, job: _Job, fd: int) -> None:
        st = self.where[job.entry.source]
        begin, end = st.spans[job.entry.source]
        buf = self.ws.out_buffer(end - begin, job.offset % _ALIGN, self.buffers)
        with self.timings.clock("write: read source", end - begin):
            if end > begin and pread_exact(st.fileno(), buf, begin) != end - begin:
                raise EOFError
        self._hash_source(st, begin, buf, self.ws.out)
        with self.timings.clock("write: pwrite output", len(buf)):
            self._write_out(job, fd, buf)
        self._hash(job, buf, owner=self.ws.out)
        self.ws.settle("out", self.buffers)

    def _hash_source(self, st: SafetensorsFile, begin: int, data: np.ndarray,
                     owner: _Held) -> None:
        """Feed the source file's sha256 (when this writer hashes that file)."""
        entry = self.sources.get(st.path)
        if entry is None or not len(data):
            return
        self.buffers.share(owner)
        with self.timings.clock("hash: sha256 of source", len(data)):
            if entry[1].add(begin, data, owner):
                self.buffers.release(owner)

    def _hash(self, job: _Job, data: np.ndarray, owner: _Held | None) -> None:
        """Feed the output file's sha256; a parked buffer stays the hasher's until hashed."""
        if not len(data):
            return
        if owner is not None:
            self.buffers.share(owner)
        with self.timings.clock("write: sha256 output", len(data)):
            if self.hashes[job.shard].add(job.offset, data, owner) and owner is not None:
                self.buffers.release(owner)

    def _weight(self, job: _Job, fd: int) -> None:
        entry = job.entry
        st = self.where[entry.source]
        info = st.info(entry.source)
        begin, end = st.spans[entry.source]
        module = entry.source[: -len(".weight")]
        raw = self.ws.source_buffer(end - begin, self.buffers)
        with self.timings.clock("write: read source", end - begin):
            got = pread_exact(st.fileno(), raw, begin) if end > begin else 0
        if got != end - begin:
            raise EOFError
        self._hash_source(st, begin, raw, self.ws.src)
        n = (end - begin) // ST_BYTES[info.dtype]
        buf = self.ws.out_buffer(n, job.offset % _ALIGN, self.buffers)
        scale = self.weight_scales[module]
        with self.timings.clock("write: quantize + SQNR", end - begin):
            if info.dtype in lut.LUT_DTYPES:
                table = self._table(scale, info.dtype)
                hist = lut.new_histogram()
                lut.quantize_into(raw.view(np.uint16), table, buf, hist)
                sqnr = lut.sqnr_from_histogram(hist, table, scale, info.dtype)
            else:  # float32 / float64 sources: torch's chunked cast (imported only for them)
                import torch

                from fp8export.io.safetensors_dtypes import ST_TO_TORCH
                from fp8export.scales.weights import quantize_weight_sqnr

                w = torch.from_numpy(raw).view(ST_TO_TORCH[info.dtype])
                _, sqnr = quantize_weight_sqnr(w, scale, out=torch.from_numpy(buf))
        self.record.set_sqnr(module, sqnr)
        self.ws.settle("src", self.buffers)
        with self.timings.clock("write: pwrite output", len(buf)):
            self._write_out(job, fd, buf)
        self._hash(job, buf, owner=self.ws.out)
        self.ws.settle("out", self.buffers)

    def _table(self, scale, dtype: str) -> np.ndarray:
        key = (float(scale), dtype)  # fused members share one scale: one table for the group
        with self._tables_lock:
            table = self._tables.get(key)
            if table is None:
                table = self._tables[key] = lut.e4m3_table(scale, dtype)
            return table

    def _write_out(self, job: _Job, fd: int, data: np.ndarray) -> None:
        """The whole pages inside the tensor's range go straight to the device (O_DIRECT:
        on the benchmark VM, page-cache writes cost several times the CPU); the partial pages
        at either end, which it shares with its neighbours, go through the page cache. No
        page is written both ways, so the two paths never overlap."""
        direct = self.direct[job.shard]
        n, off = len(data), job.offset
        a0 = -(-off // _ALIGN) * _ALIGN
        a1 = (off + n) // _ALIGN * _ALIGN
        if direct is not None and a1 > a0:
            try:
                _pwrite_all(direct, data[a0 - off:a1 - off], a0)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct[job.shard] = None  # refused after all: the page cache then
                _pwrite_all(fd, data, off)
                return
            _pwrite_all(fd, data[:a0 - off], off)
            _pwrite_all(fd, data[a1 - off:], a1)
        else:
            _pwrite_all(fd, data, off)

    def close(self) -> None:
        for fd in self.fds + [d for d in self.direct if d is not None]:
            os.close(fd)
        self.fds, self.direct = [], []


def write_shards_parallel(out_dir: Path, plans: list[ShardPlan],
                          where: dict[str, SafetensorsFile], weight_scales: dict,
                          input_scales: dict, *, workers: int, timings: Timings,
                          on_tensor: Callable[[], None] | None = None,
                          hash_sources: bool = True) -> ParallelRecord:
    """Write every shard of ``plans`` under ``out_dir`` (fsynced); return the SQNRs and the
    sha256 of every file written, and (``hash_sources``) of every source file read in order.

    ``where`` maps each source tensor name to its safetensors file. The first error of any
    worker stops the others and is raised here (an Fp8ExportError naming the tensor).
    """
    writer = _Writer(out_dir, plans, where, weight_scales, input_scales, timings, max(1, workers),
                     hash_sources)
    try:
        with timings.clock("write: create files"):
            jobs = writer.open_shards()
        with ThreadPoolExecutor(max(1, workers), "fp8export-convert") as pool:
            futures = [pool.submit(writer.run, job) for job in jobs]
            try:
                for fut in futures:
                    fut.result()
                    if on_tensor is not None:
                        on_tensor()
            except BaseException:
                writer.stop.set()
                writer.budget.abort()
                for f in futures:
                    f.cancel()
                raise
        with timings.clock("write: fsync"):
            for fd in writer.fds:
                os.fsync(fd)
        for plan, hasher, size in zip(plans, writer.hashes, writer.sizes):
            writer.record.files[plan.file_name] = hasher.hexdigest(size)
        writer.record.sources = writer.source_digests()
    finally:
        writer.close()
    return writer.record
