"""Build an :class:`InspectResult` for a checkpoint, an FP8 folder or an ONNX graph.

Tensors are loaded one at a time and dropped, so inspecting a large checkpoint needs memory for
one tensor (plus its float32 copy for the round trip), not the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8export.checkpoint.safetensors_reader import DTYPE_BYTES as BYTES
from fp8export.checkpoint.safetensors_reader import FLOAT_DTYPES as FLOAT
from fp8export.checkpoint.safetensors_reader import FP8_DTYPES as FP8
from fp8export.errors import Fp8ExportError, UsageError
from fp8export.fp8dir.manifest import MANIFEST_NAME as MANIFEST
from fp8export.fp8dir.reader import manifest_if_any
from fp8export.inspect.result import InspectResult, TensorRow

if TYPE_CHECKING:
    import torch

    from fp8export.checkpoint.source import Checkpoint, TensorInfo



def inspect(path: str | Path, plot: str | Path | None = None, as_json: bool = False,
            force: bool = False) -> InspectResult:
    """Describe a checkpoint, an FP8 folder (``convert`` output) or an ONNX graph.

    Args:
        path: anything ``open_checkpoint`` opens, an FP8 folder, or a ``.onnx`` file.
        plot: write a plot of per-layer weight scale, input scale and SQNR there: ``.svg``
            (built in) or ``.png`` (needs matplotlib), by the extension.
        as_json: accepted so ``api.inspect(path, as_json=True)`` mirrors the CLI; the result is
            the same either way (call ``to_dict()`` for JSON, ``to_text()`` for the table).
        force: replace an existing ``plot`` file.

    Returns:
        An :class:`InspectResult`. Raises Fp8ExportError for unreadable input.
    """
    del as_json  # rendering is the caller's choice; see the docstring
    p = Path(path)
    if p.suffix.lower() == ".onnx":
        if plot is not None:
            raise UsageError(f"{p}: --plot draws checkpoints and FP8 folders, not ONNX graphs. "
                             "Inspect the FP8 folder the graph was exported from instead.")
        return _inspect_onnx(p)
    if plot is not None:  # a bad --plot path fails before the (possibly long) inspection
        from fp8export.inspect.plot import check_plot_target

        check_plot_target(Path(plot), force, source=p)
    from fp8export.checkpoint.source import open_checkpoint

    manifest = manifest_if_any(p)
    with open_checkpoint(p) as ck:
        infos = ck.tensors()
        if manifest is not None or any(i.dtype in FP8 for i in infos):
            read = _read_folder(p, ours=manifest is not None)
            result = _fp8_folder(ck, infos, manifest, read.blocks)
            _folder_format(result, read)
        else:
            result = _checkpoint(ck, infos)
        result.notes[:0] = list(getattr(ck, "notes", []))
    if plot is not None:
        from fp8export.inspect.plot import write_plot

        write_plot(result, Path(plot), force=force, source=p)
        result.plot = str(plot)
    return result


# ------------------------------------------------------------------------------- checkpoint

def _targets(ck: Checkpoint, infos: list[TensorInfo],
             notes: list[str]) -> tuple[dict[str, str | None], dict[str, str]]:
    """Weights convert would quantize (→ their fused group, or None), and reasons for the rest.

    Uses convert's own selection (:func:`fp8export.scales.select.select_targets`) so the
    table shows what convert will do; falls back to a plain shape rule if selection refuses.
    """
    try:
        from fp8export.scales.select import select_targets
    except ImportError:
        select_targets = None
    if select_targets is not None:
        try:
            sel = select_targets(infos, ck.config)
            return {t.weight: t.fused_group for t in sel.targets}, dict(sel.excluded)
        except Fp8ExportError as exc:
            notes.append(f"convert would refuse this checkpoint as it is: {exc}")
    notes.append("candidates chosen by the fallback rule: 2-D float '*.weight' tensors")
    return {i.name: None for i in infos
            if i.name.endswith(".weight") and len(i.shape) == 2 and i.dtype in FLOAT}, {}


def _checkpoint(ck: Checkpoint, infos: list[TensorInfo]) -> InspectResult:
    from fp8export._progress import progress
    from fp8export.numerics.fp8 import E4M3_MAX, fake_quantize_e4m3, tensor_amax
    from fp8export.numerics.metrics import sqnr_db

    result = InspectResult(path=str(ck.path), kind="checkpoint", reader=ck.kind)
    targets, excluded = _targets(ck, infos, result.notes)
    # Pass 1: amax of every float tensor, one tensor in memory at a time.
    for info in progress(infos, total=len(infos), desc="inspect", unit="tensor"):
        row = _row(info, "candidate" if info.name in targets else
                   ("float" if info.dtype in FLOAT else "other"))
        row.note = excluded.get(info.name)
        row.fused_group = targets.get(info.name)
        if info.dtype in FLOAT and info.numel:
            row.amax = tensor_amax(ck.load(info.name))
        result.tensors.append(row)
    # Fused siblings (q/k/v, gate/up) share the largest amax, as convert does by default.
    group_amax: dict[str, float] = {}
    for row in result.tensors:
        group = targets.get(row.name)
        if group and row.amax is not None:
            group_amax[group] = max(group_amax.get(group, 0.0), row.amax)
    # Pass 2: the scale convert would use and the SQNR of the weight's FP8 round trip.
    for row in progress(result.tensors, total=len(infos), desc="round trip", unit="tensor"):
        if row.role != "candidate" or row.amax is None:
            continue
        group = targets.get(row.name)
        amax = group_amax.get(group, row.amax) if group else row.amax
        if not (math.isfinite(amax) and amax > 0):
            row.note = (f"amax is {amax}: no scale possible (NaN/Inf or all-zero weights); "
                        "convert refuses it unless it is excluded")
            continue
        row.scale = _f32(amax / E4M3_MAX)  # float32, as amax_to_scale stores it
        row.scale_source = "weights"
        if group:
            row.note = f"fused group {group} (shared scale)"
        t = ck.load(row.name)
        row.sqnr_db = sqnr_db(t, fake_quantize_e4m3(t.float(), row.scale))
        del t
    _history_input_scales(ck, result, targets)
    result.summary = _summary(result.tensors, ck.config)
    if result.training_state is not None:
        result.summary["training_state"] = result.training_state
    return result


def _history_input_scales(ck: Checkpoint, result: InspectResult,
                          targets: dict[str, str | None]) -> None:
    """Input scales that ``convert --scales history`` would take from FP8 training state."""
    from fp8export.numerics.fp8 import E4M3_MAX

    try:
        state = ck.training_state()
    except Fp8ExportError as exc:
        result.notes.append(f"FP8 training state unreadable: {exc}")
        return
    if state is None:
        return
    result.training_state = {"framework": state.framework, "version": state.version,
                             "histories": len(state.histories)}
    result.notes.extend(state.warnings)
    rows = {r.name.removesuffix(".weight"): r for r in result.tensors if r.role == "candidate"}
    try:
        from fp8export.scales.history import ranges_from_history

        ranges, notes = ranges_from_history(state, list(rows))
    except ImportError:
        result.notes.append("the history policy is not installed: input scales not shown")
        return
    except Fp8ExportError as exc:
        result.notes.append(f"convert --scales history would refuse this state: {exc}")
        return
    result.notes.extend(notes)
    # fused groups share the largest input amax, as convert does
    group_amax: dict[str, float] = {}
    for module, r in ranges.items():
        if group := targets.get(f"{module}.weight"):
            group_amax[group] = max(group_amax.get(group, 0.0), r.amax)
    for module, r in ranges.items():
        group = targets.get(f"{module}.weight")
        amax = group_amax[group] if group else r.amax
        rows[module].input_scale = _f32(amax / E4M3_MAX)
        rows[module].input_scale_source = "history"


# ------------------------------------------------------------------------------ FP8 folder

def _fp8_folder(ck: Checkpoint, infos: list[TensorInfo], manifest: dict[str, Any] | None,
                blocks: dict[str, tuple[int, int]]) -> InspectResult:
    from fp8export.numerics.fp8 import tensor_amax

    result = InspectResult(path=str(ck.path), kind="fp8-folder", reader=ck.kind)
    notes = result.notes
    m_quant: dict[str, Any] = (manifest or {}).get("quantized", {}) or {}
    m_excluded: dict[str, Any] = (manifest or {}).get("excluded", {}) or {}
    if manifest is None:
        notes.append(f"no {MANIFEST} here: scale sources and SQNR are unknown "
                     "(the folder was not written by fp8export convert)")
    elif manifest.get("format_version") != 1:
        notes.append(f"{MANIFEST} has format_version {manifest.get('format_version')!r}; "
                     "this inspect reads version 1, fields may be missing")
    names = {i.name for i in infos}
    scales = {i.name: ck.load(i.name).float() for i in infos  # F8_E8M0: UE8M0 block scales
              if i.name.endswith(_WEIGHT_SCALES + _INPUT_SCALES)
              and (i.dtype in FLOAT or i.dtype == "F8_E8M0")}

    for info in infos:
        module = info.name.rsplit(".", 1)[0]
        entry = m_quant.get(module, {}) if isinstance(m_quant.get(module), dict) else {}
        if info.name in scales:
            row = _row(info, "scale")
            values = scales[info.name]
            value = float(values.max()) if values.numel() else float("nan")
            if info.name.endswith(_WEIGHT_SCALES):
                row.scale = value
            else:
                row.input_scale = value
            if not (math.isfinite(value) and value > 0) or bool((values <= 0).any()):
                row.note = "invalid scale: must be finite and > 0"
                notes.append(f"{info.name}: scale {value} is not finite and positive; the folder "
                             "is broken — re-run convert")
        elif info.dtype in FP8 and info.name.endswith(".weight"):
            row = _row(info, "quantized")
            q = ck.load(info.name)
            ws = next((scales[n] for n in (f"{module}{s}" for s in _WEIGHT_SCALES)
                       if n in scales), None)
            if ws is None:
                row.amax = tensor_amax(q)
                row.note = "no weight_scale tensor: amax is of the raw FP8 codes"
                notes.append(f"{info.name}: FP8 weight without {module}.weight_scale")
            else:
                row.scale = float(ws.max())
                row.amax, row.note = _dequantized_amax(q, ws, blocks.get(module))
            del q
            ins = next((scales[n] for n in (f"{module}{s}" for s in _INPUT_SCALES)
                        if n in scales), None)
            row.input_scale = float(ins.max()) if ins is not None and ins.numel() else None
            row.sqnr_db = _num(entry.get("weight_sqnr_db"))
            row.scale_source = entry.get("weight_scale_source")
            row.input_scale_source = entry.get("input_scale_source")
            group = entry.get("fused_group")
            row.fused_group = group if isinstance(group, str) else None
            if manifest is not None and not entry:
                notes.append(f"{info.name}: quantized but not listed in {MANIFEST}")
        else:
            role = "float" if info.dtype in FLOAT else "other"
            row = _row(info, role)
            if info.dtype in FLOAT and info.numel:
                row.amax = tensor_amax(ck.load(info.name))
            reason = m_excluded.get(info.name) or m_excluded.get(module)
            row.note = str(reason) if reason else None
        result.tensors.append(row)

    for module in m_quant:
        if f"{module}.weight" not in names:
            notes.append(f"{MANIFEST} lists {module} as quantized but {module}.weight is missing")
    result.summary = _summary(result.tensors, ck.config)
    experts = expert_tokens(m_quant)
    if experts:
        result.summary["expert_routed_tokens"] = experts
        for layer, counts in experts.items():
            notes.append(f"{layer}: tokens routed to each expert during calibration "
                         f"{list(counts.values())} (every expert's input range was observed "
                         "on all calibration tokens)")
    if manifest is not None:
        result.summary.update({k: manifest.get(k) for k in
                               ("output_format", "activation_scheme", "format_version")})
        result.summary["source"] = (manifest.get("source") or {}).get("name")
        result.notes.extend(str(n) for n in manifest.get("notes") or [])
    result.summary["kv_cache"] = _kv_cache(manifest, names)
    _dialect(result, ck.config)
    return result


def _kv_cache(manifest: dict[str, Any] | None, names: set[str]) -> str | None:
    """The FP8 KV cache the folder declares (the manifest's entry, else its k_scale tensors)."""
    from fp8export.fp8dir.manifest import kv_cache_line

    line = kv_cache_line((manifest or {}).get("kv_cache"))
    k_scales = [n for n in names if n.endswith(".k_scale")]
    if line is None and k_scales:
        line = f"FP8: k_scale/v_scale tensors for {len(k_scales)} attention layer(s)"
    return line


def expert_tokens(quantized: dict[str, Any]) -> dict[str, dict[str, int]]:
    """MoE layer (``<experts>``) -> expert index -> tokens routed to it during calibration,
    from the manifest's ``input_details.routed_tokens``."""
    out: dict[str, dict[str, int]] = {}
    for module, entry in sorted(quantized.items()):
        details = entry.get("input_details") if isinstance(entry, dict) else None
        routed = details.get("routed_tokens") if isinstance(details, dict) else None
        head = module.rpartition(".")[0]
        experts, _, index = head.rpartition(".")
        if isinstance(routed, int) and index.isdigit():
            out.setdefault(experts, {})[index] = routed
    return {k: dict(sorted(v.items(), key=lambda kv: int(kv[0]))) for k, v in out.items()}


def _dialect(result: InspectResult, config: dict[str, Any] | None) -> None:
    """The folder's quantization_config dialect (config.json decides what a loader will do)."""
    from fp8export.config import OutputFormat
    from fp8export.fp8dir.formats import dialect_of, format_notes, loaded_by
    from fp8export.keras_model.config import is_keras_config

    dialect = dialect_of((config or {}).get("quantization_config"))
    s = result.summary
    if s.get("output_format") and dialect and s["output_format"] != dialect:
        result.notes.append(f"config.json declares {dialect} but {MANIFEST} says "
                            f"{s['output_format']}: config.json was edited; loaders follow it")
    s["output_format"] = dialect or s.get("output_format")
    known = {str(f): f for f in OutputFormat}
    keras = is_keras_config(config)
    s["loaded_by"] = loaded_by(known[dialect], keras=keras) if dialect in known else None
    for note in format_notes(known[dialect], keras=keras) if dialect in known else []:
        if note not in result.notes:
            result.notes.insert(0, note)


@dataclass
class _Read:
    """What the one reader made of an FP8 folder (or why it refused it)."""

    fmt: Any = None  # FolderFormat
    notes: list[str] = field(default_factory=list)  # a foreign folder's notes
    loaders: Any = None  # fp8dir.engines.Loaders
    blocks: dict[str, tuple[int, int]] = field(default_factory=dict)  # module -> block size
    refused: str | None = None


def _read_folder(path: Path, ours: bool) -> _Read:
    """The folder through the one reader. A folder convert wrote (``ours``) that the reader
    refuses (edited or damaged) is an error, as it is for every other command; one another tool
    wrote that fp8export cannot run, or that its engines would misread, is still shown, with
    the reason."""
    from fp8export.fp8dir.reader import read_fp8_folder

    try:
        with read_fp8_folder(path) as folder:
            blocks = {n: tuple(e["block_size"]) for n, e in folder.manifest["quantized"].items()
                      if e.get("block_size")}
            notes = [str(n) for n in folder.manifest.get("notes") or []] \
                if not folder.format.ours else []
            return _Read(folder.format, notes, folder.loaders, blocks)
    except Fp8ExportError as exc:
        if ours and not (path / "config.json").is_file():
            from fp8export.fp8dir.reader import validate_written_folder

            validate_written_folder(path)  # its layers and scales are still checked
        elif ours:
            raise
        return _Read(refused=str(exc))


def _folder_format(result: InspectResult, read: _Read) -> None:
    """What the one reader made of the folder: producer, dialect, granularity, activations,
    and which engines load it (``loaded_by``: none when the reader refused it)."""
    s = result.summary
    if read.refused is not None:
        s["loaded_by"] = []
        result.notes.append(f"fp8export cannot run this folder: {read.refused}")
        return
    if read.fmt is None:  # convert's folder without config.json: its layers were validated
        return
    fmt = read.fmt
    s.update(format=fmt.describe(), producer=fmt.producer, weight_granularity=fmt.granularity,
             block_size=fmt.to_dict()["block_size"], activations=fmt.activations,
             dynamic_activations=fmt.dynamic, group_size=fmt.group_size,
             written_by_fp8export=fmt.ours)
    s["activation_scheme"] = s.get("activation_scheme") or fmt.activations
    s["output_format"] = s.get("output_format") or fmt.dialect
    if read.loaders is not None:
        s["loaded_by"] = list(read.loaders.ok)
        s["not_loaded_by"] = dict(read.loaders.not_ok)
        if any(e.startswith("transformers") for e in read.loaders.ok):
            from fp8export.fp8dir.formats import VLLM_ONLY

            result.notes[:] = [n for n in result.notes if n != VLLM_ONLY]
        result.notes.extend(n for n in read.loaders.notes() if n not in result.notes)
    result.notes.extend(n for n in read.notes if n not in result.notes)


_WEIGHT_SCALES = (".weight_scale", ".weight_scale_inv")
_INPUT_SCALES = (".input_scale", ".activation_scale")


def _dequantized_amax(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
                      ) -> tuple[float, str | None]:
    """max |q * scale| of a stored weight and a note on its scales; ``block``: the block size
    the reader found for the layer (None: a scalar or one scale per output row, or a folder
    the reader refused, whose scales are then not interpreted)."""
    from fp8export.numerics.fp8 import tensor_amax

    codes = q.float().abs()
    if scale.numel() == 1:
        return tensor_amax(codes) * float(scale.reshape(())), None
    if block is not None and codes.dim() == 2:
        from fp8export.numerics.block import expand_blocks

        shape = tuple(codes.shape)
        block = (min(block[0], shape[0]), min(block[1], shape[1]))
        note = f"block scales, grid {scale.shape[0]}x{scale.shape[1]}; the largest is shown"
        return tensor_amax(codes * expand_blocks(scale.reshape(scale.shape[0], -1), shape,
                                                 block)), note
    if codes.dim() == 2 and scale.numel() == codes.shape[0]:
        return (tensor_amax(codes * scale.reshape(-1, 1)),
                f"{scale.numel()} per-channel scales; the largest is shown")
    return tensor_amax(codes), (f"scale of shape {list(scale.shape)} not read (see the notes): "
                                "amax is of the raw FP8 codes")


# ------------------------------------------------------------------------------------ ONNX

def _inspect_onnx(p: Path) -> InspectResult:
    if not p.is_file():
        raise Fp8ExportError(f"{p}: no such file. Give the path of an ONNX model.")
    from fp8export._progress import stage
    from fp8export.onnx.check import check_model
    from fp8export.onnx.levels import read_metadata

    with stage(f"checking {p} (onnx.checker, TensorRT FP8 rules)"):
        report = check_model(p)
    result = InspectResult(path=str(p), kind="onnx", ok=bool(report.ok),
                           report_text=report.to_text())
    to_dict = getattr(report, "to_dict", None)
    result.report = to_dict() if callable(to_dict) else None
    # what export-onnx found when it ran the graph at each onnxruntime level
    levels = read_metadata(getattr(report, "metadata", None) or {}, p)
    if levels is not None:
        result.summary["onnxruntime_levels"] = levels
        result.notes.append(_levels_text(levels))
    return result


def _levels_text(levels: dict[str, Any]) -> str:
    """One line on export-onnx's run of the graph at each onnxruntime optimization level."""
    version = levels.get("onnxruntime", "?")
    if levels.get("skipped"):
        return f"onnxruntime levels: not compared at export ({levels['skipped']})"
    wrong = levels.get("wrong") or []
    if not wrong:
        ran = ", ".join(levels.get("levels") or {})
        return f"onnxruntime levels: {ran} give the same outputs (onnxruntime {version}, " \
               "checked at export)"
    use = levels.get("use")
    fix = f"; use SessionOptions.graph_optimization_level = {use}" if use else \
        "; no level runs it correctly"
    return (f"onnxruntime levels: WRONG at {', '.join(wrong)} (onnxruntime {version} computes "
            f"it differently than ORT_DISABLE_ALL){fix}")


# --------------------------------------------------------------------------------- helpers

def _row(info: TensorInfo, role: str) -> TensorRow:
    return TensorRow(name=info.name, dtype=info.dtype, shape=list(info.shape),
                     nbytes=info.numel * BYTES.get(info.dtype, 0), role=role)


def _f32(x: float) -> float:
    import numpy as np

    return float(np.float32(x))


def _num(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if value in ("inf", "-inf", "nan"):  # how JSON writers spell non-finite numbers
        return float(value)
    return None


def _summary(rows: list[TensorRow], config: dict[str, Any] | None) -> dict[str, Any]:
    by_dtype: dict[str, dict[str, int]] = {}
    for r in rows:
        d = by_dtype.setdefault(r.dtype, {"tensors": 0, "bytes": 0})
        d["tensors"] += 1
        d["bytes"] += r.nbytes
    weights = [r for r in rows if r.name.endswith(".weight") and len(r.shape) == 2]
    quant = [r for r in rows if r.role in ("quantized", "candidate")]
    sqnrs = [(r.sqnr_db, r.name) for r in quant
             if r.sqnr_db is not None and not math.isnan(r.sqnr_db)]
    scales = [r.scale for r in quant if r.scale is not None]
    summary: dict[str, Any] = {
        "tensors": len(rows),
        "parameters": sum(math.prod(r.shape) for r in rows),
        "bytes": sum(r.nbytes for r in rows),
        "by_dtype": dict(sorted(by_dtype.items())),
        "quantized": len([r for r in quant if r.role == "quantized"]),
        "fp8_candidates": len([r for r in quant if r.role == "candidate"]),
        "high_precision_weights": len([r for r in weights
                                       if r.role not in ("quantized", "candidate")]),
        "static_input_scales": len([r for r in quant if r.input_scale is not None]),
        "sqnr_db_min": min(sqnrs)[0] if sqnrs else None,
        "sqnr_db_min_tensor": min(sqnrs)[1] if sqnrs else None,
        "weight_scale_min": min(scales) if scales else None,
        "weight_scale_max": max(scales) if scales else None,
    }
    if config:
        summary["model_type"] = config.get("model_type")
        summary["architectures"] = config.get("architectures")
        qc = config.get("quantization_config")
        if isinstance(qc, dict):
            summary["quantization_config"] = qc.get("quant_method") or qc.get("format")
    return summary
