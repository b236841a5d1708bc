"""Seconds (and bytes) per step of a long operation, summed over the threads that did it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

RATE = "MB/s: "  # prefix of the throughput entries in :meth:`Timings.as_dict`


@dataclass
class Timings:
    """Seconds spent per step, summed over the threads that did it (thread-safe), and the bytes
    each step went through where it says so: ``as_dict`` then adds ``"MB/s: <step>"``, bytes
    (10^6) per second of that step (per worker-second for steps summed over threads)."""

    seconds: dict[str, float] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, step: str, seconds: float, nbytes: int = 0) -> None:
        with self._lock:
            self.seconds[step] = self.seconds.get(step, 0.0) + seconds
            if nbytes:
                self.nbytes[step] = self.nbytes.get(step, 0) + nbytes

    def clock(self, step: str, nbytes: int = 0):
        return _Clock(self, step, nbytes)

    def merge(self, other: Timings) -> None:
        with other._lock:
            seconds, nbytes = dict(other.seconds), dict(other.nbytes)
        for step, s in seconds.items():
            self.add(step, s, nbytes.get(step, 0))

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            out = {k: round(v, 4) for k, v in self.seconds.items()}
            for step, n in self.nbytes.items():
                if self.seconds.get(step, 0.0) > 0.0:
                    out[RATE + step] = round(n / 1e6 / self.seconds[step], 1)
            return dict(sorted(out.items()))


class _Clock:
    def __init__(self, timings: Timings, step: str, nbytes: int):
        self.timings, self.step, self.nbytes = timings, step, nbytes

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.timings.add(self.step, time.perf_counter() - self.t0, self.nbytes)
