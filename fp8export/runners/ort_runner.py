"""onnxruntime runner.

The session is created as a user creates it, ``InferenceSession(path)``: at onnxruntime's
default graph optimization level (``ORT_ENABLE_ALL``), so that verify checks what users run.
``graph_optimization_level`` (a ``GraphOptimizationLevel`` member name; ``verify
--ort-opt-level``) picks another. export-onnx emits graphs that every level computes alike and
records in the model's metadata any level that does not (:mod:`fp8export.onnx.levels`); running
at such a level adds a warning to ``describe()``.

onnxruntime runs FP8 Q/DQ only in float/float16: the CPU and CUDA providers have no bf16
QuantizeLinear/DequantizeLinear kernels (reference §5.1), so a bf16 graph is refused up front
with a message naming ``--dtype`` rather than failing inside session creation. The CUDA
provider is used when onnxruntime-gpu is installed and a GPU is visible; pass
``providers=["CPUExecutionProvider"]`` to force the CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fp8export.errors import Fp8ExportError
from fp8export.runners.base import Runner, TimeLimitExceeded

_BF16 = 16


def graph_uses_bf16(model) -> bool:
    """True when the graph computes in bfloat16 (inputs/outputs, initializers, casts, Q/DQ)."""
    g = model.graph
    for v in (*g.input, *g.output):
        if v.type.tensor_type.elem_type == _BF16:
            return True
    if any(t.data_type == _BF16 for t in g.initializer):
        return True
    for n in g.node:
        for a in n.attribute:
            if a.name in ("to", "output_dtype") and a.i == _BF16:
                return True
    return False


def _load_header(path: Path):
    from fp8export.onnx.load import load_onnx

    return load_onnx(path)


def _prepare_feed(feed: dict[str, np.ndarray], inputs: dict[str, str], name: str):
    missing = [k for k in inputs if k not in feed]
    if missing:
        raise Fp8ExportError(f"runner {name}: the graph needs inputs {missing}; the feed has "
                             f"{sorted(feed)}.")
    out = {}
    for k, typ in inputs.items():
        arr = np.asarray(feed[k])
        if typ == "tensor(int64)" and arr.dtype != np.int64:
            arr = arr.astype(np.int64)
        out[k] = arr
    return out


class OrtRunner(Runner):
    """Run an ONNX graph with onnxruntime. ``providers``: default CUDA if available, else CPU."""

    backend = "onnxruntime"

    def __init__(self, path: str | Path, providers: list[str] | None = None,
                 name: str | None = None, graph_optimization_level: str | None = None):
        from fp8export.onnx.levels import level_name

        super().__init__(name)
        self.path = Path(path)
        self.requested = list(providers) if providers else None
        self.requested_level = level_name(graph_optimization_level)  # None: onnxruntime's
        self.level: str | None = None  # the level the session runs at (after activate)
        self.level_warning: str | None = None
        self.session = None
        self.providers: list[str] = []

    def _choose_providers(self) -> list[str]:
        import onnxruntime as ort

        available = ort.get_available_providers()
        if self.requested:
            bad = [p for p in self.requested if p not in available]
            if bad:
                raise Fp8ExportError(
                    f"{self.path}: onnxruntime providers {bad} are not available here (have "
                    f"{available}). Install onnxruntime-gpu for CUDA, or use the CPU provider.")
            return self.requested
        if "CUDAExecutionProvider" in available:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]

    def _activate(self) -> None:
        import onnxruntime as ort

        from fp8export.onnx.check import check_ops

        header = _load_header(self.path)
        refused = check_ops(header)
        if refused:
            shown = "; ".join(f"{i.where}: {i.message}" for i in refused[:3])
            raise Fp8ExportError(f"{self.path}: refused before running it: {shown}"
                                 + (f" (and {len(refused) - 3} more)" if len(refused) > 3 else ""))
        providers = self._choose_providers()
        if graph_uses_bf16(header):
            raise Fp8ExportError(
                f"{self.path}: a bf16 graph; onnxruntime's {providers[0]} has no bf16 "
                "QuantizeLinear/DequantizeLinear kernels. Re-export with `export-onnx --dtype "
                "fp16` (or fp32) to run it in onnxruntime, or build a TensorRT engine from the "
                "bf16 graph (`fp8export build-engine`).")
        from fp8export.onnx.levels import choice_of, read_metadata, session_options

        opts = session_options(self.requested_level)  # None: as InferenceSession(path) does
        self.level = opts.graph_optimization_level.name
        recorded = read_metadata(header, self.path) or {}
        if self.level in (recorded.get("wrong") or []):
            use = recorded.get("use")
            self.level_warning = (
                f"export-onnx found that onnxruntime {recorded.get('onnxruntime')} computes "
                f"this graph differently at {self.level} than as written"
                + (f"; it runs correctly at {use} (verify --ort-opt-level "
                   f"{choice_of(use)})" if use else ""))
        opts.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(self.path), sess_options=opts,
                                                providers=providers)
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            raise Fp8ExportError(
                f"{self.path}: onnxruntime ({', '.join(providers)}) cannot load the graph: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}. Check it "
                "with `fp8export inspect`, or re-export with --dtype fp16 --opset 21.") from exc
        self.providers = list(self.session.get_providers())
        self._inputs = {i.name: i.type for i in self.session.get_inputs()}
        self._outputs = [o.name for o in self.session.get_outputs()]

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import threading
        import time

        import onnxruntime as ort

        run_feed = _prepare_feed(feed, self._inputs, self.name)
        options = ort.RunOptions()
        options.log_severity_level = 4  # the time-limit stop is reported by us, not logged
        timer = None
        if self.deadline is not None:
            # onnxruntime checks the flag between kernels (inside Loop bodies too): a graph
            # that would run for ever stops at the deadline.
            timer = threading.Timer(max(self.deadline - time.monotonic(), 0.0),
                                    lambda: setattr(options, "terminate", True))
            timer.daemon = True
            timer.start()
        try:
            values = self.session.run(self._outputs, run_feed, options)
        except Exception as exc:  # onnxruntime's Fail/RuntimeException types
            if options.terminate:
                raise TimeLimitExceeded(f"runner {self.name}: stopped at the time limit") from exc
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise Fp8ExportError(f"{self.path}: onnxruntime failed while running the graph: "
                                 f"{first[:300]}") from exc
        finally:
            if timer is not None:
                timer.cancel()
        return dict(zip(self._outputs, values))

    def _deactivate(self) -> None:
        self.session = None

    def describe(self) -> dict[str, Any]:
        from fp8export.onnx.levels import default_level

        out = {**super().describe(), "path": str(self.path), "providers": self.providers,
               "graph_optimization_level": self.level,
               "level_source": "requested" if self.requested_level else "onnxruntime default"}
        if self.level is None:  # not activated yet: what it will run at
            out["graph_optimization_level"] = self.requested_level or default_level()
        if self.level_warning:
            out["level_warning"] = self.level_warning
        return out

