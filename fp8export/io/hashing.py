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
