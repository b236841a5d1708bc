"""What a verification judged: the facts at the top of every report (``report.json`` "header").

Tool version, the command, the time, the reference and the candidate with content hashes, the
data file with its hash and sample count, backend, device, dtype and library versions. A CI
artefact that says PASSED must say *what* passed.

Content hash of a folder: the sha256 of its ``sha256sum``-style listing (``<sha256>  <name>``
lines, sorted by name) of the regular files directly inside it, so
``cd DIR && LC_ALL=C sha256sum * | sha256sum`` reproduces it when DIR holds only regular files.
A file's hash is its sha256 (with ``<file>.data`` beside an ``.onnx``, its external weights).
Symbolic links, hidden files and sub-folders are not read (so nothing outside the given path
is) and are listed as skipped.
"""

from __future__ import annotations

import hashlib
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fp8export import __version__
from fp8export.fp8dir.manifest import MANIFEST_NAME
from fp8export.io.hashing import file_sha256

HASH_NOTICE_BYTES = 2 * 10**9


def content_hash(path: Path) -> dict[str, Any]:
    """``{"sha256", "files": [{name, sha256, bytes}], "bytes", "skipped"}`` of a file or folder."""
    path = Path(path)
    files: list[Path] = []
    skipped: list[str] = []
    if path.is_dir():
        for p in sorted(path.iterdir(), key=lambda q: q.name):
            if p.is_symlink() or not p.is_file() or p.name.startswith("."):
                skipped.append(p.name + ("/" if p.is_dir() and not p.is_symlink() else ""))
            else:
                files.append(p)
    elif path.is_file() and not path.is_symlink():
        files.append(path)
        data = path.with_name(path.name + ".data")
        if path.suffix.lower() == ".onnx" and data.is_file() and not data.is_symlink():
            files.append(data)
    else:
        skipped.append(path.name)
    entries = [{"name": p.name, "sha256": file_sha256(p), "bytes": p.stat().st_size}
               for p in files]
    if path.is_dir() or len(entries) > 1:
        listing = "".join(f"{e['sha256']}  {e['name']}\n" for e in entries)
        digest = hashlib.sha256(listing.encode("utf-8")).hexdigest()
    else:
        digest = entries[0]["sha256"] if entries else None
    return {"sha256": digest, "files": entries, "bytes": sum(e["bytes"] for e in entries),
            "skipped": skipped}


def converted_from(candidate: Path, reference_files: list[dict[str, Any]]
                   ) -> tuple[bool | None, list[str]]:
    """Does the FP8 folder's manifest name the reference's files as its source?

    Returns ``(True, [])`` when every source file the manifest lists is in the reference with the
    same sha256, ``(False, [differing names])`` when not, ``(None, [])`` when the candidate
    records no source (not an FP8 folder, or an unreadable manifest).
    """
    from fp8export.errors import Fp8ExportError
    from fp8export.fp8dir.manifest import read_manifest

    manifest = Path(candidate) / MANIFEST_NAME
    if not manifest.is_file() or manifest.is_symlink():
        return None, []
    try:
        source = read_manifest(Path(candidate)).get("source") or {}
        listed = [f for f in source.get("files") or [] if isinstance(f, dict)]
    except Fp8ExportError:
        return None, []
    if not listed:
        return None, []
    ours = {e["name"]: e["sha256"] for e in reference_files}
    differ = [str(f.get("name")) for f in listed if ours.get(f.get("name")) != f.get("sha256")]
    return not differ, differ


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "platform": platform.platform(terse=True)}
    for name in ("torch", "transformers", "onnxruntime", "tensorrt", "numpy"):
        module = sys.modules.get(name)  # only what this run imported: report what ran
        version = getattr(module, "__version__", None)
        if version:
            out[name] = str(version)
    return out


def _device_name(device: str | None) -> str | None:
    if not device or not str(device).startswith("cuda"):
        return None
    torch = sys.modules.get("torch")
    try:
        first = str(device).split(",")[0]  # a model spread over GPUs: "cuda:0,cuda:1"
        return str(torch.cuda.get_device_name(torch.device(first))) if torch else None
    except Exception:  # the name is decoration; never fail a verification over it
        return None


def _ort_level_text(candidate: dict[str, Any]) -> str | None:
    level = candidate.get("graph_optimization_level")
    return f"graph optimization {level}, {candidate.get('level_source')}" if level else None


def header(cfg, *, reference: dict[str, Any], candidate: dict[str, Any], kind: str,
           data: dict[str, Any], backend: str) -> dict[str, Any]:
    """The report header of one verification (plain data; see the module docstring).

    Args:
        cfg: the :class:`~fp8export.verify.config.VerifyConfig` that ran.
        reference, candidate: the runners' ``describe()``.
        kind: the candidate kind ("fp8-folder", "onnx", "engine", "hf-folder").
        data: ``data_info`` of :func:`fp8export.verify.data.load_verify_samples`.
        backend: the candidate runner's backend name.
    """
    size = sum(p.stat().st_size for root in (Path(cfg.reference), Path(cfg.candidate))
               for p in ([*root.iterdir()] if root.is_dir() else [root])
               if p.is_file() and not p.is_symlink())
    if size > HASH_NOTICE_BYTES:  # minutes on a large model: say why it is busy
        from fp8export._progress import info

        info(f"hashing the reference and the candidate for the report ({size / 1e9:.1f} GB)")
    ref_hash = content_hash(cfg.reference)
    cand_hash = content_hash(cfg.candidate)
    matches, differ = (converted_from(cfg.candidate, ref_hash["files"]) if kind == "fp8-folder"
                       else (None, []))
    data_entry: dict[str, Any] = {"source": data.get("source"), "samples": data.get("samples"),
                                  "tokens": data.get("tokens"), "builtin": data.get("builtin")}
    if cfg.data is not None and Path(cfg.data).is_file():
        data_entry["sha256"] = file_sha256(Path(cfg.data))
    device = candidate.get("device") or reference.get("device")
    options = cfg.to_dict()
    options.pop("command_line", None)
    return {
        "tool": {"name": "fp8export", "version": __version__},
        "command": cfg.command_line,
        "options": options,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "reference": {"path": str(cfg.reference), "dtype": reference.get("dtype"),
                      "backend": reference.get("backend"), "device": reference.get("device"),
                      **ref_hash},
        "candidate": {"path": str(cfg.candidate), "kind": kind, "backend": backend,
                      "mode": candidate.get("mode"), "device": candidate.get("device"),
                      "converted_from_reference": matches, "source_mismatch": differ,
                      **cand_hash},
        "data": data_entry,
        "backend": backend,
        # which FP8 GEMM path ran (torch FP8 runner), or onnxruntime's optimization level
        "runtime": candidate.get("fp8_path") or _ort_level_text(candidate),
        "device": str(device) if device else None,
        "device_name": _device_name(device),
        "dtype": {"reference": reference.get("dtype"), "candidate": candidate.get("dtype")},
        "environment": _versions(),
    }
