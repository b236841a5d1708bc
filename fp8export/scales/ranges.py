"""Static activation ranges: the hand-off between scale providers and ``convert``.

Providers (training-state readers, calibration, ``--calib-amax`` files) each return a
``dict[module_name, ActivationRange]``; ``convert`` turns them into ``<m>.input_scale``.
``module`` is the name of the linear module as it appears in the checkpoint's tensor names
(``<module>.weight``), e.g. ``model.layers.0.self_attn.q_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fp8export.config import ScaleSource


@dataclass(frozen=True)
class ActivationRange:
    """The amax of one linear layer's input, where it came from, and how it was obtained."""

    module: str
    amax: float
    source: ScaleSource
    # JSON-serialisable facts for the manifest
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "amax": self.amax, "source": str(self.source),
                **({"details": self.details} if self.details else {})}
