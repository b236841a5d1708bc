"""Progress that shows on a terminal and stays quiet in CI logs (DESIGN.md).

Two shapes, one rule. On a terminal (stderr a TTY, ``CI`` and ``FP8EXPORT_NO_PROGRESS`` unset)
a step shows live: a tqdm bar for loops, a line with the elapsed seconds for single long calls
(:func:`stage`), both erased when done. Elsewhere — CI logs, pipes — each stage prints exactly
one line when it starts (``[stage] tracing the model ...``), so a log shows where the time went
and where a run stopped, without a line per item.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

STAGE_PREFIX = "[stage] "
_TICK_S = 0.5


def progress_enabled() -> bool:
    """True on a terminal outside CI (``CI`` or ``FP8EXPORT_NO_PROGRESS`` set: False)."""
    if os.environ.get("CI") or os.environ.get("FP8EXPORT_NO_PROGRESS"):
        return False
    return sys.stderr.isatty()


def progress(
    iterable: Iterable[T], *, total: int | None = None, desc: str = "", unit: str = "it"
) -> Iterator[T]:
    """``iterable`` with a tqdm bar on a terminal, or one stage line (``desc: N units``)."""
    if not progress_enabled():
        if desc:
            info(f"{STAGE_PREFIX}{desc}" + (f": {total} {unit}(s)" if total is not None else ""))
        yield from iterable
        return
    from tqdm import tqdm  # lazy: tqdm is light, but keep --help import-free

    yield from tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)


@contextlib.contextmanager
def stage(desc: str) -> Iterator[None]:
    """One long step (loading a model, tracing, an ONNX session): its progress, as above."""
    if not progress_enabled():
        info(f"{STAGE_PREFIX}{desc}")
        yield
        return
    done = threading.Event()
    start = time.perf_counter()

    def tick() -> None:
        while not done.wait(_TICK_S):
            sys.stderr.write(f"\r{desc} ... {time.perf_counter() - start:.0f}s")
            sys.stderr.flush()

    thread = threading.Thread(target=tick, name="fp8export-stage", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        sys.stderr.write("\r\033[K")  # erase the line, as tqdm's leave=False does
        sys.stderr.flush()


def info(message: str) -> None:
    """A one-line notice for the user on stderr (kept in CI logs)."""
    print(message, file=sys.stderr, flush=True)
