"""sha256 of files and of tensor bytes: the manifest's source hashes, read-back's digests,
verify's provenance."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path


def file_sha256(path: Path, chunk: int = 1 << 24, stop: threading.Event | None = None) -> str:
    """Hex sha256 of a file; returns "" early when ``stop`` is set (the caller gave up)."""
    h = hashlib.sha256()
    buf = bytearray(chunk)  # one buffer, refilled: a fresh 16 MiB object per read costs page faults
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            if stop is not None and stop.is_set():
                return ""
            h.update(view[:n])
    return h.hexdigest()


def digest(data) -> str:
    """Content digest of one tensor's bytes (what read-back compares): sha256, hex.

    hashlib releases the GIL on large buffers, so hashing overlaps other threads' work.
    """
    return hashlib.sha256(data).hexdigest()


class OrderedSha256:
    """sha256 of one file whose byte ranges are produced out of order by several threads.

    sha256 is sequential, so a range that arrives before its predecessors is parked (the caller
    hands over the buffer and must not reuse it) and hashed as soon as the gap before it is
    filled, by whichever thread fills it. Parked bytes of all files sharing one ``budget`` are
    bounded: a thread whose range would exceed it waits for the gap to close (the range before
    it must be in progress in another thread, as ranges are started in file order).
    ``on_hashed(owner)`` is called with the owner of each parked range once it is hashed.
    """

    def __init__(self, first: bytes, budget: HashBudget):
        self._h = hashlib.sha256(first)
        self._next = len(first)
        self._parked: dict[int, tuple[memoryview, object]] = {}
        self._busy = False
        self._budget = budget

    def add(self, offset: int, data, owner: object = None) -> bool:
        """Hash ``data`` (the bytes at ``offset``) now or later; False when it was parked (the
        buffer then belongs to this object until ``on_hashed(owner)``)."""
        view = memoryview(data).cast("B")
        b = self._budget
        with b.cond:
            while (offset != self._next and b.parked and b.parked + len(view) > b.limit
                   and not b.aborted):
                b.cond.wait()
            if offset != self._next or self._busy:
                self._parked[offset] = (view, owner)
                b.parked += len(view)
                return False
            self._busy = True
        self._h.update(view)  # hashlib releases the GIL on large buffers
        while True:
            with b.cond:
                self._next = offset + len(view)
                item = self._parked.pop(self._next, None)
                if item is None:
                    self._busy = False
                    b.cond.notify_all()
                    return True
                offset, (view, owner) = self._next, item
                b.parked -= len(view)
            self._h.update(view)
            b.on_hashed(owner)

    def hexdigest(self, size: int) -> str:
        """The digest once every byte up to ``size`` was added."""
        if self._next != size or self._parked:
            raise RuntimeError(f"hashed {self._next} of {size} bytes, {len(self._parked)} "
                               "ranges still parked")
        return self._h.hexdigest()


class HashBudget:
    """The bytes that :class:`OrderedSha256` objects may hold parked, shared between them."""

    def __init__(self, limit: int, on_hashed=lambda owner: None):
        self.limit, self.on_hashed = limit, on_hashed
        self.parked = 0
        self.aborted = False
        self.cond = threading.Condition()

    def abort(self) -> None:
        """Wake every waiting thread (a job failed: the digests will not be used)."""
        with self.cond:
            self.aborted = True
            self.cond.notify_all()
