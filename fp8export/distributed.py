"""Data parallel over ``torch.distributed``: the same command on N processes (``torchrun``), each
running its share of the samples; results combined exactly, rank 0 alone writes.

Launch: ``torchrun --standalone --nproc_per_node=N $(which fp8export) calibrate ...`` (one host)
or with torchrun's rendezvous options on several hosts. torchrun's environment (``WORLD_SIZE``,
``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``) is all this module reads; without it a run
is one process and every operation here is the identity.

* **Backends**: NCCL for the data when the run uses GPUs (each rank on ``cuda:LOCAL_RANK``),
  gloo on CPU; a second, gloo group carries the status exchanges (small, on the host).
* **Shares** (:meth:`Comm.share`): the batches are cut into :data:`SLOTS` fixed, contiguous
  slots (by batch index, whatever the number of ranks) and each rank takes a contiguous run of
  slots. Statistics that combine exactly (max, integer counts) are reduced directly; float sums
  (GPTQ's ``H = Σ xᵀx``) are summed per slot and the slots folded in one fixed binary tree
  (:class:`SlotSums`), so 1, 2, 4 or 8 ranks add the same numbers in the same order: bit-identical
  results.
* **Failure**: every collective starts with a status exchange (:meth:`Comm.check`). A rank whose
  work raised takes part in the next one as failed (:meth:`Comm.fail`); every rank then stops
  with :class:`DistributedFailure` naming it, and rank 0 prints the one ``Error:`` line. Every
  collective has a timeout (``FP8EXPORT_DIST_TIMEOUT`` seconds, default
  :data:`DEFAULT_TIMEOUT_S`): a rank that died or hangs is reported, never waited for forever.

torch is imported lazily.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fp8export.errors import Fp8ExportError, UsageError

if TYPE_CHECKING:
    import torch

SLOTS = 8
"""Fixed slices of the batches; float sums fold them in one tree (results identical for 1..8
ranks)."""
DEFAULT_TIMEOUT_S = 1800.0
TIMEOUT_ENV = "FP8EXPORT_DIST_TIMEOUT"
_MESSAGE_BYTES = 480


class DistributedFailure(Fp8ExportError):
    """A rank failed (or stopped answering): every rank stops with this error."""

    def __init__(self, message: str, rank: int | None):
        super().__init__(message)
        self.rank = rank


def world_from_env() -> tuple[int, int, int]:
    """``(rank, world size, local rank)`` from torchrun's environment (``(0, 1, 0)`` without)."""
    def num(key: str, default: int) -> int:
        value = os.environ.get(key, "")
        try:
            return int(value) if value.strip() else default
        except ValueError:
            raise Fp8ExportError(f"environment variable {key}={value[:20]!r} is not a number; "
                                 "launch with torchrun, which sets it.") from None

    world = num("WORLD_SIZE", 1)
    rank = num("RANK", 0)
    local = num("LOCAL_RANK", rank)
    if world < 1 or not 0 <= rank < world:
        raise Fp8ExportError(f"RANK={rank} and WORLD_SIZE={world} do not fit together; launch "
                             "with torchrun.")
    return rank, world, local


def is_quiet_rank() -> bool:
    """True in a rank other than 0 of a torchrun launch: it prints nothing but errors."""
    return os.environ.get("RANK", "0").strip() not in ("", "0") and \
        os.environ.get("WORLD_SIZE", "1").strip() not in ("", "1")


def timeout_s() -> float:
    value = os.environ.get(TIMEOUT_ENV, "")
    if not value.strip():
        return DEFAULT_TIMEOUT_S
    try:
        t = float(value)
    except ValueError:
        t = -1.0
    if not t > 0:
        raise UsageError(f"{TIMEOUT_ENV}={value[:20]!r}: give the collectives' timeout in "
                         "seconds, above 0.")
    return t


def slot_ranges(n: int, slots: int = SLOTS) -> list[range]:
    """``n`` items cut into ``slots`` contiguous slots (some empty when ``n < slots``)."""
    return [range(k * n // slots, (k + 1) * n // slots) for k in range(slots)]


@dataclass
class Comm:
    """This process's place in the run (one process: rank 0 of 1, every operation local)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"  # where the data collectives' tensors live (cuda:<local> with NCCL)
    timeout: float = DEFAULT_TIMEOUT_S
    _group: Any = None
    _control: Any = None
    broken: str | None = None  # why the run stopped (a failed exchange): no more collectives

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def slots(self) -> int:
        return max(SLOTS, 1 << (self.world - 1).bit_length())

    def my_slots(self) -> range:
        s = self.slots
        return range(self.rank * s // self.world, (self.rank + 1) * s // self.world)

    def share(self, n: int) -> range:
        """This rank's contiguous share of ``n`` batches (whole slots, see the module doc)."""
        ranges = slot_ranges(n, self.slots)
        mine = self.my_slots()
        if not len(mine):
            return range(0)
        return range(ranges[mine.start].start, ranges[mine.stop - 1].stop)

    def slot_of(self, n: int) -> list[int]:
        """Slot index of each of ``n`` batches."""
        out = [0] * n
        for k, r in enumerate(slot_ranges(n, self.slots)):
            for b in r:
                out[b] = k
        return out

    # -- status --------------------------------------------------------------------------------
    def check(self, where: str = "") -> None:
        """Every rank reports it is well; raises :class:`DistributedFailure` if one is not."""
        self._exchange(0, where)

    def fail(self, message: str) -> None:
        """Tell the other ranks this one failed (their next :meth:`check` raises); no-op when
        the run already stopped or runs alone."""
        if self.distributed and self.broken is None:
            try:
                self._exchange(1, message)
            except DistributedFailure:
                pass

    def _exchange(self, status: int, message: str) -> None:
        if not self.distributed:
            return
        if self.broken is not None:
            raise DistributedFailure(self.broken, None)
        import torch
        import torch.distributed as dist

        data = message.encode("utf-8", "replace")[:_MESSAGE_BYTES]
        mine = torch.zeros(2 + _MESSAGE_BYTES, dtype=torch.int64)
        mine[0], mine[1] = status, len(data)
        if data:
            mine[2:2 + len(data)] = torch.tensor(list(data), dtype=torch.int64)
        got = [torch.zeros_like(mine) for _ in range(self.world)]
        try:
            dist.all_gather(got, mine, group=self._control)
        except Exception as exc:  # a dead or hung rank: gloo raises on its timeout
            self.broken = (f"rank {self.rank} of {self.world}: the other ranks stopped "
                           f"answering (no reply within {self.timeout:g} s: one died or hangs; "
                           f"{_first_line(exc)})")
            raise DistributedFailure(self.broken, self.rank) from exc
        failed = [r for r, t in enumerate(got) if int(t[0]) != 0]
        if not failed:
            return
        first = got[failed[0]]
        text = bytes(first[2:2 + int(first[1])].tolist()).decode("utf-8", "replace")
        more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        self.broken = f"rank {failed[0]} of {self.world} failed{more}: {text}"
        raise DistributedFailure(self.broken, failed[0])

    # -- collectives (each starts with a status exchange) --------------------------------------
    def _data(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def _run(self, what: str, fn):
        try:
            return fn()
        except DistributedFailure:
            raise
        except Exception as exc:
            self.broken = (f"rank {self.rank} of {self.world}: {what} failed ({_first_line(exc)})"
                           f"; another rank died or stopped answering within {self.timeout:g} s")
            raise DistributedFailure(self.broken, self.rank) from exc

    def sum_ints(self, values: torch.Tensor, where: str = "") -> torch.Tensor:
        """Element-wise sum of an int64 tensor over the ranks (exact), on every rank."""
        if not self.distributed:
            return values
        import torch.distributed as dist

        self.check(where)
        t = self._data(values.to(dtype=values.dtype).contiguous())

        def run():
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._group)
            return t.cpu()
        return self._run(f"summing {where or 'counts'}", run)

    def max_floats(self, values: torch.Tensor, where: str = "") -> torch.Tensor:
        """Element-wise max over the ranks, NaN winning as ``torch.maximum`` has it, folded in
        rank order: the same on every rank."""
        if not self.distributed:
            return values
        import torch

        parts = self.all_gather_tensor(values.to(torch.float64), where)
        out = parts[0]
        for p in parts[1:]:
            out = torch.maximum(out, p)
        return out.to(values.dtype)

    def agree_min(self, value: int, where: str = "the plan") -> int:
        """The smallest ``value`` of any rank, on every rank (so all take the same steps)."""
        import torch

        if not self.distributed:
            return value
        return int(-self.max_floats(torch.tensor([-float(value)]), where)[0])

    def agree_max(self, value: int, where: str = "the plan") -> int:
        import torch

        if not self.distributed:
            return value
        return int(self.max_floats(torch.tensor([float(value)]), where)[0])

    def all_gather_tensor(self, t: torch.Tensor, where: str = "") -> list[torch.Tensor]:
        """Every rank's tensor (same shape and dtype on all), in rank order, on the host."""
        if not self.distributed:
            return [t]
        import torch
        import torch.distributed as dist

        self.check(where)
        mine = self._data(t.contiguous())
        got = [torch.empty_like(mine) for _ in range(self.world)]

        def run():
            dist.all_gather(got, mine, group=self._group)
            return [g.cpu() for g in got]
        return self._run(f"gathering {where or 'results'}", run)

    def all_gather_bytes(self, data: bytes, where: str = "") -> list[bytes]:
        """Every rank's bytes (any length), in rank order. JSON or raw arrays only: nothing is
        unpickled."""
        if not self.distributed:
            return [data]
        import numpy as np
        import torch

        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [int(s) for s in self.all_gather_tensor(n, where)]
        buf = torch.zeros(max(sizes) or 1, dtype=torch.uint8)
        if data:
            buf[:len(data)] = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
        parts = self.all_gather_tensor(buf, where)
        return [p[:s].numpy().tobytes() for p, s in zip(parts, sizes, strict=True)]

    def broadcast_tensor(self, t: torch.Tensor, src: int = 0, where: str = "") -> torch.Tensor:
        """``t`` of rank ``src`` on every rank (same shape and dtype given everywhere)."""
        if not self.distributed:
            return t
        import torch.distributed as dist

        self.check(where)
        buf = self._data(t.contiguous())

        def run():
            dist.broadcast(buf, src=src, group=self._group)
            return buf.cpu()
        return self._run(f"broadcasting {where or 'results'}", run)

    def send(self, t: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        self._run("sending a partial sum",
                  lambda: dist.send(self._data(t.contiguous()), dst, group=self._group))

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        import torch
        import torch.distributed as dist

        buf = torch.empty(like.shape, dtype=like.dtype, device=self.device)

        def run():
            dist.recv(buf, src, group=self._group)
            return buf.cpu()
        return self._run("receiving a partial sum", run)

    def barrier(self) -> None:
        if self.distributed and self.broken is None:
            import torch.distributed as dist

            self._run("the final barrier", lambda: dist.barrier(group=self._control))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


_CURRENT: Comm | None = None


def current() -> Comm:
    """The run's :class:`Comm` (rank 0 of 1 until :func:`join` started a distributed one)."""
    return _CURRENT if _CURRENT is not None else Comm()


def join(device: str) -> Comm:
    """Join torchrun's process group (once per process) for work on ``device`` ("cpu" or
    "cuda"): NCCL with each rank on ``cuda:LOCAL_RANK`` or gloo; a gloo group for the status.
    Without torchrun's environment: rank 0 of 1."""
    global _CURRENT
    if _CURRENT is not None:
        return _CURRENT
    rank, world, local = world_from_env()
    if world == 1:
        return Comm()
    import datetime

    import torch
    import torch.distributed as dist

    t = timeout_s()
    comm_device = "cpu"
    backend = "gloo"
    if device == "cuda":
        count = torch.cuda.device_count()
        if local >= count:
            raise Fp8ExportError(f"LOCAL_RANK {local} but {count} GPU(s) are visible: start at "
                                 f"most {count} processes per host (torchrun --nproc_per_node).")
        torch.cuda.set_device(local)
        comm_device, backend = f"cuda:{local}", "nccl"
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=t),
                                    **({"device_id": torch.device(comm_device)}
                                       if backend == "nccl" else {}))
        except Exception as exc:
            raise Fp8ExportError(f"rank {rank} of {world}: could not join the process group "
                                 f"({_first_line(exc)}); check torchrun's rendezvous options "
                                 "(--rdzv-endpoint / --master-addr).") from exc
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=t)) \
        if backend != "gloo" else None
    _CURRENT = Comm(rank=rank, world=world, local_rank=local, device=comm_device, timeout=t,
                    _group=None, _control=control)
    import atexit

    atexit.register(leave)
    return _CURRENT


@contextlib.contextmanager
def rank0_writes(what: str) -> Iterator[bool]:
    """Rank 0 writes (the block runs when the value is True); every rank then waits for it, so
    a rank that goes on (to read what was written) never runs ahead, and a failed write stops
    them all with rank 0's message. One process: always True."""
    comm = current()
    if comm.rank != 0:
        yield False
        comm.check(what)
        return
    try:
        yield True
    except BaseException as exc:
        comm.fail(f"{what}: {exc}")
        raise
    comm.check(what)


FAREWELL_S = 60.0


def leave() -> None:
    """Wait (a bounded time) for the other ranks, so rank 0's last line is out before torchrun
    ends the job, and leave the process group."""
    global _CURRENT
    comm, _CURRENT = _CURRENT, None
    if comm is None:
        return
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:  # gloo's barrier that gives up: a dead rank must not hold the others
        dist.monitored_barrier(group=comm._control,
                               timeout=datetime.timedelta(seconds=min(comm.timeout, FAREWELL_S)),
                               wait_all_ranks=True)
    except Exception:  # a rank that is gone: nothing left to wait for
        pass
    dist.destroy_process_group()


def error_line(exc: BaseException, message: str) -> str | None:
    """What this process prints for ``exc`` (``message``) in a data-parallel run, None to stay
    quiet: the other ranks are told first (:meth:`Comm.fail`), and rank 0 prints one line for
    the run, naming the rank that failed; a rank prints its own line only when it lost contact
    (rank 0 may be the one gone). Outside torchrun: ``message``."""
    comm = _CURRENT
    if comm is None or not comm.distributed:
        return None if is_quiet_rank() else message
    if isinstance(exc, DistributedFailure):
        return message if comm.rank == 0 or exc.rank == comm.rank else None
    comm.fail(message)
    return f"rank {comm.rank} of {comm.world}: {message}" if comm.rank == 0 else None


class SlotSums:
    """``Σ`` of float32 matrices over the batches, identical for any number of ranks.

    Each batch adds into its slot's partial sum (on the device, in batch order); a finished
    slot goes to the host (stays on the device with ``on_device`` on one rank: at most
    log2(slots) + 2 matrices per key there at once) and folds with its completed siblings of
    one fixed binary tree over
    the slots (at most log2(slots) + 1 partials per key at a time); :meth:`total` folds the
    ranks' subtrees in the same tree, through point-to-point sends, onto rank 0. Float32
    addition is correctly rounded on every device, so the sums are the same bits however many
    ranks computed the slots. A slot that gave a key nothing is absent, not zero.
    """

    def __init__(self, comm: Comm, n_batches: int, on_device: bool = False):
        self.comm = comm
        # one rank's partials may stay where they were summed (no copy to the host per slot,
        # the folds on the device: the same correctly rounded additions, the same bits)
        self.on_device = on_device and comm.world == 1
        self.slot_of = comm.slot_of(n_batches)
        mine = comm.my_slots()
        self.first, self.end = mine.start, mine.stop
        self.current: dict[str, torch.Tensor] = {}
        self.slot: int | None = None
        self.next = self.first  # the first slot not yet closed
        self.nodes: dict[str, dict[tuple[int, int], torch.Tensor]] = {}

    def begin_batch(self, b: int) -> None:
        """Batch ``b`` (global index) is next: a new slot closes the previous one."""
        slot = self.slot_of[b]
        if not self.first <= slot < self.end:
            raise Fp8ExportError(f"internal: batch {b} is not in this rank's share.")
        if slot != self.slot:
            self._close_until(slot)
            self.slot = slot

    def accumulator(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The current slot's partial of ``key`` (zeros shaped ``like`` on its device)."""
        acc = self.current.get(key)
        if acc is None:
            import torch

            acc = self.current[key] = torch.zeros_like(like, dtype=torch.float32)
            self.nodes.setdefault(key, {})
        return acc

    def _close_until(self, stop: int) -> None:
        """Close every slot before ``stop`` (the current one with its partials)."""
        while self.next < stop:
            k = self.next
            if k == self.slot:
                for key, acc in self.current.items():
                    self.nodes[key][(k, k + 1)] = acc if self.on_device else acc.cpu()
                self.current = {}
            for nodes in self.nodes.values():
                _complete(nodes, k, self.first)
            self.next += 1

    def total(self, key_order: list[str], shapes: dict[str, tuple[int, ...]]
              ) -> dict[str, torch.Tensor]:
        """The folded sums on rank 0 (float32, on the host; where they were summed with
        ``on_device``); other ranks get an empty dict. Every rank calls it with the same
        ``key_order`` and ``shapes`` (all keys of the run)."""
        import torch

        self._close_until(self.end)
        self.slot = None
        comm, slots = self.comm, self.comm.slots
        owner = [0] * slots
        for r in range(comm.world):
            for k in range(r * slots // comm.world, (r + 1) * slots // comm.world):
                owner[k] = r
        comm.check("partial sums")
        out = {}
        for key in key_order:
            like = torch.empty(shapes[key], dtype=torch.float32)
            value = _fold(0, slots, owner, self.nodes.pop(key, {}), comm, like)
            if comm.rank == 0 and value is not None:
                out[key] = value
        return out


def _complete(nodes: dict, k: int, first: int) -> None:
    """Slot ``k`` closed: form every tree node that ends with it and starts in this rank's
    range (its two halves complete), smallest first."""
    size = 1
    while True:
        lo = (k // (2 * size)) * 2 * size
        hi = lo + 2 * size
        if hi != k + 1 or lo < first:
            return
        a, b = nodes.pop((lo, lo + size), None), nodes.pop((lo + size, hi), None)
        if a is not None or b is not None:
            nodes[(lo, hi)] = a if b is None else b if a is None else a + b
        size *= 2


def _fold(lo: int, hi: int, owner: list[int], have: dict, comm: Comm, like):
    """The node ``[lo, hi)``'s sum at ``owner[lo]`` (None there when its slots were empty)."""
    import torch

    ranks = set(owner[lo:hi])
    if len(ranks) == 1:
        return have.get((lo, hi)) if comm.rank == owner[lo] else None
    mid = (lo + hi) // 2
    left = _fold(lo, mid, owner, have, comm, like)
    right = _fold(mid, hi, owner, have, comm, like)
    a, b = owner[lo], owner[mid]
    if a != b:
        if comm.rank == b:
            flag = torch.tensor([0 if right is None else 1], dtype=torch.int64)
            comm.send(flag, a)
            if right is not None:
                comm.send(right, a)
            return None
        if comm.rank == a:
            flag = comm.recv(torch.zeros(1, dtype=torch.int64), b)
            right = comm.recv(like, b) if int(flag[0]) else None
    if comm.rank != a:
        return None
    if left is None:
        return right
    return left if right is None else left + right
