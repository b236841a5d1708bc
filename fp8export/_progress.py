"""Progress that shows on a terminal and stays quiet in CI logs (DESIGN.md).

Everything printed that may carry text from a file (tensor names, manifest notes, paths, error
messages) goes through :func:`printable` (:func:`echo`, :func:`info`, the stage lines): a
checkpoint can name a tensor ``"\x1b]0;…\x07"`` or put ``"\x1b[2J"`` in a note, and a terminal
or a CI log viewer would obey it (set the window title, clear the screen, draw a fake PASSED).

Two shapes, one rule. On a terminal (stderr a TTY, ``CI`` and ``FP8EXPORT_NO_PROGRESS`` unset)
a step shows live: a tqdm bar for loops, a line with the elapsed seconds for single long calls
(:func:`stage`), both erased when done. Elsewhere — CI logs, pipes — each stage prints exactly
one line when it starts (``[stage] tracing the model ...``), so a log shows where the time went
and where a run stopped, without a line per item.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

STAGE_PREFIX = "[stage] "
_TICK_S = 0.5
# Every character a terminal may act on instead of showing: C0 controls but tab and newline,
# DEL and C1 controls (0x9b is CSI on its own), Unicode format characters (bidi overrides,
# zero-width), line/paragraph separators and lone surrogates: Unicode categories Cc, Cf, Zl, Zp,
# Cs (a test checks this list against unicodedata).
_UNPRINTABLE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891"
    "\u08e2\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ud800-\udfff"
    "\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U00013438\U0001bca0-\U0001bca3"
    "\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 \
        else f"\\U{code:08x}"


def printable(text: object) -> str:
    """``text`` with every character a terminal would act on shown as an escape (``\\x1b``,
    ``\\u202e``); newlines and tabs kept."""
    return _UNPRINTABLE.sub(_escape, str(text))


def quiet() -> bool:
    """A data-parallel rank other than 0 (torchrun): rank 0 speaks for the run, the others
    print only what rank 0 cannot know (``fp8export.distributed``)."""
    from fp8export.distributed import is_quiet_rank

    return is_quiet_rank()


def echo(message: object = "", err: bool = False) -> None:
    """``click.echo`` of :func:`printable` text: how commands print results."""
    import click

    if quiet():
        return
    click.echo(printable(message), err=err)


def progress_enabled() -> bool:
    """True on a terminal outside CI (``CI`` or ``FP8EXPORT_NO_PROGRESS`` set: False)."""
    if os.environ.get("CI") or os.environ.get("FP8EXPORT_NO_PROGRESS") or quiet():
        return False
    return sys.stderr.isatty()


# The steps running now, outermost first: [desc, items done, total, unit] (None for a stage).
# A run stopped midway (a time limit, an interrupt) says how far it got from this.
_RUNNING: list[list] = []


def where() -> str | None:
    """How far the run got: the steps running now, innermost last, with their counts
    ("comparing logits on 256 sample(s): 5 of 64 batch(s) done"); None outside any step."""
    parts = []
    for desc, done, total, unit in _RUNNING:
        if done is None:
            parts.append(desc)
        else:
            of = f" of {total}" if total is not None else ""
            parts.append(f"{desc}: {done}{of} {unit}(s) done")
    return "; ".join(printable(p) for p in parts) if parts else None


def progress(
    iterable: Iterable[T], *, total: int | None = None, desc: str = "", unit: str = "it"
) -> Iterator[T]:
    """``iterable`` with a tqdm bar on a terminal, or one stage line (``desc: N units``)."""
    step = [desc or "working", 0, total, unit]
    _RUNNING.append(step)
    shown = None
    try:
        if not progress_enabled():
            if desc:
                info(f"{STAGE_PREFIX}{desc}" + (f": {total} {unit}(s)" if total is not None
                                                 else ""))
            shown = iterable
        else:
            from tqdm import tqdm  # lazy: tqdm is light, but keep --help import-free

            shown = tqdm(iterable, total=total, desc=printable(desc), unit=unit, leave=False,
                         dynamic_ncols=True)
        for item in shown:
            yield item
            step[1] += 1
    finally:
        _RUNNING.remove(step)
        if shown is not iterable and hasattr(shown, "close"):
            shown.close()  # the bar, erased (leave=False) when the loop ends early


@contextlib.contextmanager
def stage(desc: str) -> Iterator[None]:
    """One long step (loading a model, tracing, an ONNX session): its progress, as above."""
    step = [desc, None, None, None]
    _RUNNING.append(step)
    try:
        with _shown(desc):
            yield
    finally:
        _RUNNING.remove(step)


@contextlib.contextmanager
def _shown(desc: str) -> Iterator[None]:
    if not progress_enabled():
        info(f"{STAGE_PREFIX}{desc}")
        yield
        return
    done = threading.Event()
    start = time.perf_counter()
    desc = printable(desc)

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
    if quiet():
        return
    print(printable(message), file=sys.stderr, flush=True)
