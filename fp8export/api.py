"""The library's verbs, one per CLI command (DESIGN.md "Data flow").

Each takes a frozen config and returns a JSON-serialisable result object. The configs live with
their stage: ``fp8export.convert.config.ConvertConfig``, ``fp8export.calibration.config.
CalibrateConfig``, ``fp8export.onnx.export.ExportOnnxConfig``, ``fp8export.engine.build.
BuildEngineConfig``, ``fp8export.verify.config.VerifyConfig``. Imports are lazy so
``import fp8export.api`` stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the verbs' own modules load only when a verb runs
    from fp8export.calibration.api import CalibrationResult
    from fp8export.calibration.config import CalibrateConfig
    from fp8export.convert.config import ConvertConfig
    from fp8export.convert.result import ConvertResult
    from fp8export.engine.build import BuildEngineConfig, BuildEngineResult
    from fp8export.inspect.result import InspectResult
    from fp8export.onnx.export import ExportOnnxConfig, ExportResult
    from fp8export.verify.config import VerifyConfig
    from fp8export.verify.result import VerifyResult


def convert(config: ConvertConfig) -> ConvertResult:
    """Checkpoint → FP8 folder. See :func:`fp8export.convert.pipeline.convert`."""
    from fp8export._threads import prepare
    from fp8export.convert.checks import check_inputs
    from fp8export.convert.source_scan import start_early_scan

    # Before torch loads (fp8export/_threads.py): convert alternates single-threaded
    # elementwise work with multi-threaded dot products while other threads hash and write,
    # and libgomp's spinning workers took the core those threads need (measured: 2-thread
    # torch.dot on 16 MiB, 8x slower and 3 s of extra CPU per GiB converted).
    prepare()
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


def plan_convert(config: ConvertConfig) -> list[str]:
    """``convert --plan``: the plan's lines (``fp8export.convert.plan``)."""
    from fp8export._threads import prepare
    from fp8export.convert.checks import check_inputs

    check_inputs(config)
    prepare()
    from fp8export.convert.plan import plan_convert as _plan

    return _plan(config)


def calibrate(config: CalibrateConfig) -> CalibrationResult:
    """Sample data → activation ranges. See :func:`fp8export.calibration.api.calibrate`."""
    from fp8export._threads import prepare
    from fp8export.calibration.api import calibrate as _calibrate

    prepare()  # before torch loads: see fp8export/_threads.py
    return _calibrate(config)


def export_onnx(config: ExportOnnxConfig) -> ExportResult:
    """FP8 folder → ONNX Q/DQ graph. See :func:`fp8export.onnx.export.export_onnx`."""
    from fp8export._threads import prepare

    prepare()
    from fp8export.onnx.export import export_onnx as _export

    return _export(config)


def build_engine(config: BuildEngineConfig) -> BuildEngineResult:
    """ONNX → TensorRT engine. See :func:`fp8export.engine.build.build_engine`."""
    from fp8export.engine.build import build_engine as _build

    return _build(config)


def verify(config: VerifyConfig) -> VerifyResult:
    """Reference vs candidate → verification result and its reports. See :mod:`fp8export.verify`
    and :func:`fp8export.reports.report.verify_and_report`."""
    from fp8export._threads import prepare
    from fp8export.reports.report import verify_and_report

    prepare()
    return verify_and_report(config)


def plan_verify(config: VerifyConfig) -> list[str]:
    """``verify --plan``: the lines of the plan (``fp8export.verify.run.plan_verify``)."""
    from fp8export._threads import prepare
    from fp8export.verify.run import plan_verify as _plan

    prepare()
    return _plan(config)


def inspect(path: str | Path, *, plot: str | Path | None = None, as_json: bool = False,
            force: bool = False) -> InspectResult:
    """Describe a checkpoint, FP8 folder or ONNX graph. See :mod:`fp8export.inspect`."""
    from fp8export.inspect import inspect as _inspect

    return _inspect(path, plot=plot, as_json=as_json, force=force)
