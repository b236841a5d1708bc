"""``amax.json``: calibration results on disk, reusable by ``convert --calib-amax amax.json``.

The file is deterministic (sorted keys, amaxes as float32-exact decimal strings via ``repr``
of Python floats, no timestamps or timings), so two runs on the same data and device give the
same bytes, and it is written atomically (temporary sibling, fsync, rename). It records the
checkpoint's weight-file hashes so a reader can tell which weights the ranges belong to.

Schema (``format: fp8export-amax``, ``version: 1``)::

    {"format": "fp8export-amax", "version": 1, "tool": "fp8export <v>",
     "method": "percentile", "options": {"percentile": 99.99},
     "samples": 512, "tokens": 81234, "device": "cpu", "dtype": "bfloat16",
     "data": {"file": "calib.txt", "sha256": "..."},
     "checkpoint": {"path": "...", "files": {"model.safetensors": "<sha256>"}},
     "groups": {"model.layers.0.self_attn.qkv": ["...q_proj", "...k_proj", "...v_proj"]},
     "missing": [], "notes": [],
     "modules": {"model.layers.0.self_attn.q_proj": {"amax": 3.25, "observed_amax": 3.0,
                 "scale": 0.0072544645}}}
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8export.config import ScaleSource
from fp8export.errors import Fp8ExportError
from fp8export.io.atomic import write_file_atomic
from fp8export.io.guarded import AMAX, WEIGHTS, open_input, read_json_object
from fp8export.io.outputs import claim_output_file
from fp8export.scales.ranges import ActivationRange

if TYPE_CHECKING:
    from fp8export.calibration.api import CalibrationResult

FORMAT = "fp8export-amax"
VERSION = 1


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open_input(path, WEIGHTS) as f:  # a regular file (never a FIFO or a device)
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_hashes(checkpoint: Path) -> dict[str, str]:
    """sha256 of every weight file of the checkpoint, by name relative to it (sorted)."""
    from fp8export.checkpoint.source import open_checkpoint

    root = Path(checkpoint)
    with open_checkpoint(root) as ckpt:
        files = sorted(set(ckpt.source_files))
    out = {}
    for f in files:
        rel = f.name if not root.is_dir() else str(Path(f).relative_to(root))
        out[rel] = sha256_file(Path(f))
    return dict(sorted(out.items()))


def check_amax_checkpoint(path: str | Path, hashes: dict[str, str],
                          modules: list[str] | None = None) -> None:
    """Refuse an amax file recorded for other weights than ``hashes`` (name relative to the
    checkpoint → sha256 of the weight files being converted), or, whatever it records, one
    whose layers are none of ``modules`` (the layers being quantized): it was measured on
    another model, and using it would leave every layer without its range."""
    p = Path(path)
    doc = read_json_object(p, AMAX)
    recorded_modules = doc.get("modules")
    if modules and isinstance(recorded_modules, dict) and recorded_modules \
            and not set(recorded_modules) & set(modules):
        theirs, ours = sorted(recorded_modules)[0], sorted(modules)[0]
        raise Fp8ExportError(
            f"{p}: recorded for another model: none of its {len(recorded_modules)} layer(s) "
            f"(e.g. {theirs[:80]!r}) is one of the {len(modules)} layer(s) being quantized "
            f"(e.g. {ours[:80]!r}). Run `fp8export calibrate` on this checkpoint.")
    recorded = (doc.get("checkpoint") or {}).get("files") if isinstance(doc.get("checkpoint"),
                                                                        dict) else None
    if not isinstance(recorded, dict) or not recorded:
        return
    differ = sorted(n for n in set(recorded) | set(hashes) if recorded.get(n) != hashes.get(n))
    if differ:
        name = differ[0]
        was, now = str(recorded.get(name) or "absent")[:12], str(hashes.get(name) or "absent")[:12]
        raise Fp8ExportError(
            f"{p}: recorded for another checkpoint: its weight file {name!r} had sha256 {was}…, "
            f"the one being converted has {now}… ({len(differ)} file(s) differ). Activation "
            "ranges measured on other weights would give wrong input scales; run `fp8export "
            "calibrate` on this checkpoint.")


def check_output(path: Path, force: bool, inputs: tuple[Path | None, ...] = ()) -> None:
    """Refuse, before any work, an output that is or holds one of ``inputs`` (the checkpoint,
    the data), or that replaces anything but a regular file, or anything without ``--force``."""
    p = Path(path)
    claim_output_file(p, inputs=inputs, force=force)
    if not p.parent.exists():
        raise Fp8ExportError(f"{p.parent}: the output folder does not exist; create it first.")


def amax_document(result: CalibrationResult) -> dict[str, Any]:
    """The JSON object written for ``result`` (deterministic content only)."""
    from fp8export import __version__
    from fp8export.calibration.api import expert_of
    from fp8export.numerics.fp8 import amax_to_scale

    data = Path(result.data)
    modules = {}
    for m in sorted(result.amax):
        a = float(result.amax[m])
        entry = {"amax": a, "scale": float(amax_to_scale(a, m))}
        obs = result.observed_amax.get(m)
        if obs is not None and obs != a:
            entry["observed_amax"] = float(obs)
        routed = expert_of(m, result.expert_tokens)
        if routed is not None:  # MoE: observed on every token; this many were routed to it
            entry["routed_tokens"] = routed
        modules[m] = entry
    return {
        "format": FORMAT, "version": VERSION, "tool": f"fp8export {__version__}",
        "method": result.method, "options": dict(sorted(result.options.items())),
        "samples": result.samples, "tokens": result.tokens, "device": result.device,
        "dtype": result.dtype,
        "data": {"file": data.name, "sha256": sha256_file(data) if data.is_file() else None},
        "checkpoint": {"path": str(result.checkpoint), "files": dict(result.source_files)},
        "groups": {g: list(ms) for g, ms in sorted(result.groups.items())},
        "missing": list(result.missing), "notes": list(result.notes), "modules": modules,
        **({"expert_tokens": dict(sorted(result.expert_tokens.items()))}
           if result.expert_tokens else {}),
    }


def write_amax_file(result: CalibrationResult, path: str | Path, *, force: bool = True) -> Path:
    """Write ``result`` as ``amax.json`` atomically; same result -> same bytes."""
    p = Path(path)
    check_output(p, force)
    text = json.dumps(amax_document(result), indent=2, sort_keys=True, allow_nan=False) + "\n"
    write_file_atomic(p, text.encode("utf-8"))
    return p


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_amax_file(path: str | Path) -> dict[str, ActivationRange]:
    """Ranges from an ``amax.json`` (validated: every amax finite and > 0, every field of the
    type the schema says).

    Raises Fp8ExportError naming the file and the module or field at fault.
    """
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise Fp8ExportError(f"{p}: no such amax file. Write one with `fp8export calibrate "
                             "CKPT --calib-data PATH -o amax.json`.")
    doc = read_json_object(p, AMAX)
    if doc.get("format") != FORMAT:
        raise Fp8ExportError(f"{p}: not an fp8export amax file (missing \"format\": "
                             f"\"{FORMAT}\"). Write one with `fp8export calibrate`.")
    if doc.get("version") != VERSION:
        raise Fp8ExportError(f"{p}: amax file version {str(doc.get('version'))[:20]!r} is not "
                             f"supported (this fp8export reads version {VERSION}); re-run "
                             "calibrate.")

    def bad(field: str, expected: str) -> Fp8ExportError:
        return Fp8ExportError(f"{p}: {field!r} is {str(doc.get(field))[:40]!r}; expected "
                              f"{expected}. Re-run `fp8export calibrate`.")

    modules = doc.get("modules")
    if not isinstance(modules, dict) or not modules:
        raise Fp8ExportError(f"{p}: holds no modules; re-run `fp8export calibrate`.")
    options = doc.get("options") or {}
    if not isinstance(options, dict) or not all(
            isinstance(k, str) and (v is None or isinstance(v, (str, bool)) or _number(v))
            for k, v in options.items()):
        raise bad("options", "an object of option names to plain values")
    if not (doc.get("method") is None or isinstance(doc.get("method"), str)):
        raise bad("method", "a calibrator name")
    for field in ("samples", "tokens"):
        v = doc.get(field)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise bad(field, "a count (an integer >= 0)")
    details_common = {"method": doc.get("method"), **options,
                      "samples": doc.get("samples"), "tokens": doc.get("tokens"),
                      "amax_file": p.name}
    out: dict[str, ActivationRange] = {}
    for m, entry in modules.items():
        a = entry.get("amax") if isinstance(entry, dict) else entry
        if not _number(a) or not math.isfinite(a) or a <= 0:
            raise Fp8ExportError(
                f"{p}: module {m} has amax {str(a)[:40]!r}; every amax must be a finite number "
                "> 0. Re-run `fp8export calibrate`, or remove the entry to fall back.")
        d = dict(details_common)
        if isinstance(entry, dict) and "observed_amax" in entry:
            obs = entry["observed_amax"]
            if obs is not None and (not _number(obs) or not math.isfinite(obs)):
                raise Fp8ExportError(f"{p}: module {m} has observed_amax {str(obs)[:40]!r}; "
                                     "expected a finite number. Re-run `fp8export calibrate`.")
            d["observed_amax"] = obs
        out[m] = ActivationRange(module=m, amax=float(a), source=ScaleSource.CALIBRATION,
                                 details=d)
    return out
