"""The library's verbs, one per CLI command (DESIGN.md "Data flow").

Each takes a frozen config and returns a JSON-serialisable result object. Imports are lazy so
``import fp8export.api`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fp8export.config import ConvertConfig


def convert(config: ConvertConfig) -> Any:
    """Checkpoint → FP8 folder. See :func:`fp8export.convert.pipeline.convert`."""
    from fp8export.convert.checks import check_inputs
    from fp8export.convert.source_scan import start_early_scan

    check_inputs(config)  # every path, before the source is read or torch imported
    # Reading the source needs no torch: it starts now and overlaps torch's import.
    early = start_early_scan(config.checkpoint, config.workers)
    try:
        from fp8export.convert.pipeline import convert as _convert
    except BaseException:
        if early is not None:
            early.close()
        raise
    return _convert(config, early=early)


def calibrate(config: Any) -> Any:
    """Sample data → activation ranges. See :func:`fp8export.calibration.api.calibrate`."""
    from fp8export._threads import prepare
    from fp8export.calibration.api import calibrate as _calibrate

    prepare()  # before torch loads: see fp8export/_threads.py
    return _calibrate(config)


def export_onnx(config: Any) -> Any:
    """FP8 folder → ONNX Q/DQ graph. See :func:`fp8export.onnx.export.export_onnx`."""
    from fp8export._threads import prepare

    prepare()
    from fp8export.onnx.export import export_onnx as _export

    return _export(config)


def build_engine(config: Any) -> Any:
    """ONNX → TensorRT engine. See :func:`fp8export.engine.build.build_engine`."""
    from fp8export.engine.build import build_engine as _build

    return _build(config)


def verify(config: Any) -> Any:
    """Reference vs candidate → verification result and report. See :mod:`fp8export.verify`."""
    from fp8export._threads import prepare
    from fp8export.reports.report import verify_and_report

    prepare()
    return verify_and_report(config)


def inspect(path: Any, **options: Any) -> Any:
    """Describe a checkpoint, FP8 folder or ONNX graph. See :mod:`fp8export.inspect`."""
    from fp8export.inspect import inspect as _inspect

    return _inspect(path, **options)
