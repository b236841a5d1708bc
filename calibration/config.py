"""``CalibrateConfig``: the options of ``fp8export calibrate`` (light: no torch import).

Kept here (not in ``fp8export/config.py``) so calibration owns its options; it follows the
same rules as the shared configs: frozen, validated in ``__post_init__``, Fp8ExportError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol, runtime_checkable

from fp8export.config import CalibMethod, Device, Offload, sibling_output
from fp8export.errors import UsageError
from fp8export.placement import parse_max_memory

DEFAULT_CALIB_SAMPLES = 512  # TensorRT / ModelOpt examples calibrate on a few hundred samples
DEFAULT_BATCH_SIZE = 8


@dataclass(frozen=True)
class CalibrateConfig:
    """Options of ``fp8export calibrate`` (and of calibration inside ``convert``).

    ``output``: where :func:`fp8export.calibration.api.calibrate` writes ``amax.json``; None
    means "do not write" for library callers (the CLI always sets it, default
    :attr:`resolved_output`). ``modules``: linears to observe; empty = what ``convert`` would
    quantize (its selection, with ``include`` / ``exclude``).
    """

    checkpoint: Path
    calib_data: Path
    output: Path | None = None
    calib_method: CalibMethod = CalibMethod.MAX
    percentile: float | None = None
    calib_samples: int | None = DEFAULT_CALIB_SAMPLES
    batch_size: int | None = DEFAULT_BATCH_SIZE
    seq_len: int | None = None  # default: the model's maximum positions
    device: Device = Device.AUTO
    max_memory: str | None = None  # "0=70GiB,1=70GiB,cpu=100GiB": spread (fp8export.placement)
    offload: Offload = Offload.AUTO  # layer streaming (fp8export.streaming.plan)
    plan: bool = False  # print the plan and stop
    spill_dir: Path | None = None  # a spill file's parent when there is no output (convert's)
    modules: tuple[str, ...] = ()
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    fuse_scales: bool = True
    force: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "checkpoint", Path(self.checkpoint))
        object.__setattr__(self, "calib_data", Path(self.calib_data))
        if self.output is not None:
            object.__setattr__(self, "output", Path(self.output))
        object.__setattr__(self, "calib_method",
                           CalibMethod.parse(self.calib_method, "--calib-method"))
        object.__setattr__(self, "device", Device.parse(self.device, "--device"))
        object.__setattr__(self, "offload", Offload.parse(self.offload, "--offload"))
        parse_max_memory(self.max_memory)  # a usage error before any work
        for name in ("modules", "include", "exclude"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name, flag in (("calib_samples", "--calib-samples"), ("batch_size", "--batch-size"),
                           ("seq_len", "--seq-len")):
            v = getattr(self, name)
            if v is not None and (int(v) != v or v < 1):
                raise UsageError(f"{flag} must be a positive integer, got {v}.")
        if self.percentile is not None:
            p = float(self.percentile)
            if not math.isfinite(p) or not 0.0 < p <= 100.0:
                raise UsageError(f"--percentile must be in (0, 100], got {self.percentile}.")
            if self.calib_method is not CalibMethod.PERCENTILE:
                raise UsageError(
                    f"--percentile applies to --calib-method percentile, not "
                    f"{self.calib_method}. Drop --percentile or choose percentile.")

    @property
    def resolved_output(self) -> Path:
        """``-o`` or the sibling ``<checkpoint>-amax.json``."""
        if self.output is not None:
            return self.output
        return sibling_output(self.checkpoint, "-amax.json")

    def method_options(self) -> dict:
        if self.calib_method is CalibMethod.PERCENTILE and self.percentile is not None:
            return {"percentile": float(self.percentile)}
        return {}

    def to_dict(self) -> dict:
        out = {}
        for k in ("checkpoint", "calib_data", "output", "calib_method", "percentile",
                  "calib_samples", "batch_size", "seq_len", "device", "max_memory", "offload",
                  "modules", "include", "exclude", "fuse_scales", "force"):
            v = getattr(self, k)
            out[k] = str(v) if isinstance(v, (Path, Enum)) else (list(v) if isinstance(v, tuple)
                                                                 else v)
        return out


@runtime_checkable
class ConvertCalibration(Protocol):
    """What calibration reads of the options of the ``convert`` it serves (``--scales
    calibrate``, ``--calib-amax``, ``--kv-cache fp8``). ``fp8export.convert.config.
    ConvertConfig`` has these fields; calibration sits below convert and does not import it.
    ``calib_samples`` / ``batch_size`` None: this module's defaults."""

    @property
    def checkpoint(self) -> Path: ...
    @property
    def calib_data(self) -> Path | None: ...
    @property
    def calib_amax(self) -> Path | None: ...
    @property
    def calib_method(self) -> CalibMethod: ...
    @property
    def percentile(self) -> float | None: ...
    @property
    def calib_samples(self) -> int | None: ...
    @property
    def batch_size(self) -> int | None: ...
    @property
    def seq_len(self) -> int | None: ...
    @property
    def device(self) -> Device: ...
    @property
    def fuse_scales(self) -> bool: ...
    @property
    def max_memory(self) -> str | None: ...
    @property
    def offload(self) -> Offload: ...
    @property
    def resolved_output(self) -> Path: ...
