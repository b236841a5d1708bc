"""Seconds per step of a long operation, summed over the threads that did it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class Timings:
    """Seconds spent per step, summed over the threads that did it (thread-safe)."""

    seconds: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, step: str, seconds: float) -> None:
        with self._lock:
            self.seconds[step] = self.seconds.get(step, 0.0) + seconds

    def clock(self, step: str):
        return _Clock(self, step)

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return {k: round(v, 4) for k, v in sorted(self.seconds.items())}


class _Clock:
    def __init__(self, timings: Timings, step: str):
        self.timings, self.step = timings, step

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.timings.add(self.step, time.perf_counter() - self.t0)
