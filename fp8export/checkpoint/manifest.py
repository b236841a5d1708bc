"""``fp8export.json``, the FP8 folder's manifest (schema: docs/fp8-folder.md), and JSON writing.

Everything written as JSON goes through :func:`dump_json`: sorted keys, fixed indentation, no
NaN/Infinity (an exact round trip's SQNR is recorded as ``null``), a trailing newline. The
manifest holds no timestamps and no absolute paths, so two runs give byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MANIFEST_NAME = "fp8export.json"


def _plain(value: Any) -> Any:
    # Provider details may carry numpy scalars/arrays or paths; store them as plain JSON
    # (paths as basenames: the manifest holds no absolute paths).
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return value.name
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def dump_json(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False,
                       default=_plain) + "\n").encode("utf-8")


def write_json(path: Path, obj: Any) -> None:
    data = dump_json(obj)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def finite_or_none(x: float | None) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return float(x)


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


def source_files_entry(root: Path, files: list[Path], hashes: dict[Path, str]) -> list[dict]:
    """``[{name, sha256, bytes}]`` with names relative to the checkpoint (never absolute)."""
    base = root if root.is_dir() else root.parent
    out = []
    for p in files:
        try:
            name = p.relative_to(base).as_posix()
        except ValueError:
            name = p.name
        out.append({"name": name, "sha256": hashes[p], "bytes": p.stat().st_size})
    return sorted(out, key=lambda d: d["name"])


def options_entry(options: dict[str, Any]) -> dict[str, Any]:
    """ConvertConfig.to_dict() without paths that vary between machines (basenames kept)."""
    out = {k: v for k, v in options.items() if k not in ("checkpoint", "output", "force")}
    for key in ("calib_data", "calib_amax"):
        if out.get(key):
            out[key] = Path(out[key]).name
    out["exclude"] = list(out.get("exclude") or [])
    out["include"] = list(out.get("include") or [])
    return out
