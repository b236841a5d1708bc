"""``ConvertResult``: what ``convert`` did, for the command's summary and library users."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ConvertResult:
    """What ``convert`` did (JSON-serialisable through :meth:`to_dict`)."""

    output: str
    format: str
    activation_scheme: str  # "static" | "dynamic" | "mixed"
    quantized: int
    excluded: dict[str, str]  # tensor -> reason, every tensor left in source precision
    dynamic_layers: list[str]  # quantized layers without a static input scale
    layers: list[dict[str, Any]]  # per quantized layer: module, shape, scales, SQNR, sources
    notes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # output file names
    bytes_out: int = 0
    loaded_by: list[str] = field(default_factory=list)  # runtimes that read this dialect
    accuracy_budget: dict[str, Any] | None = None  # the fallback search: kept layers, cost
    kv_cache: str | None = None  # the FP8 KV cache the folder declares, in words; None: 16-bit
    # how layers without a static input scale quantize their inputs: tensor, token or group
    dynamic_activations: str | None = None
    scheme: dict[str, Any] | None = None  # --scheme: its name and options (schemes.scheme_entry)
    # Seconds per step: "wall: ..." for the stages, the others summed over worker threads.
    timings: dict[str, float] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def excluded_by_reason(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for reason in self.excluded.values():
            counts[reason] = counts.get(reason, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
