"""The noise floor: how far the reference itself is from an fp32 run of the same reference.

verify runs the reference in bf16 (or the dtype asked for); rounding to bf16 already moves its
outputs. Running the same checkpoint in fp32 on the same inputs and comparing the two gives the
loss that needs no FP8 at all, so a report can put FP8's loss next to it. Bounds relative to
that floor are stated in a thresholds file under ``floor``::

    preset: default
    floor:
      kl_mean: {factor: 10}         # kl_mean <= 10 x the floor's kl_mean
      top1_agreement: {delta: 0.05} # top1_agreement >= the floor's top1_agreement - 0.05

``factor`` applies to error metrics (a maximum): ``value <= factor * floor``. ``delta`` applies
to any metric: at most ``delta`` worse than the floor (``>= floor - delta`` for similarities,
``<= floor + delta`` for errors).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from fp8export.config import StrEnum
from fp8export.errors import Fp8ExportError

FLOOR_KEY = "floor"  # the thresholds-file key of the relative bounds
FLOOR_DTYPE = "fp32"
# What the report sets side by side (those present for the model's metric family).
COMPARED = ("cosine_mean", "cosine_min", "rel_l2", "top1_agreement", "top5_overlap", "kl_mean",
            "kl_p99", "ppl_ratio", "neighbor_agreement", "accuracy_drop")


class Relation(StrEnum):
    """How a relative bound is derived from the floor's value of the same metric."""

    FACTOR = "factor"  # value <= factor * floor (error metrics only)
    DELTA = "delta"  # at most delta worse than the floor, in the metric's direction


@dataclass(frozen=True)
class FloorBound:
    """One bound relative to the noise floor: ``metric`` compared with ``relation``/``amount``.

    ``op`` is the metric's direction ("min": higher is better, "max": lower is better).
    """

    metric: str
    op: str
    relation: Relation
    amount: float

    def bound(self, floor: float) -> float:
        if self.relation is Relation.FACTOR:
            return self.amount * floor
        return floor - self.amount if self.op == "min" else floor + self.amount

    def describe(self) -> str:
        if self.relation is Relation.FACTOR:
            return f"{self.amount:g}x floor"
        sign = "-" if self.op == "min" else "+"
        return f"floor {sign} {self.amount:g}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "relation": str(self.relation)}


def parse_floor(spec: Any, directions: dict[str, str], source: str) -> dict[str, dict[str, Any]]:
    """``{metric: FloorBound.to_dict()}`` from the ``floor`` mapping of a thresholds spec."""
    if not isinstance(spec, dict):
        raise Fp8ExportError(f"{source}: '{FLOOR_KEY}' must map metric names to "
                             "{factor: k} or {delta: d}, e.g. {kl_mean: {factor: 10}}.")
    out: dict[str, dict[str, Any]] = {}
    for name, rel in spec.items():
        if name not in directions:
            raise Fp8ExportError(f"{source}: unknown metric {name!r} under '{FLOOR_KEY}'; valid "
                                 f"metrics are: {', '.join(sorted(directions))}.")
        if rel is None:
            continue
        if not isinstance(rel, dict) or len(rel) != 1:
            raise Fp8ExportError(f"{source}: {FLOOR_KEY}.{name} must be {{factor: k}} or "
                                 f"{{delta: d}}, got {rel!r}.")
        key, amount = next(iter(rel.items()))
        relation = Relation.parse(key, f"{FLOOR_KEY}.{name}")
        op = directions[name]
        if relation is Relation.FACTOR and op != "max":
            raise Fp8ExportError(f"{source}: {FLOOR_KEY}.{name}: a factor applies to error "
                                 f"metrics (lower is better); {name} is a similarity, give "
                                 "{delta: d} (at most d below the floor).")
        try:
            value = float(amount)
        except (TypeError, ValueError):
            raise Fp8ExportError(f"{source}: {FLOOR_KEY}.{name}.{key} must be a number, got "
                                 f"{amount!r}.") from None
        if not math.isfinite(value) or value < 0:
            raise Fp8ExportError(f"{source}: {FLOOR_KEY}.{name}.{key} must be a finite number "
                                 f">= 0, got {amount!r}.")
        out[name] = FloorBound(name, op, relation, value).to_dict()
    return out


def bounds_of(entries: dict[str, dict[str, Any]]) -> list[FloorBound]:
    return [FloorBound(e["metric"], e["op"], Relation(e["relation"]), float(e["amount"]))
            for e in entries.values()]


def evaluate_floor(metrics: dict[str, Any], floor: dict[str, Any] | None,
                   entries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One check per relative bound, in the shape of ``thresholds.evaluate``'s checks."""
    checks = []
    for b in bounds_of(entries):
        sym = ">=" if b.op == "min" else "<="
        value = metrics.get(b.metric)
        base = None if floor is None else floor.get(b.metric)
        check = {"metric": b.metric, "op": b.op, "value": value, "relative": b.to_dict(),
                 "floor": base, "rule": b.describe()}
        if value is None or base is None:
            why = "the noise floor was not measured" if floor is None else \
                f"{b.metric} does not apply to this model/data"
            check.update(threshold=None, status="skipped", name=f"{b.metric} {sym} "
                         f"{b.describe()}", message=f"{b.metric}: {why}")
        else:
            bound = b.bound(float(base))
            v = float(value)
            ok = ((v >= bound) if b.op == "min" else (v <= bound)) and not math.isnan(v)
            check.update(threshold=bound, status="passed" if ok else "failed",
                         name=f"{b.metric} {sym} {b.describe()}",
                         message=f"{b.metric} = {v:.6g} (needs {sym} {b.describe()} = "
                                 f"{bound:.6g}; floor {float(base):.6g})")
        checks.append(check)
    return checks


def side_by_side(metrics: dict[str, Any], floor: dict[str, Any],
                 vs_fp32: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Rows ``{metric, candidate, floor, candidate_vs_fp32, ratio}`` for the report; ``ratio``
    is the candidate's loss over the floor's (KL, rel_l2: the values; similarities: 1 - value;
    ppl_ratio: value - 1)."""
    rows = []
    for k in COMPARED:
        if k not in metrics or k not in floor:
            continue
        c, f = metrics[k], floor[k]
        rows.append({"metric": k, "candidate": c, "floor": f,
                     "candidate_vs_fp32": (vs_fp32 or {}).get(k), "ratio": _loss_ratio(k, c, f)})
    return rows


def _loss_ratio(metric: str, cand: float, floor: float) -> float | None:
    if metric == "accuracy_drop":
        return None  # a difference of counts; its ratio means little
    if metric == "ppl_ratio":
        lc, lf = abs(cand - 1.0), abs(floor - 1.0)
    elif metric.startswith(("cosine", "top", "neighbor")):
        lc, lf = 1.0 - cand, 1.0 - floor
    else:
        lc, lf = cand, floor
    if not (math.isfinite(lc) and math.isfinite(lf)) or lf <= 0:
        return None
    return lc / lf
