"""A wall-clock limit on a whole run (``verify --timeout``): every stage, not only inference.

:func:`time_limit` arms two things for ``seconds``: an event set at the deadline, which the
loops that can run long check between steps (each batch, each chunk a file is hashed in:
:func:`check`, :func:`expired`), and — in the main thread, where a signal can be delivered —
an alarm that raises :class:`TimeUp` wherever the run is (loading a model, tokenizing, a
forward pass between two operators). ``TimeUp`` is a BaseException, like Ctrl-C: the
``except Exception`` of a stage cannot swallow it, and every ``finally`` and context manager on
the way out still runs, so nothing is left half-done. The caller turns it into one message
that says how far the run got (``_progress.where()``).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from fp8export._progress import where

_ACTIVE: list[threading.Event] = []  # the innermost limit's event (one run at a time)


class TimeUp(BaseException):
    """The run's time limit was reached (raised into the run, like KeyboardInterrupt);
    ``where``: how far the run had got at that moment (``_progress.where()``)."""

    def __init__(self, where: str | None = None):
        super().__init__(where)
        self.where = where


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Bound the block to ``seconds`` of wall-clock time (None or 0: no limit)."""
    if not seconds:
        yield
        return
    expired = threading.Event()
    timer = threading.Timer(seconds, expired.set)
    timer.daemon = True
    previous = None
    armed = False
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        def alarm(signum, frame):
            expired.set()
            raise TimeUp(where())

        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        armed = True
    timer.start()
    _ACTIVE.append(expired)
    try:
        yield
    finally:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        timer.cancel()
        _ACTIVE.remove(expired)


def expired() -> threading.Event | None:
    """The running limit's event (set at the deadline), for loops that take a stop event."""
    return _ACTIVE[-1] if _ACTIVE else None


def check() -> None:
    """Raise :class:`TimeUp` when the running limit has passed (a cooperative checkpoint)."""
    if _ACTIVE and _ACTIVE[-1].is_set():
        raise TimeUp(where())
