"""Keras 3 float8 training state (``model.quantize("float8")``) → :class:`TrainingState`.

What Keras stores, per float8 Dense/EinsumDense, after the kernel (and bias when present) —
order from ``variable_serialization_spec["float8"]`` in ``keras/src/layers/core/dense.py`` and
``einsum_dense.py`` (Keras 3.3–3.15):

  inputs_scale, inputs_amax_history, kernel_scale, kernel_amax_history,
  outputs_grad_scale, outputs_grad_amax_history

Meaning (``keras/src/quantizers/quantizers.py``):
- ``quantize_and_dequantize`` computes ``clip(x / scale) → cast → · scale``, so a Keras scale is
  already our *dequantization* factor ``amax / 448``: no conversion, unlike TE/torchao.
- ``compute_float8_amax_history`` does ``roll(h, -1)`` then ``h[0] = amax``. Index 0 is the
  newest amax, but the roll moves the previous newest to index ``L-1``: the stored array is a
  ring, newest-first order is ``h[0], h[L-1], h[L-2], …, h[1]`` (checked against Keras on the
  torch backend in tests/checkpoint/training/test_keras_state.py). We return that order.
- ``_float8_call`` computes the new scale from ``max(history)`` *before* recording the current
  step, so the stored scale lags the stored history by one step (it ignores the newest entry).
- ``outputs_grad_*`` are E5M2 (max 57344) backward-pass state: never inference quantities,
  so they are not returned (``details["ignored"]`` says so).
- The scales start at 1.0 and the histories at 0: an all-zero history with scale 1.0 means the
  layer never ran in training mode after ``quantize`` (frozen, or saved before ``fit``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from fp8export.checkpoint.training.base import AmaxHistory, TrainingState
from fp8export.errors import Fp8ExportError

FLOAT8_VARIABLES = ("inputs_scale", "inputs_amax_history", "kernel_scale",
                    "kernel_amax_history", "outputs_grad_scale", "outputs_grad_amax_history")
_ROLES = (("input", "inputs"), ("weight", "kernel"))


@dataclass(frozen=True)
class Float8Layer:
    """The six float8 variables of one layer, as read from the weights file (stored order)."""

    module: str  # tensor-name prefix: the layer's kernel is "<module>.weight"
    where: str  # file and HDF5 group, for messages
    variables: dict[str, np.ndarray]  # FLOAT8_VARIABLES → array


def newest_first(ring: np.ndarray) -> np.ndarray:
    """Keras's ring order (``h[0]`` newest, then ``h[L-1]``, ``h[L-2]`` …) → newest first."""
    ring = np.asarray(ring, dtype=np.float32)
    return np.concatenate([ring[:1], ring[:0:-1]]) if ring.size else ring


def _check(layer: Float8Layer, prefix: str) -> tuple[np.ndarray, float]:
    hist = np.asarray(layer.variables[f"{prefix}_amax_history"], dtype=np.float32)
    scale = np.asarray(layer.variables[f"{prefix}_scale"], dtype=np.float32)
    if hist.ndim != 1 or hist.size == 0 or scale.shape not in ((), (1,)):
        raise Fp8ExportError(
            f"{layer.where}: {prefix}_amax_history has shape {hist.shape} and {prefix}_scale "
            f"{scale.shape}; Keras float8 layers store a 1-D history and a scalar scale. The "
            "file is corrupt or not a Keras float8 checkpoint.")
    # NaN/Inf entries are steps whose inputs overflowed; Keras keeps the old scale on them
    # (compute_float8_scale). They stay in the history: the shared policy skips them and
    # refuses a history with nothing else (fp8export.scales.history).
    if (hist[np.isfinite(hist)] < 0).any():
        raise Fp8ExportError(
            f"{layer.where}: {prefix}_amax_history holds negative values; an amax is max|x| "
            "and never negative. The file is corrupt.")
    return hist, float(scale.reshape(()))


def _slot(layer: Float8Layer, role: str, prefix: str) -> AmaxHistory:
    ring, scale = _check(layer, prefix)
    hist = newest_first(ring)
    filled = int(np.count_nonzero(hist))
    notes = [f"keras {prefix}_amax_history: {filled} of {hist.size} entries filled; "
             "reordered newest-first from Keras's ring layout"]
    if not np.isfinite(hist).all():
        notes.append(f"{int((~np.isfinite(hist)).sum())} NaN/Inf entries (overflowed steps)")
    stored: float | None = scale
    if filled == 0 and scale == 1.0:
        stored = None
        notes.append(f"never updated: {prefix}_scale is still its initial 1.0")
    elif not np.isfinite(scale) or scale <= 0:
        stored = None
        notes.append(f"stored {prefix}_scale {scale} is unusable and was dropped")
    else:
        notes.append("stored scale lags the history by one step (computed before the newest "
                     "entry was recorded)")
        # nothing evicted yet: the lag can be checked exactly
        if 0 < filled < hist.size and np.isfinite(hist).all():
            # Before any non-zero amax was recorded Keras keeps the initial scale 1.0.
            prior = float(hist[1:].max()) if hist.size > 1 else 0.0
            expected = prior / 448.0 if prior > 0 else 1.0
            if not np.isclose(scale, expected, rtol=1e-5):
                notes.append(f"stored scale {scale:.6g} differs from max(history[1:])/448 = "
                             f"{expected:.6g}: saved mid-step or edited")
    return AmaxHistory(module=layer.module, role=role, history=hist, stored_scale=stored,
                       notes=tuple(notes))


def keras_training_state(layers: Iterable[Float8Layer], version: str | None) -> TrainingState:
    """Histories of every float8 layer: roles "input" and "weight" (E5M2 gradients ignored)."""
    state = TrainingState(framework="keras", version=version)
    count = 0
    for layer in layers:
        count += 1
        for role, prefix in _ROLES:
            state.histories.append(_slot(layer, role, prefix))
    lengths = sorted({h.history.size for h in state.histories})
    state.details.update({
        "float8_layers": count,
        "amax_history_length": lengths[0] if len(lengths) == 1 else lengths,
        "history_order": "newest first (converted from Keras's ring: h[0], h[L-1], ..., h[1])",
        "scale_meaning": "Keras scale = amax/448, a dequantization factor (no conversion)",
        "ignored": "outputs_grad_scale / outputs_grad_amax_history: E5M2 backward state",
    })
    if count == 0:
        state.warnings.append("no float8 layers: the model was not quantized with "
                              'model.quantize("float8")')
    return state
