"""Progress bars that show on a terminal and stay quiet in CI logs (DESIGN.md)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress_enabled() -> bool:
    """True when stderr is a terminal and we are not in CI (``CI`` or ``FP8EXPORT_NO_PROGRESS`` set)."""
    if os.environ.get("CI") or os.environ.get("FP8EXPORT_NO_PROGRESS"):
        return False
    return sys.stderr.isatty()


def progress(
    iterable: Iterable[T], *, total: int | None = None, desc: str = "", unit: str = "it"
) -> Iterator[T]:
    """Wrap ``iterable`` in a tqdm bar when progress is enabled, else return it unchanged."""
    if not progress_enabled():
        yield from iterable
        return
    from tqdm import tqdm  # lazy: tqdm is light, but keep --help import-free

    yield from tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)


def info(message: str) -> None:
    """A one-line notice for the user on stderr (kept in CI logs)."""
    print(message, file=sys.stderr, flush=True)
