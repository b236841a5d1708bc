"""onnxruntime's graph optimization levels: their names, and does each compute the same graph?

onnxruntime rewrites a graph before running it, more at each level (``ORT_DISABLE_ALL`` <
``ORT_ENABLE_BASIC`` < ``ORT_ENABLE_EXTENDED`` < ``ORT_ENABLE_ALL``, the default of
``InferenceSession(path)``). Its Q/DQ rewrites were written for int8; on an FP8 graph some of
them change the answer without an error (docs/onnx.md, "onnxruntime optimization levels").
export-onnx emits a pattern that every level computes alike, and checks it: it runs the written
graph once per level on the trace's example input and compares each level's outputs with
``ORT_DISABLE_ALL`` (onnxruntime running the graph as written). A level that differs is recorded
in the model's ``metadata_props`` (:data:`METADATA_KEY`), shown by ``inspect``, and named in a
``note:`` with the session option to use instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fp8export.errors import Fp8ExportError, UsageError

# onnxruntime.GraphOptimizationLevel member names, lowest first
LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")
CHOICES = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
           "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}
METADATA_KEY = "fp8export.onnxruntime_levels"
STATUSES = ("same", "differs", "fails")  # a level's verdict against ORT_DISABLE_ALL
# Levels that agree differ only by float rounding in fused kernels: on the test suite's exports
# 0, and 2.7e-7 relative L2 for a tiny BERT in fp32 (fused LayerNorm/attention). fp16 leaves
# room for one FP8 code flipped by a fused fp16 kernel. The two broken rewrites documented in
# docs/onnx.md moved outputs by 1.2e-4 (the Keras sample's fp16 bias) to 0.7 (dropped Relu).
REL_L2_TOL = {"fp32": 1e-5, "fp16": 1e-3}


def level_name(choice: str | None) -> str | None:
    """``--ort-opt-level`` value (disable|basic|extended|all, or a full member name) -> the
    ``GraphOptimizationLevel`` member name; None stays None (onnxruntime's default)."""
    if choice is None:
        return None
    text = str(choice).strip()
    if text.upper() in LEVELS:
        return text.upper()
    if text.lower() in CHOICES:
        return CHOICES[text.lower()]
    raise UsageError(f"--ort-opt-level {choice!r}: use one of {', '.join(CHOICES)} "
                     "(onnxruntime's ORT_DISABLE_ALL .. ORT_ENABLE_ALL).")


def choice_of(level: str) -> str:
    """``ORT_ENABLE_BASIC`` -> ``basic``: the ``--ort-opt-level`` value that picks ``level``."""
    return next(k for k, v in CHOICES.items() if v == level)


def default_level() -> str:
    """The level ``InferenceSession(path)`` uses when no SessionOptions say otherwise."""
    import onnxruntime as ort

    return ort.SessionOptions().graph_optimization_level.name


def session_options(level: str | None):
    """SessionOptions at ``level`` (a member name), or untouched (onnxruntime's default)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if level is not None:
        opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    return opts


@dataclass
class LevelCheck:
    """Each level's outputs compared with ``ORT_DISABLE_ALL`` on one input (JSON-able)."""

    onnxruntime: str
    dtype: str
    tolerance: float  # relative L2 above which a level "differs"
    levels: dict[str, dict[str, Any]] = field(default_factory=dict)  # level -> status, metrics
    skipped: str = ""  # why nothing was run (e.g. a bf16 graph onnxruntime cannot run)

    @property
    def wrong(self) -> list[str]:
        """Levels that fail or differ from ``ORT_DISABLE_ALL``."""
        return [lv for lv, r in self.levels.items() if r["status"] != "same"]

    @property
    def use(self) -> str | None:
        """The highest level that agrees with ``ORT_DISABLE_ALL`` (None: all agree)."""
        if not self.wrong:
            return None
        good = [lv for lv in LEVELS if self.levels.get(lv, {}).get("status") == "same"]
        return good[-1] if good else None

    def note(self) -> str | None:
        """One line for a user when a level computes the graph wrongly, else None."""
        if not self.wrong:
            return None
        if LEVELS[0] in self.wrong:  # not even the graph as written runs
            error = self.levels[LEVELS[0]].get("error", "")
            return (f"onnxruntime {self.onnxruntime} cannot run this graph at any optimization "
                    f"level ({error}); check it with `fp8export inspect`.")
        bad = ", ".join(self.wrong)
        default = " (onnxruntime's default)" if "ORT_ENABLE_ALL" in self.wrong else ""
        fix = (f"create the session with SessionOptions.graph_optimization_level = "
               f"GraphOptimizationLevel.{self.use}" if self.use else
               "none of its levels runs it correctly; use TensorRT")
        return (f"onnxruntime {self.onnxruntime} computes this graph differently at {bad}"
                f"{default} than as written (ORT_DISABLE_ALL): {fix}.")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"onnxruntime": self.onnxruntime, "dtype": self.dtype,
                               "compared_with": LEVELS[0], "rel_l2_tolerance": self.tolerance,
                               "levels": self.levels, "wrong": self.wrong, "use": self.use}
        if self.skipped:
            out["skipped"] = self.skipped
        return out

    def metadata_value(self) -> str:
        """What export-onnx writes under :data:`METADATA_KEY`: the verdict, not the metrics
        (they vary with the thread count; the bytes of an export do not)."""
        verdict = {lv: r["status"] for lv, r in self.levels.items()}
        return json.dumps({"onnxruntime": self.onnxruntime, "levels": verdict,
                           "wrong": self.wrong, "use": self.use,
                           **({"skipped": self.skipped} if self.skipped else {})})


def _compare(ref: list[np.ndarray], got: list[np.ndarray]) -> tuple[float, float]:
    """(relative L2, max |difference| / max |reference|) over all outputs, in float64."""
    import torch

    from fp8export.numerics.metrics import rel_l2

    a = np.concatenate([np.asarray(r, np.float64).ravel() for r in ref])
    b = np.concatenate([np.asarray(g, np.float64).ravel() for g in got])
    if not (np.isfinite(a).all() and np.isfinite(b).all()):  # NaN/Inf must sit in the same places
        same = np.array_equal(a, b, equal_nan=True)
        return (0.0, 0.0) if same else (float("inf"), float("inf"))
    scale = float(np.abs(a).max()) or 1.0
    return rel_l2(torch.from_numpy(a), torch.from_numpy(b)), float(np.abs(a - b).max()) / scale


def compare_levels(model: bytes | str, feed: dict[str, np.ndarray], *, dtype: str,
                   providers: list[str] | None = None) -> LevelCheck:
    """Run ``model`` (serialized bytes or a path) at every level on ``feed``; compare each with
    ``ORT_DISABLE_ALL``. A level whose session or run fails is recorded as "fails"."""
    import onnxruntime as ort

    check = LevelCheck(onnxruntime=ort.__version__, dtype=dtype,
                       tolerance=REL_L2_TOL.get(dtype, REL_L2_TOL["fp16"]))
    providers = providers or ["CPUExecutionProvider"]
    outputs: dict[str, list[np.ndarray]] = {}
    for level in LEVELS:
        opts = session_options(level)
        opts.log_severity_level = 3
        opts.intra_op_num_threads = 1  # the same reductions in the same order at every level
        try:
            session = ort.InferenceSession(model, opts, providers=providers)
            outputs[level] = session.run(None, feed)
        except Exception as exc:  # onnxruntime's own error types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            check.levels[level] = {"status": "fails", "error": first[:300]}
    ref = outputs.get(LEVELS[0])
    for level, got in outputs.items():
        if ref is None:  # nothing to compare with: the graph as written does not run
            check.levels[level] = {"status": "fails", "error": "ORT_DISABLE_ALL failed"}
            continue
        rel, worst = _compare(ref, got)
        check.levels[level] = {"status": "same" if rel <= check.tolerance else "differs",
                               "rel_l2": rel, "max_abs_rel": worst}
    check.levels = {lv: check.levels[lv] for lv in LEVELS if lv in check.levels}
    return check


def read_metadata(model, where: str | Path) -> dict[str, Any] | None:
    """The :data:`METADATA_KEY` verdict an export wrote, validated: ``model`` is a ModelProto or
    its ``metadata_props`` as a mapping; ``where`` names the graph for messages. None when the
    graph carries no such record. A record export-onnx would not write (not JSON, nested,
    mistyped, levels onnxruntime does not have, a verdict that contradicts itself) raises
    Fp8ExportError: it comes from the file, and verify and inspect act on it."""
    from fp8export.io.guarded import parse_json

    props = model if isinstance(model, dict) else {p.key: p.value for p in model.metadata_props}
    if METADATA_KEY not in props:
        return None
    value = parse_json(str(props[METADATA_KEY]), where, f"metadata {METADATA_KEY!r}")
    problem = _record_problem(value)
    if problem:
        raise Fp8ExportError(f"{where}: metadata {METADATA_KEY!r} is not the record export-onnx "
                             f"writes ({problem}). Re-export the graph with `fp8export "
                             "export-onnx`, or remove that metadata entry.")
    return value


def _record_problem(value: Any) -> str | None:
    """What makes ``value`` differ from :meth:`LevelCheck.metadata_value`'s shape, or None."""
    if not isinstance(value, dict):
        return f"a JSON {type(value).__name__}, not an object"
    if not isinstance(value.get("onnxruntime"), str):
        return "'onnxruntime' is not a version string"
    if "skipped" in value and not isinstance(value["skipped"], str):
        return "'skipped' is not a string"
    levels = value.get("levels")
    if not isinstance(levels, dict) or not all(
            k in LEVELS and v in STATUSES for k, v in levels.items()):
        return (f"'levels' must map {', '.join(LEVELS)} to one of {', '.join(STATUSES)}")
    wrong = value.get("wrong")
    if not isinstance(wrong, list) or wrong != [lv for lv, st in levels.items() if st != "same"]:
        return "'wrong' is not the list of levels whose status is not 'same'"
    use = value.get("use")
    good = [lv for lv in LEVELS if levels.get(lv) == "same"]
    if use != (good[-1] if wrong and good else None):
        return "'use' is not the highest level that computes the graph as written"
    return None
