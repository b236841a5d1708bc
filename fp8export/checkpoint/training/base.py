"""Framework-neutral form of FP8 training state, as the history policy consumes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class AmaxHistory:
    """One recorded FP8 slot of one layer.

    ``history`` is float32, **newest first** (readers normalise each framework's order).
    ``stored_scale`` is the scale the framework had stored, already converted to our
    dequantization meaning (amax/448), or None when it stored none.
    """

    module: str  # HF-style linear module name, matching "<module>.weight" in the tensors
    role: str  # "input" | "weight" | "grad_output" | "other"
    history: np.ndarray
    stored_scale: float | None = None
    notes: tuple[str, ...] = ()


@dataclass
class TrainingState:
    """All FP8 training state found in one checkpoint."""

    framework: str  # "transformer-engine", "keras", "torchao"
    version: str | None  # layout/version detected, e.g. "te-2.x-pickle", "keras-3.x"
    histories: list[AmaxHistory] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def for_role(self, role: str) -> dict[str, AmaxHistory]:
        return {h.module: h for h in self.histories if h.role == role}
