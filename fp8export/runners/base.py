"""The one runner interface (DESIGN.md "Runners"), after Polygraphy's BaseRunner.

``activate()`` loads what the runner needs, ``infer(feed)`` maps input names to numpy arrays
and returns output names to numpy arrays, ``deactivate()`` frees it. A runner is also a
context manager. Subclasses implement ``_activate`` / ``_infer`` / ``_deactivate``; the public
methods check the lifecycle and the feed.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from fp8export.errors import Fp8ExportError


class TimeLimitExceeded(Fp8ExportError):
    """Inference did not finish before the runner's deadline (the caller names the limit)."""


class Runner(ABC):
    """Base class of every runner (torch reference, torch FP8, onnxruntime, TensorRT)."""

    #: short backend name used in reports ("torch", "torch-fp8", "onnxruntime", "tensorrt")
    backend: str = "base"

    def __init__(self, name: str | None = None):
        self.name = name or self.backend
        self.is_active = False
        self.last_inference_time: float | None = None
        #: ``time.monotonic()`` by which inference must end (None: no limit). Runners that can
        #: stop mid-batch (onnxruntime) do; the others are checked before each batch.
        self.deadline: float | None = None

    # lifecycle -----------------------------------------------------------------------------
    def activate(self) -> Runner:
        if self.is_active:
            raise Fp8ExportError(f"runner {self.name} is already active")
        self._activate()
        self.is_active = True
        return self

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch. ``feed``: e.g. ``{"input_ids": int64 [B,T], "attention_mask": ...}``."""
        if not self.is_active:
            raise Fp8ExportError(f"runner {self.name} must be activated before infer()")
        if not isinstance(feed, dict) or not feed:
            raise Fp8ExportError(f"runner {self.name}: feed must be a non-empty dict of arrays")
        self.check_deadline()
        start = time.perf_counter()
        out = self._infer(feed)
        self.last_inference_time = time.perf_counter() - start
        return out

    def check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise TimeLimitExceeded(f"runner {self.name}: the time limit was reached")

    def deactivate(self) -> None:
        if self.is_active:
            self._deactivate()
            self.is_active = False

    def __enter__(self) -> Runner:
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def describe(self) -> dict[str, Any]:
        """JSON-serialisable facts about the runner for reports."""
        return {"name": self.name, "backend": self.backend}

    # implementation ------------------------------------------------------------------------
    @abstractmethod
    def _activate(self) -> None: ...

    @abstractmethod
    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def _deactivate(self) -> None:  # most runners just drop references
        pass
