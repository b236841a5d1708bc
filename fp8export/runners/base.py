"""The one runner interface (DESIGN.md "Runners"), after Polygraphy's BaseRunner.

``activate()`` loads what the runner needs, ``infer(feed)`` maps input names to numpy arrays
and returns output names to numpy arrays, ``deactivate()`` frees it. A runner is also a
context manager. Subclasses implement ``_activate`` / ``_infer`` / ``_deactivate``; the public
methods check the lifecycle and the feed.

The optional capabilities verify uses (the model's config, placement over devices, the head's
activation, the FP8 path, the torch module and manifest for per-layer attribution) are declared
here with neutral defaults; an adapter that has one overrides it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from fp8export.errors import Fp8ExportError


class TimeLimitExceeded(Fp8ExportError):
    """Inference did not finish before the runner's deadline (the caller names the limit);
    ``where``: how far the run had got (``_progress.where()``)."""

    def __init__(self, message: str):
        from fp8export._progress import where

        super().__init__(message)
        self.where = where()


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
        #: the model's config.json once active ({}: the runner has none, e.g. a bare graph)
        self.config: dict[str, Any] = {}
        #: per-device memory budgets (``fp8export.placement``) a runner that can spread a
        #: model over devices is given; None: it runs on one device
        self.max_memory: dict[int | str, int] | None = None
        #: the ``Placement`` of a model spread over several devices once active; None: one device
        self.placement = None
        #: the model's torch module once active (None: the runner runs something else)
        self.model = None
        #: convert's manifest of the FP8 folder the runner runs ({}: not an FP8 folder)
        self.manifest: dict[str, Any] = {}
        #: the model's parts, one decoder layer at a time (a streamed runner, runners/streamed.py);
        #: None: the model runs whole
        self.parts = None
        #: what follows the last layer: "linear" (logits) or "sigmoid"/"softmax" (a Keras head
        #: that outputs probabilities, which the comparison turns back into logits)
        self.output_activation = "linear"

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

    def data_config(self) -> dict[str, Any]:
        """What the data reader needs to fit samples to the model (``vocab_size``,
        ``max_position_embeddings``): the model's config unless the runner knows better."""
        return self.config

    def fp8_path(self) -> str | None:
        """One line: which FP8 GEMM path runs (None: the runner does not run FP8 weights)."""
        return None

    # what the FP8 KV cache and FP8 attention cost (verify --kv-cache / --attention fp8) -----
    def attention_variants(self) -> list[tuple[str, str]]:
        """``(label, mode)`` of the cheaper configurations verify measures beside the judged
        one (empty: nothing to compare; the runner has no FP8 KV cache or attention)."""
        return []

    def judged_variant(self) -> str:
        """Label of the configuration the verdict judges, in the cost table."""
        return "judged"

    def attention_setup(self) -> dict[str, Any]:
        """What the judged configuration runs (``kv_cache``, ``attention``), for the report."""
        return {}

    def set_attention(self, mode: str) -> None:
        """Run the next batches in ``mode``: one of :meth:`attention_variants`' modes, or
        "judged" (back to the configuration the verdict judges)."""
        if mode != "judged":
            raise Fp8ExportError(f"runner {self.name} has no attention mode {mode!r}")

    # implementation ------------------------------------------------------------------------
    @abstractmethod
    def _activate(self) -> None: ...

    @abstractmethod
    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def _deactivate(self) -> None:  # most runners just drop references
        pass
