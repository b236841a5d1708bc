"""Plain aligned text for an :class:`InspectResult` (stable, greppable, no terminal needed)."""

from __future__ import annotations

import math

from fp8export.inspect.result import InspectResult, TensorRow

COLUMNS = ("name", "dtype", "shape", "amax", "scale", "input_scale", "sqnr_db", "source", "note")
HEADINGS = ("name", "dtype", "shape", "amax", "scale", "input scale", "SQNR dB", "source", "note")


def _g(x: float | None, spec: str = ".4g") -> str:
    if x is None:
        return ""
    return str(x) if not math.isfinite(x) else format(x, spec)


def _cells(r: TensorRow) -> list[str]:
    source = "/".join(s for s in (r.scale_source, r.input_scale_source) if s)
    return [r.name, r.dtype, "[" + ", ".join(map(str, r.shape)) + "]", _g(r.amax), _g(r.scale),
            _g(r.input_scale), _g(r.sqnr_db, ".1f"), source, r.note or ""]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table(rows: list[TensorRow]) -> list[str]:
    grid = [list(HEADINGS), *(_cells(r) for r in rows)]
    # drop columns that are empty in every row (e.g. input scale for a bf16 checkpoint)
    keep = [j for j in range(len(HEADINGS)) if j < 3 or any(row[j] for row in grid[1:])]
    widths = [max(len(row[j]) for row in grid) for j in keep]
    numeric = {3, 4, 5, 6}
    lines = []
    for i, row in enumerate(grid):
        cells = [row[j].rjust(w) if j in numeric and i else row[j].ljust(w)
                 for j, w in zip(keep, widths)]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def render_text(result: InspectResult) -> str:
    if result.kind == "onnx":
        status = "OK" if result.ok else "FAILED"
        text = f"{result.path}: ONNX graph — checks {status}\n{result.report_text or ''}".rstrip()
        return "\n".join([text, *(f"  {note}" for note in result.notes)])
    s = result.summary
    what = "FP8 folder" if result.kind == "fp8-folder" else "checkpoint"
    model = f", {s['model_type']}" if s.get("model_type") else ""
    lines = [f"{result.path}: {what} ({result.reader}{model})", ""]
    lines += table(result.tensors)
    lines += ["", "Summary",
              f"  tensors       {s['tensors']} ({s['parameters']:,} values, {_size(s['bytes'])})"]
    lines += [f"  {dtype:<13} {d['tensors']} tensors, {_size(d['bytes'])}"
              for dtype, d in s["by_dtype"].items()]
    if result.kind == "fp8-folder":
        lines.append(f"  quantized     {s['quantized']} FP8 weights, "
                     f"{s['high_precision_weights']} 2-D weights kept in high precision")
        if s.get("weight_granularity"):
            block = s.get("block_size")
            lines.append(f"  weights       {s['weight_granularity']} scales"
                         + (f", {block[0]}x{block[1]} blocks" if block else ""))
        dynamic = s.get("dynamic_activations")
        how = ""
        if dynamic and s.get("activation_scheme") != "static":
            how = " per token group" if dynamic == "group" else f" per {dynamic}"
            how += f" of {s['group_size']}" if s.get("group_size") else ""
        lines.append(f"  activations   {s.get('activation_scheme') or 'unknown'}{how} "
                     f"({s['static_input_scales']} static input scales)")
        if s.get("kv_cache"):
            lines.append(f"  kv cache      {s['kv_cache']}")
        if s.get("output_format"):
            loaders = s.get("loaded_by")
            only = "" if any(n.startswith("transformers") for n in loaders or ()) else " only"
            where = f" (loads in {' and '.join(loaders)}{only})" if loaders else ""
            if loaders is not None and not loaders:
                where = " (no engine loads it as written: see the notes)"
            lines.append(f"  format        {s['output_format']}{where}")
        if s.get("producer"):
            lines.append(f"  written by    {s['producer']}")
    else:
        lines.append(f"  FP8 weights   {s['fp8_candidates']} would be quantized "
                     "(scale = amax / 448), "
                     f"{s['high_precision_weights']} 2-D weights stay in high precision")
        if result.training_state:
            ts = result.training_state
            lines.append(f"  FP8 training  {ts['framework']} {ts['version'] or ''} "
                         f"({ts['histories']} amax histories; {s['static_input_scales']} input "
                         "scales from history)")
    if s.get("sqnr_db_min") is not None:
        lines.append(f"  SQNR          min {_g(s['sqnr_db_min'], '.1f')} dB "
                     f"({s['sqnr_db_min_tensor']})")
    if s.get("weight_scale_min") is not None:
        lines.append(f"  weight scale  {_g(s['weight_scale_min'])} .. {_g(s['weight_scale_max'])}")
    if result.notes:
        lines += ["", "Notes"] + [f"  - {n}" for n in result.notes]
    if result.plot:
        lines += ["", f"Plot written to {result.plot}"]
    return "\n".join(lines)
