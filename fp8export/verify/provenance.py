"""What a verification judged: the facts at the top of every report (``report.json`` "header").

Tool version, the command, the time, the reference and the candidate with content hashes, the
data file with its hash and sample count, backend, device, dtype and library versions. A CI
artefact that says PASSED must say *what* passed.

Content hash of a folder: the sha256 of the ``sha256sum``-style listing (``<sha256>  <name>``
lines, sorted by name) of the files verify reads from it, and only those: the weight files and
their index (the checkpoint reader's list; their size is what their headers describe, the
readers refuse anything more), ``config.json``, for an FP8 folder its manifest and
``hf_quant_config.json``, and for the reference the tokenizer files its tokenizer is made from.
Each of those small files is hashed only within the size limit its reader enforces. Anything
else (an optimizer state, logs, ``generation_config.json``, a 200 GB sparse file beside the
model, a file an edited manifest lists) is not read, only named as skipped; so are symbolic
links and hidden files. ``cd DIR && LC_ALL=C sha256sum FILES | sha256sum`` reproduces it. A
file's hash is its sha256 (with an ``.onnx``, the external-data files the graph names, when
their size is what the graph reads).

An FP8 folder's manifest records the sha256 of every file convert wrote (``files``); a folder
whose files differ from that was edited after convert: the report lists them and does not
claim it was converted from the reference. Listed files verify does not read are compared by
presence and size, not hashed.
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
from fp8export.inputs.tokenizer import TOKENIZER_CONFIG, TOKENIZER_FILES
from fp8export.io.guarded import CONFIG, MANIFEST, TOKENIZER
from fp8export.io.hashing import file_sha256

# Files verify reads besides the weights, each through the guarded opener within its kind's
# size limit (a larger one is refused when read; here it is not hashed either).
_READ = (("config.json", CONFIG), (MANIFEST_NAME, MANIFEST), ("hf_quant_config.json", CONFIG))
_TOKENIZER = ((TOKENIZER_CONFIG, CONFIG), *((n, TOKENIZER) for n in TOKENIZER_FILES))
# Bytes an external-data file may hold beyond the last byte its graph reads (alignment).
_ONNX_DATA_SLACK = 1 << 20


def files_read(path: Path, *, tokenizer: bool = True) -> tuple[list[Path], list[str]]:
    """The files of ``path`` that verify reads (see the module docstring; ``tokenizer``: its
    tokenizer files too, as for the reference), and the names of the other entries of a
    folder, which are not read."""
    path = Path(path)
    if not path.is_dir():
        files = [path] if path.is_file() and not path.is_symlink() else []
        if files and path.suffix.lower() == ".onnx":
            files += _onnx_data(path)
        return files, ([] if files else [path.name])
    from fp8export.checkpoint.source import open_checkpoint
    from fp8export.errors import Fp8ExportError

    wanted: dict[Path, Any] = {}
    try:
        with open_checkpoint(path) as ckpt:
            wanted.update(dict.fromkeys(ckpt.source_files))
    except Fp8ExportError:  # the runner says what is wrong with it; nothing to hash here
        pass
    for name, kind in (*_READ, *(_TOKENIZER if tokenizer else ())):
        wanted.setdefault(path / name, kind)
    files = sorted((p for p, kind in wanted.items() if p.is_file() and not p.is_symlink()
                    and p.resolve().is_relative_to(path.resolve())
                    and (kind is None or p.stat().st_size <= kind.max_bytes)),
                   key=lambda p: p.relative_to(path).as_posix())
    top = {p.relative_to(path).parts[0] for p in files}
    skipped = sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "")
                     for p in path.iterdir() if p.name not in top)
    return files, skipped


def _onnx_data(path: Path) -> list[Path]:
    """The external-data files an ``.onnx`` graph reads, when there may be any (a
    ``<name>.data`` beside it) and each holds no more than the graph reads (plus alignment):
    a 200 GB file beside a graph that reads 1 MB of it is not hashed."""
    if not path.with_name(path.name + ".data").is_file():
        return []
    from fp8export.errors import Fp8ExportError
    from fp8export.onnx.load import external_extents, load_onnx

    try:
        extents = external_extents(load_onnx(path), path)
    except Fp8ExportError:
        return []
    return [f for f, end in sorted(extents.items())
            if not f.is_symlink() and f.stat().st_size <= end + _ONNX_DATA_SLACK]


def content_hash(path: Path, *, tokenizer: bool = True) -> dict[str, Any]:
    """``{"sha256", "files": [{name, sha256, bytes}], "bytes", "skipped"}`` of a file or folder
    (only the files :func:`files_read` lists are read)."""
    from fp8export._time_limit import check, expired

    path = Path(path)
    files, skipped = files_read(path, tokenizer=tokenizer)
    base = path if path.is_dir() else path.parent
    entries = []
    for p in files:  # under verify's time limit: stopped within a chunk of reaching it
        digest = file_sha256(p, stop=expired())
        check()
        entries.append({"name": p.relative_to(base).as_posix(), "sha256": digest,
                        "bytes": p.stat().st_size})
    if path.is_dir() or len(entries) > 1:
        listing = "".join(f"{e['sha256']}  {e['name']}\n" for e in entries)
        digest = hashlib.sha256(listing.encode("utf-8")).hexdigest()
    else:
        digest = entries[0]["sha256"] if entries else None
    return {"sha256": digest, "files": entries, "bytes": sum(e["bytes"] for e in entries),
            "skipped": skipped}


def edited_files(candidate: Path, files: list[dict[str, Any]]) -> list[str] | None:
    """Files of an FP8 folder that differ from what convert wrote (its manifest's ``files``):
    the hashed ones (``files``, :func:`content_hash`'s) by sha256, the others by presence and
    size; None when the manifest records no files (older folders)."""
    import os
    import stat

    from fp8export.errors import Fp8ExportError
    from fp8export.fp8dir.manifest import read_manifest
    from fp8export.io.paths import contained

    folder = Path(candidate)
    if not (folder / MANIFEST_NAME).is_file():
        return None
    try:
        written = read_manifest(folder).get("files")
    except Fp8ExportError:
        return None
    if not isinstance(written, list) or not written:
        return None
    now = {e["name"]: e["sha256"] for e in files}
    edited = []
    for e in written:
        name = e.get("name") if isinstance(e, dict) else None
        if name in now:
            if now[name] != e.get("sha256"):
                edited.append(str(name))
            continue
        try:  # not read by verify: there, of the size convert wrote?
            st = os.lstat(contained(folder, name, named_by=folder / MANIFEST_NAME))
            same = stat.S_ISREG(st.st_mode) and st.st_size == e.get("bytes")
        except (Fp8ExportError, OSError):
            same = False
        if not same:
            edited.append(str(name))
    return sorted(edited)


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
        data: ``data_info`` of :func:`fp8export.inputs.eval_data.load_verify_samples`.
        backend: the candidate runner's backend name.
    """
    from fp8export._progress import stage

    size = sum(p.stat().st_size for root, tok in ((cfg.reference, True), (cfg.candidate, False))
               for p in files_read(Path(root), tokenizer=tok)[0])
    shown = f"{size / 1e9:.1f} GB" if size >= 10**9 else f"{size / 1e6:.1f} MB"
    with stage(f"hashing the reference and the candidate for the report ({shown})"):
        ref_hash = content_hash(cfg.reference)
        cand_hash = content_hash(cfg.candidate, tokenizer=False)  # verify reads the reference's
    matches, differ = (converted_from(cfg.candidate, ref_hash["files"]) if kind == "fp8-folder"
                       else (None, []))
    edited = edited_files(cfg.candidate, cand_hash["files"]) if kind == "fp8-folder" else None
    if edited and matches:
        matches = False  # the weights it was converted from, but not what convert wrote
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
                      "edited_after_convert": edited,
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
