"""``fp8export.json``, the FP8 folder's manifest (schema: docs/fp8-folder.md): built from what
convert decided (:func:`build_manifest`, :func:`layer_entries`, :func:`files_entry`), read back
and validated (:func:`read_manifest`); and JSON writing.

Everything written as JSON goes through :func:`dump_json`: sorted keys, fixed indentation, no
NaN/Infinity (an exact round trip's SQNR is recorded as ``null``), a trailing newline. The
manifest holds no timestamps and no absolute paths, so two runs give byte-identical files.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from fp8export.errors import Fp8ExportError

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


def kv_cache_line(entry: Any) -> str | None:
    """What the manifest's ``kv_cache`` entry declares, in one line; None without an FP8 KV
    cache (convert, inspect and export-onnx all say it the same way)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("layers"), dict):
        return None
    line = (f"FP8 E4M3 keys and values, k_scale/v_scale for {len(entry['layers'])} attention "
            "layer(s)")
    if entry.get("samples") and entry.get("data"):
        line += f", calibrated on {entry['samples']} samples of {entry['data']}"
    return line


def finite_or_none(x: float | None) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return float(x)


SQNR_DECIMALS = 3
"""Recorded SQNRs are rounded to 0.001 dB: the digits below that depend on the order a
computation sums in (float32 dot products, or exact per-value sums from a histogram), not on
the weights, and the manifest must be the same bytes whichever way they were summed."""


def sqnr_entry(x: float | None) -> float | None:
    """A weight's SQNR as the manifest records it: ``null`` when not finite, else rounded to
    :data:`SQNR_DECIMALS`."""
    x = finite_or_none(x)
    return None if x is None else round(x, SQNR_DECIMALS)


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


# Options the manifest does not record: where from and to (given on each command line), and
# how fast and how thoroughly (workers, read_back), which never change what is written, so the
# output stays identical. The rest is the run's record, and what a recipe file may set.
NOT_RECORDED = ("checkpoint", "output", "force", "workers", "read_back")


def options_entry(options: dict[str, Any]) -> dict[str, Any]:
    """ConvertConfig.to_dict() without paths that vary between machines (basenames kept)."""
    out = {k: v for k, v in options.items() if k not in NOT_RECORDED}
    for key in ("calib_data", "calib_amax"):
        if out.get(key):
            out[key] = Path(out[key]).name
    out["exclude"] = list(out.get("exclude") or [])
    out["include"] = list(out.get("include") or [])
    return out


def build_manifest(*, source: dict[str, Any], options: dict[str, Any], output_format: str,
                   loaded_by: list[str], activation_scheme: str, weight_granularity: str,
                   dynamic_activations: str, block_size: tuple[int, int] | None,
                   dynamic_layers: list[str], quantization_config: dict[str, Any],
                   layers: list[dict[str, Any]], excluded: dict[str, str], notes: list[str],
                   scheme: dict[str, Any] | None = None, kv_cache: dict[str, Any] | None = None,
                   weight_rounding: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``fp8export.json`` of a folder convert writes (schema: docs/fp8-folder.md), before
    its ``files`` (:func:`files_entry`) and ``accuracy_budget``. ``layers``: the rows of
    :func:`layer_entries`; ``options``: :func:`options_entry`; ``source``: name, kind, family
    and :func:`source_files_entry`."""
    from fp8export import __version__

    manifest = {
        "format_version": FORMAT_VERSION,
        "tool": {"name": "fp8export", "version": __version__},
        "source": source,
        "options": options,
        "output_format": output_format,
        "loaded_by": list(loaded_by),
        "activation_scheme": activation_scheme,
        "weight_granularity": weight_granularity,
        "dynamic_activations": dynamic_activations,
        "dynamic_activation_layers": dynamic_layers,
        "quantization_config": quantization_config,
        "quantized": {row["module"]: {k: v for k, v in row.items() if k != "module"}
                      for row in layers},
        "excluded": dict(sorted(excluded.items())),
        "notes": notes,
    }
    for key, value in (("block_size", list(block_size) if block_size else None),
                       ("scheme", scheme), ("kv_cache", kv_cache),
                       ("weight_rounding", weight_rounding)):
        if value is not None:
            manifest[key] = value
    return manifest


def layer_entries(targets, scan_amax: dict[str, float], weight_scales: dict[str, Any],
                  weight_source: dict[str, str], ranges: dict[str, Any],
                  input_scales: dict[str, Any], sqnr: dict[str, float | None], plans,
                  rounding: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The per-layer rows of the manifest (and of convert's result), in source order: one per
    ``targets`` (``scales.select.Target``), with the shard it is in (``plans``: the
    ``write.ShardPlan``s), its amax and scales (per channel or block: the largest, and the
    smallest as ``weight_scale_min``), where they came from (``ranges``: ``ActivationRange``
    per module), the SQNR read-back measured, and per rounded layer its SQNRs against the
    source weight and on the layer's output (``rounding``; the read-back SQNR of a rounded
    weight is against the codes it was written from)."""
    import numpy as np

    shard_of = {e.tensor.name: p.file_name for p in plans for e in p.entries}
    rows = []
    for t in targets:
        r = ranges.get(t.module)
        scale = weight_scales[t.module]
        rows.append({
            "module": t.module, "weight": t.weight, "file": shard_of[t.weight],
            "shape": list(t.shape), "layout": t.layout, "source_dtype": t.dtype,
            "fused_group": t.fused_group,
            "weight_amax": scan_amax[t.module],
            "weight_scale": float(np.max(scale)),
            **({"weight_scale_min": float(np.min(scale))} if np.ndim(scale) else {}),
            "weight_scale_source": weight_source[t.module],
            "weight_sqnr_db": sqnr_entry(sqnr.get(t.module)),
            "input_amax": float(r.amax) if r else None,
            "input_scale": float(input_scales[t.module]) if t.module in input_scales else None,
            "input_scale_source": str(r.source) if r else None,
            "input_details": dict(r.details) if r and r.details else {},
            **(rounding or {}).get(t.module, {}),
        })
    return rows


def files_entry(folder: Path, workers: int, known: dict[str, str]) -> list[dict[str, Any]]:
    """``[{name, sha256, bytes}]`` of every file written so far (the manifest comes last):
    what verify compares to tell a folder edited after convert. ``known``: the shards' sha256,
    computed from their bytes as they were written (read-back checked those bytes on disk);
    the other files (configs, loader files: small) are read, in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    from fp8export.io.hashing import file_sha256

    files = sorted((p for p in folder.rglob("*") if p.is_file()),
                   key=lambda p: p.relative_to(folder).as_posix())
    todo = [p for p in files if p.relative_to(folder).as_posix() not in known]
    with ThreadPoolExecutor(max(1, min(workers, len(todo)))) as pool:
        read = dict(zip(todo, pool.map(file_sha256, todo)))
    digests = [known.get(p.relative_to(folder).as_posix()) or read[p] for p in files]
    return [{"name": p.relative_to(folder).as_posix(), "sha256": d, "bytes": p.stat().st_size}
            for p, d in zip(files, digests)]


def portable_notes(notes: list[str], paths: list[Path]) -> list[str]:
    """``notes`` with the user's ``paths`` shortened to basenames (the manifest holds no
    absolute paths)."""
    pairs = sorted({(str(v), p.name) for p in paths for v in (p.resolve(), p.absolute(), p)},
                   key=lambda kv: -len(kv[0]))
    cleaned = []
    for note in notes:
        for full, name in pairs:
            if full and full != name:
                note = note.replace(full, name)
        cleaned.append(note)
    return cleaned


MANIFEST_BASE_BYTES = 1 << 20
MANIFEST_BYTES_PER_TENSOR = 16 << 10
_TENSOR_KEY = b'"data_offsets"'


def _tensor_count(folder: Path) -> int:
    """Tensors in the folder's safetensors files, counted in their headers (not parsed: the
    readers validate them; this only sizes the manifest)."""
    import struct

    from fp8export.io.guarded import WEIGHTS, open_input

    count = 0
    for shard in sorted(folder.glob("*.safetensors")):
        try:
            with open_input(shard, WEIGHTS, root=folder) as f:
                head = f.read(8)
                size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                if size <= 100 << 20:
                    count += f.read(size).count(_TENSOR_KEY)
        except Fp8ExportError:  # the readers say what is wrong with it
            continue
    return count


def _bad_manifest(path: Path, what: str) -> Fp8ExportError:
    return Fp8ExportError(f"{path}: {what}; the manifest is corrupt or was edited. Re-run "
                          "`fp8export convert`.")


def read_manifest(folder: Path) -> dict[str, Any]:
    """``folder/fp8export.json`` through the guarded reader, its structure validated: the
    ``quantized`` map (module → entry with a string ``weight``, a known ``layout``, numeric or
    null scales), ``excluded``, ``notes`` and ``source`` have the types every reader relies on.
    """
    from fp8export.io.guarded import MANIFEST, FileKind, read_json_object

    path = Path(folder) / MANIFEST_NAME
    # Sized by the model it describes: Python holds a JSON value in ~60 bytes, so 250 MB of
    # "[]" would take 6.5 GB; a real manifest is under 2 KiB per tensor.
    tensors = _tensor_count(Path(folder))
    limit = min(MANIFEST.max_bytes, MANIFEST_BASE_BYTES + MANIFEST_BYTES_PER_TENSOR * tensors)
    kind = FileKind(f"fp8export manifest for {tensors} tensors", limit)
    doc = read_json_object(path, kind, root=folder, what="fp8export manifest")
    quantized = doc.get("quantized", {})
    if not isinstance(quantized, dict):
        raise _bad_manifest(path, "'quantized' is not an object of module entries")
    for module, entry in quantized.items():
        if entry is None:
            continue
        if not isinstance(entry, dict):
            raise _bad_manifest(path, f"quantized[{module[:80]!r}] is not an object")
        if not isinstance(entry.get("weight", ""), str):
            raise _bad_manifest(path, f"quantized[{module[:80]!r}].weight is not a tensor name")
        if entry.get("layout", "out_in") not in ("out_in", "in_out"):
            raise _bad_manifest(path, f"quantized[{module[:80]!r}].layout is "
                                      f"{str(entry.get('layout'))[:20]!r}, not out_in/in_out")
        for key in ("weight_scale", "input_scale", "weight_amax", "input_amax", "weight_sqnr_db"):
            v = entry.get(key)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)) \
                    and v not in ("nan", "inf", "-inf"):
                raise _bad_manifest(path, f"quantized[{module[:80]!r}].{key} is not a number")
    for key, kind in (("excluded", dict), ("notes", list), ("source", dict)):
        if doc.get(key) is not None and not isinstance(doc[key], kind):
            raise _bad_manifest(path, f"{key!r} is not a JSON {kind.__name__}")
    return doc
