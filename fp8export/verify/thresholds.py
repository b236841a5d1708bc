"""Pass/fail thresholds: presets, files, and their evaluation against aggregated metrics.

A thresholds spec maps metric names to a bound. The direction is the metric's own (similarity
metrics have a minimum, error metrics a maximum), so ``{"kl_mean": 0.02}`` means
``kl_mean <= 0.02``; the explicit form ``{"kl_mean": {"max": 0.02}}`` is accepted too. A file
may start from a preset and override some bounds: ``{"preset": "default", "kl_mean": 0.01}``.
Bounds relative to the noise floor (the bf16 reference against fp32) go under ``floor``
(noise_floor.py); they are kept as ``thresholds["floor"]``.
The reasoning behind each preset is in docs/verify.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fp8export.errors import Fp8ExportError, UsageError
from fp8export.io.guarded import THRESHOLDS, parse_json, parse_yaml, read_input

#: metric -> "min" (higher is better: bound is a minimum) or "max" (bound is a maximum)
DIRECTIONS = {
    "cosine_mean": "min", "cosine_min": "min", "cosine_token_min": "min",
    "top1_agreement": "min", "top5_overlap": "min",
    "rel_l2": "max", "max_abs": "max", "prob_max_abs": "max",
    "kl_mean": "max", "kl_p99": "max", "kl_max": "max",
    "ppl_ratio": "max", "accuracy_drop": "max",
    "neighbor_agreement": "min",
    "layer_sqnr_min": "min",  # dB, the worst quantized layer's own error (layer_check.py)
}

PRESETS: dict[str, dict[str, float]] = {
    # Release gate for well-conditioned models: ~20x the healthy sample's KL; catches a weight
    # scale off by 2x in most layers. Reasoning and measurements: docs/verify.md.
    "strict": {"cosine_mean": 0.998, "cosine_min": 0.995, "top1_agreement": 0.97,
               "top5_overlap": 0.93, "kl_mean": 0.002, "kl_p99": 0.02, "ppl_ratio": 1.005,
               "accuracy_drop": 0.005, "neighbor_agreement": 0.9, "layer_sqnr_min": 15.0},
    # The CI gate: a healthy conversion passes even on out-of-domain text (where the sample LM
    # measures KL 8e-3, ~90x its in-domain value), while one layer with a weight scale off by
    # 8x fails it.
    "default": {"cosine_mean": 0.995, "cosine_min": 0.99, "top1_agreement": 0.92,
                "top5_overlap": 0.85, "kl_mean": 0.02, "kl_p99": 0.2, "ppl_ratio": 1.03,
                "accuracy_drop": 0.01, "neighbor_agreement": 0.8, "layer_sqnr_min": 10.0},
    # Small or hard-to-quantize models where drift is accepted; catches gross breakage only.
    "loose": {"cosine_mean": 0.98, "cosine_min": 0.95, "top1_agreement": 0.85,
              "top5_overlap": 0.7, "kl_mean": 0.05, "kl_p99": 0.5, "ppl_ratio": 1.1,
              "accuracy_drop": 0.03, "neighbor_agreement": 0.7, "layer_sqnr_min": 7.0},
}


def _valid_names() -> str:
    return ", ".join(sorted(DIRECTIONS))


def normalize(spec: dict[str, Any], source: str) -> dict[str, dict[str, float]]:
    """``{metric: {"op": "min"|"max", "value": float}}`` from a spec; raises on unknown names.

    Relative bounds (``floor``) are kept as ``{"floor": {metric: FloorBound.to_dict()}}``.
    """
    from fp8export.verify.noise_floor import FLOOR_KEY, parse_floor

    out: dict[str, dict[str, float]] = {}
    spec = dict(spec)
    base = spec.pop("preset", None)
    relative = spec.pop(FLOOR_KEY, None)
    if base is not None:
        out.update(normalize(preset(str(base)), f"preset {base}"))
    if relative is not None:
        out[FLOOR_KEY] = parse_floor(relative, DIRECTIONS, source)
    for name, bound in spec.items():
        if name not in DIRECTIONS:
            raise Fp8ExportError(f"{source}: unknown metric {name!r} in thresholds; valid "
                                 f"metrics are: {_valid_names()} (and 'preset').")
        op = DIRECTIONS[name]
        if isinstance(bound, dict):
            if set(bound) - {"min", "max"} or len(bound) != 1:
                raise Fp8ExportError(f"{source}: threshold for {name} must be a number or "
                                     f"{{'{op}': number}}, got {bound!r}.")
            given_op, bound = next(iter(bound.items()))
            if given_op != op:
                raise Fp8ExportError(f"{source}: {name} takes a '{op}' bound (its direction), "
                                     f"not '{given_op}'.")
        if bound is None:
            out.pop(name, None)  # `kl_p99: null` drops a preset's bound
            continue
        try:
            value = float(bound)
        except (TypeError, ValueError):
            raise Fp8ExportError(f"{source}: threshold for {name} must be a number, got "
                                 f"{bound!r}.") from None
        if math.isnan(value):
            raise Fp8ExportError(f"{source}: threshold for {name} is NaN.")
        out[name] = {"op": op, "value": value}
    return out


def preset(name: str) -> dict[str, float]:
    if name not in PRESETS:
        raise Fp8ExportError(f"unknown thresholds preset {name!r}; use one of "
                             f"{', '.join(PRESETS)} or a .yaml/.json file.")
    return dict(PRESETS[name])


def check_spec(text: str) -> str:
    """``text`` if it names a preset or a threshold file by its suffix, else UsageError."""
    if text not in PRESETS and Path(text).suffix.lower() not in (".yaml", ".yml", ".json"):
        raise UsageError(f"--thresholds {text!r} is neither a preset ({', '.join(PRESETS)}) "
                         "nor a .yaml/.yml/.json file.")
    return text


def load_thresholds(spec: str | Path | dict) -> tuple[str, dict[str, dict[str, float]]]:
    """Resolve ``--thresholds``: a preset name, a ``.yaml``/``.yml``/``.json`` file, or a dict.

    Returns ``(label, thresholds)`` with ``thresholds`` normalized (see :func:`normalize`).
    """
    if isinstance(spec, dict):
        return "custom", normalize(spec, "thresholds")
    text = check_spec(str(spec))
    if text in PRESETS:
        return text, normalize(PRESETS[text], f"preset {text}")
    p = Path(text)
    if not p.exists() and not p.is_symlink():
        raise Fp8ExportError(f"{p}: no such thresholds file.")
    raw = read_input(p, THRESHOLDS)  # a regular file of at most 1 MiB
    if p.suffix.lower() == ".json":
        data = parse_json(raw, p, "thresholds file")
    else:
        data = parse_yaml(raw, p, "thresholds file")
    if not isinstance(data, dict) or not data:
        raise Fp8ExportError(f"{p}: thresholds file must be a mapping of metric: bound, e.g. "
                             "{kl_mean: 0.02, top1_agreement: 0.9}.")
    thresholds = normalize(data, str(p))
    if not thresholds:
        raise Fp8ExportError(f"{p}: the thresholds file sets no bound (every metric in it is "
                             "null), so verify would check nothing. Give at least one bound, "
                             "e.g. {kl_mean: 0.02}, or use a preset (--thresholds default).")
    return str(p), thresholds


def evaluate(metrics: dict[str, Any], thresholds: dict[str, dict[str, float]],
             floor: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One check per threshold: ``{metric, op, threshold, value, status, message}``.

    ``status`` is "passed", "failed", or "skipped" (the metric does not apply here, e.g.
    perplexity of a classifier). A NaN or missing-but-applicable value fails. Relative bounds
    are checked against ``floor`` (the noise floor's metrics) after the absolute ones.

    A verification that checks nothing cannot pass: when no threshold applies (a file holding
    only ``kl_mean: null``, or only ``accuracy_drop`` for a causal LM) one failed check says so.
    Any metric that came out NaN fails too, thresholded or not: NaN compares false against
    every bound, so it would otherwise pass as "not applicable" or hide broken outputs.
    """
    from fp8export.verify.noise_floor import FLOOR_KEY, evaluate_floor

    checks = []
    for name, t in thresholds.items():
        if name == FLOOR_KEY:
            continue
        op, bound = t["op"], t["value"]
        value = metrics.get(name)
        sym = ">=" if op == "min" else "<="
        check = {"metric": name, "op": op, "threshold": bound, "value": value,
                 "name": f"{name} {sym} {bound:g}"}
        if value is None:
            check.update(status="skipped", message=f"{name} does not apply to this model/data")
        else:
            v = float(value)
            ok = (v >= bound) if op == "min" else (v <= bound)
            ok = ok and not math.isnan(v)
            check.update(status="passed" if ok else "failed",
                         message=f"{name} = {v:.6g} (needs {sym} {bound:g})")
        checks.append(check)
    checks += evaluate_floor(metrics, floor, thresholds.get(FLOOR_KEY) or {})
    for name, value in sorted(metrics.items()):
        if isinstance(value, float) and math.isnan(value) and \
                not any(c["metric"] == name and c["status"] == "failed" for c in checks):
            checks.append({"metric": name, "op": None, "threshold": None, "value": value,
                           "name": f"{name} is a number", "status": "failed",
                           "message": f"{name} = nan: the outputs hold NaN/Inf or the metric "
                                      "could not be computed"})
    if not any(c["status"] != "skipped" for c in checks):
        given = ", ".join(sorted(k for k in thresholds if k != FLOOR_KEY)) or "none"
        checks.append({"metric": "thresholds", "op": None, "threshold": None, "value": None,
                       "name": "at least one threshold applies", "status": "failed",
                       "message": f"no threshold applies to this model and data (given: "
                                  f"{given}), so nothing was checked; give bounds for metrics it "
                                  "has (e.g. kl_mean, top1_agreement, cosine_min)"})
    return checks
