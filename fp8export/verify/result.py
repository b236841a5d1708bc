"""What verify found (``VerifyResult``): plain data the reports are made of."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class VerifyResult:
    """Everything verify found; ``to_dict()`` is JSON-serialisable (report.json is its subset)."""

    passed: bool
    backend: str
    samples: int
    metrics: dict[str, Any]
    thresholds: dict[str, dict[str, float]]
    failures: list[dict[str, Any]]
    checks: list[dict[str, Any]]
    per_layer: list[dict[str, Any]] | None
    thresholds_source: str
    reference: dict[str, Any]
    candidate: dict[str, Any]
    data: dict[str, Any]
    task: str
    notes: list[str] = field(default_factory=list)
    per_sample: list[dict[str, Any]] = field(default_factory=list)
    distributions: dict[str, list[float]] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)
    reports: dict[str, str] = field(default_factory=dict)
    header: dict[str, Any] = field(default_factory=dict)  # what was judged (provenance.py)
    worst_samples: list[dict[str, Any]] = field(default_factory=list)  # with their text
    family: str = "logits"  # which metrics judged the model (family.py)
    noise_floor: dict[str, Any] | None = None  # the reference against fp32 (noise_floor.py)
    confidence: dict[str, Any] | None = None  # bootstrap intervals of the checks (confidence.py)
    layer_check: dict[str, Any] | None = None  # each quantized layer's own SQNR (layer_check.py)
    # --kv-cache / --attention fp8: each configuration's metrics, FP8-linears-only first
    attention_cost: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
