"""From recorded amax histories to static scales: the history policy (--amax-algo, --margin).

Histories arrive newest first (each reader normalises its framework's order). Zeros are
unfilled slots or steps where a layer did not run; non-finite entries are overflowed steps
that every framework skips when it updates its scale. Both are ignored:

* ``max`` (default) — the largest finite, non-zero entry of the window. It matches TE's
  default ``max`` algorithm, ModelOpt's max calibration and Flax's inference behaviour, and it
  removes the one-step lag of the stored Keras/Flax scale (reference §5).
* ``most-recent`` — the newest finite, non-zero entry.
* ``stored`` — the scale the framework stored (``amax = scale · 448``), where it stored an
  updated one: what its own FP8 inference computes with (Keras's and Flax's lag the history
  by one step; TE's includes its margin). Layers without one fall back to ``max``.
* ``margin`` — headroom: ``amax · 2**margin``.

When a history holds no usable entry but the framework stored an updated scale (TE with
``amax_history_len=1``, Megatron's default, keeps an all-zero history after every update), that
scale is the information: ``amax = stored_scale · 448`` (it already includes the training
margin). A scale still at its initial value is not information (readers give ``None``).

A history of the wrong shape or dtype, one with negative entries, or one whose only non-zero
entries are NaN/Inf is corrupt: Fp8ExportError naming the layer. Layers without any usable
information are left out of the result and named in the notes, so convert can fall back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from fp8export.checkpoint.training.base import AmaxHistory, TrainingState
from fp8export.config import AmaxAlgo, ScaleSource
from fp8export.errors import Fp8ExportError, UsageError
from fp8export.numerics.fp8 import E4M3_MAX, amax_to_scale, check_amax
from fp8export.scales.ranges import ActivationRange

_SHOWN = 8  # module names listed in one note before "and N more"


def _values(h: AmaxHistory, layer: str) -> np.ndarray:
    hist = h.history
    if not isinstance(hist, np.ndarray) or hist.ndim != 1 or hist.dtype.kind != "f":
        shape = getattr(hist, "shape", None)
        dtype = getattr(hist, "dtype", type(hist).__name__)
        raise Fp8ExportError(
            f"{layer}: {h.role} amax history has shape {shape} and dtype {dtype}; expected a 1-D "
            "float array (one amax per step). The FP8 training state is corrupt; convert with "
            "--scales calibrate or --scales weights instead.")
    values = hist.astype(np.float64)
    finite = np.isfinite(values)
    if np.any(values[finite] < 0):
        raise Fp8ExportError(
            f"{layer}: {h.role} amax history holds negative values (min {values[finite].min()}); "
            "an amax is an absolute maximum. The FP8 training state is corrupt; convert with "
            "--scales calibrate or --scales weights instead.")
    nonzero = values != 0
    if np.any(nonzero) and not np.any(finite & nonzero):
        raise Fp8ExportError(
            f"{layer}: {h.role} amax history holds only NaN/Inf besides zeros "
            f"({int(np.sum(~finite))} non-finite entries): training overflowed in this layer. "
            "Exclude it with --exclude, or convert with --scales calibrate.")
    return values


def amax_from_history(h: AmaxHistory, *, amax_algo: AmaxAlgo = AmaxAlgo.MAX, margin: int = 0,
                      history_len: int | None = None) -> tuple[float, dict[str, Any]] | None:
    """The amax the policy takes from one history and the facts behind it, or None if unusable.

    Raises Fp8ExportError naming the layer for a corrupt history or an unusable result.
    """
    layer = f"{h.module} ({h.role})"
    amax_algo = AmaxAlgo.parse(amax_algo, "--amax-algo")
    if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        raise UsageError(f"--margin must be an integer >= 0, got {margin!r}.")
    values = _values(h, layer)
    usable = np.isfinite(values) & (values > 0)
    filled = int(np.sum(usable))
    details: dict[str, Any] = {
        "history_length": int(history_len if history_len is not None else values.size),
        "filled": filled,
        "amax_algo": str(amax_algo),
        "margin": margin,
    }
    nonfinite = int(np.sum(~np.isfinite(values)))
    if nonfinite:
        details["nonfinite_entries"] = nonfinite
    stored_ok = h.stored_scale is not None and math.isfinite(float(h.stored_scale)) \
        and float(h.stored_scale) > 0
    if amax_algo is AmaxAlgo.STORED and stored_ok:
        amax = float(h.stored_scale) * E4M3_MAX
        details.update(derived_from="stored-scale", stored_scale=float(h.stored_scale))
        if filled:
            details["staleness"] = int(np.argmax(usable))
            details["stored_vs_history"] = amax / float(values[usable].max())
    elif filled:
        first = int(np.argmax(usable))  # newest usable entry
        details["staleness"] = first  # newest entries that recorded nothing
        if amax_algo is AmaxAlgo.MOST_RECENT:
            amax = float(values[first])
        else:
            amax = float(values[usable].max())
        details["derived_from"] = "history"
        if h.stored_scale is not None:
            details["stored_scale"] = float(h.stored_scale)
            details["stored_vs_history"] = float(h.stored_scale) / (amax / E4M3_MAX)
    elif h.stored_scale is not None:
        stored = float(h.stored_scale)
        if not math.isfinite(stored) or stored <= 0:
            raise Fp8ExportError(f"{layer}: stored scale is {stored}; it must be finite and > 0. "
                                 "The FP8 training state is corrupt.")
        amax = stored * E4M3_MAX
        details.update(derived_from="stored-scale", stored_scale=stored, stored_vs_history=None,
                       staleness=int(values.size))
    else:
        return None
    amax = amax * 2.0 ** margin
    check_amax(amax, f"{h.module}: {h.role} amax from history")
    if h.notes:
        details["notes"] = list(h.notes)
    return amax, details


def _histories(state: TrainingState, role: str) -> Mapping[str, AmaxHistory]:
    return state.for_role(role)


def _name_list(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def ranges_from_history(state: TrainingState, modules: Iterable[str], *,
                        amax_algo: AmaxAlgo = AmaxAlgo.MAX, margin: int = 0,
                        ) -> tuple[dict[str, ActivationRange], list[str]]:
    """Activation ranges (input amax) of ``modules`` from their recorded input histories.

    Returns ``({module: ActivationRange}, notes)``. Modules without a history, or whose history
    is empty and whose stored scale was never updated, are absent and named in the notes.
    ``ActivationRange.details``: framework, version, history_length, filled, staleness,
    derived_from, stored_scale / stored_vs_history (stored-scale ÷ history-derived scale),
    amax_algo, margin, nonfinite_entries and the reader's notes when present.
    """
    histories = _histories(state, "input")
    lengths = state.details.get("history_len", {}) if isinstance(state.details, dict) else {}
    ranges: dict[str, ActivationRange] = {}
    missing: list[str] = []
    empty: list[str] = []
    from_stored: list[str] = []
    for module in modules:
        h = histories.get(module)
        if h is None:
            missing.append(module)
            continue
        got = amax_from_history(h, amax_algo=amax_algo, margin=margin,
                                history_len=lengths.get(module))
        if got is None:
            empty.append(module)
            continue
        amax, details = got
        if details["derived_from"] == "stored-scale" and not details["filled"]:
            from_stored.append(module)
        ranges[module] = ActivationRange(
            module=module, amax=amax, source=ScaleSource.HISTORY,
            details={"framework": state.framework, "version": state.version, **details})
    notes: list[str] = []
    if missing:
        notes.append(f"{len(missing)} layer(s) have no FP8 input history in the "
                     f"{state.framework} state: {_name_list(missing)}")
    if empty:
        notes.append(f"{len(empty)} layer(s) have an all-zero input history and a never-updated "
                     f"scale (the layer never ran in FP8 before saving): {_name_list(empty)}")
    if from_stored:
        notes.append(f"{len(from_stored)} layer(s) have an empty history window (history length "
                     f"1, e.g. Megatron's default); their stored scale was used: "
                     f"{_name_list(from_stored)}")
    return ranges, notes


def weight_scales_from_history(state: TrainingState, modules: Iterable[str], *,
                               amax_algo: AmaxAlgo = AmaxAlgo.MAX, margin: int = 0,
                               ) -> dict[str, float]:
    """Weight dequantization scales (amax/448) of ``modules`` from their weight histories.

    Only on request (``weight_scales_from_history=True``): the default recomputes weight scales
    from the final weights, because a weight history records pre-update weights. Modules
    without a usable weight history are absent.
    """
    histories = _histories(state, "weight")
    lengths = state.details.get("history_len", {}) if isinstance(state.details, dict) else {}
    scales: dict[str, float] = {}
    for module in modules:
        h = histories.get(module)
        if h is None:
            continue
        got = amax_from_history(h, amax_algo=amax_algo, margin=margin,
                                history_len=lengths.get(module))
        if got is not None:
            scales[module] = float(amax_to_scale(got[0], f"{module}.weight"))
    return scales
