"""torchao float8 training state → :class:`TrainingState` (delayed scaling, torchao 0.4–0.9).

Facts (``reference/training_amax_formats.md`` §4; ``torchao/float8/float8_linear.py`` and
``stateful_float8_linear.py`` ≤ v0.9,
``float8_linear_utils.py::sync_float8_amax_and_scale_history``):

* delayed scaling keeps persistent float32 buffers per ``Float8Linear`` for
  ``x ∈ {input, weight, grad_output}``: ``fp8_amax_x [1]`` (init: the format's max),
  ``fp8_amax_history_x [history_len]`` (default 16, zeros; **newest at index 0** — the sync does
  ``roll(+1)`` then ``history[0] = amax``) and ``fp8_scale_x [1]``, a **multiplier**
  (``448 / max(history)``, init 1.0);
* pytorch-labs/float8_experimental (the predecessor) named them ``fp8_amax_x`` / ``_w`` /
  ``_dL_dY`` until its PR #323;
* dynamic scaling (the default, and the only mode from v0.10) and the float8nocompile prototype
  save no FP8 state at all: nothing to reuse, activation scales must come from elsewhere.

``fp8_amax_x`` is the amax of the newest forward. torchao 0.9's sync updates a stacked *copy* of
the histories (``torch.vstack``) and writes back only the scales (seen running torchao 0.9.0 on
CPU), so the saved history buffer can miss every step after the first; when ``fp8_amax_x`` is a
real value not already at ``history[0]`` it is put in front as the newest entry.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from fp8export.checkpoint.training.base import AmaxHistory, TrainingState
from fp8export.errors import Fp8ExportError

FRAMEWORK = "torchao"

# buffer suffix of each role, per naming generation
_ROLES = {"input": "input", "weight": "weight", "grad_output": "grad_output",  # torchao 0.4–0.9
          "x": "input", "w": "weight", "dL_dY": "grad_output"}  # float8_experimental < #323
_BUFFER = re.compile(r"^(?:(?P<prefix>.*)\.)?fp8_(?P<what>amax_history|amax|scale|static_scale)_"
                     r"(?P<role>input|weight|grad_output|x|w|dL_dY)$")

DYNAMIC_NOTE = ("torchao float8 training with dynamic scaling (weights saved in torchao's float8 "
                "FSDP wrappers, no fp8_amax_history_* buffers): dynamic scaling (the default, "
                "and the only mode since torchao 0.10) and the float8nocompile prototype save no "
                "FP8 state, so there is no history to reuse; weights were read from the wrapped "
                "high-precision tensors and activation scales fall back to calibration or "
                "dynamic quantization.")


# ------------------------------------------------------------ FSDP float8 weight wrappers
#
# With ``enable_fsdp_float8_all_gather`` torchao wraps each Float8Linear weight in a tensor
# subclass (``torchao/float8/fsdp_utils.py``), and ``torch.save(model.state_dict())`` pickles the
# wrapper: ``_rebuild_from_type_v2(_rebuild_wrapper_subclass, WeightWith…Float8CastTensor, …)``
# with state ``{_tensor, _linear_mm_config, _dtype, _precomputed_scale}`` (seen with torchao
# 0.9.0). torch's weights-only unpickler rebuilds it once the three torchao names map to the
# inert stand-ins below (torchao is never imported); the reader then keeps only ``_tensor``, the
# high-precision weight.

WRAPPER_CLASSES = ("WeightWithDynamicFloat8CastTensor", "WeightWithDelayedFloat8CastTensor",
                   "WeightWithStaticFloat8CastTensor")


def _wrapper_stand_in():
    import torch

    class Float8WeightWrapperStandIn(torch.Tensor):
        """Holds the unpickled attributes of a torchao weight wrapper; computes nothing."""

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise Fp8ExportError("a torchao float8 weight wrapper was used before unwrapping "
                                 "(fp8export bug).")

    return Float8WeightWrapperStandIn


class MMConfigStandIn(tuple):
    """``LinearMMConfig`` / ``ScaledMMConfig`` (NamedTuples of flags): a plain tuple."""

    def __new__(cls, *args: Any):
        return super().__new__(cls, args)


_STAND_INS: list | None = None


def safe_globals() -> list:
    """``(stand-in, "module.name")`` pairs for ``torch.serialization.safe_globals``."""
    global _STAND_INS
    if _STAND_INS is None:
        wrapper = _wrapper_stand_in()
        _STAND_INS = [(wrapper, f"torchao.float8.fsdp_utils.{name}") for name in WRAPPER_CLASSES]
        _STAND_INS += [(MMConfigStandIn, f"torchao.float8.float8_tensor.{name}")
                       for name in ("LinearMMConfig", "ScaledMMConfig")]
    return _STAND_INS


def unwrap_weights(entries: dict[str, Any]) -> list[str]:
    """Replace torchao weight wrappers in ``entries`` by their high-precision tensors (in place);
    return the names that were wrapped."""
    import torch

    wrapper = safe_globals()[0][0]
    wrapped = [name for name, value in entries.items() if isinstance(value, wrapper)]
    for name in wrapped:
        inner = entries[name].__dict__.get("_tensor")
        if not isinstance(inner, torch.Tensor) or isinstance(inner, wrapper):
            raise Fp8ExportError(f"{name}: torchao float8 weight wrapper without a plain "
                                 "'_tensor' inside; the checkpoint is corrupt.")
        entries[name] = inner.detach().as_subclass(torch.Tensor)
    return wrapped


def names_torchao_float8(arg: str) -> bool:
    """Whether a pickle string names a torchao float8 global (for detection without loading)."""
    return arg.startswith("torchao.float8")


def is_torchao_buffer(name: str) -> bool:
    """Whether ``name`` is one of torchao's FP8 buffers (hidden from the model's tensors)."""
    return _BUFFER.match(name) is not None


def has_delayed_state(names: Iterable[str]) -> bool:
    return any((m := _BUFFER.match(n)) and m.group("what") == "amax_history" for n in names)


def _array(value: Any, name: str) -> np.ndarray:
    import torch

    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        what = getattr(value, "dtype", type(value).__name__)
        raise Fp8ExportError(f"{name}: torchao FP8 buffer is a {what}, not a float tensor; the "
                             "checkpoint is corrupt.")
    return value.detach().to(torch.float32).cpu().numpy().reshape(-1).copy()


def _one(value: Any, name: str) -> float:
    arr = _array(value, name)
    if arr.size != 1:
        raise Fp8ExportError(f"{name}: has {arr.size} values; torchao stores exactly one (shape "
                             "[1]). The checkpoint is corrupt.")
    return float(arr[0])


def torchao_training_state(tensors: Mapping[str, Any]) -> TrainingState | None:
    """Histories of every torchao ``Float8Linear`` with delayed-scaling buffers, or None."""
    found: dict[tuple[str, str], dict[str, str]] = {}
    legacy = False
    for name in tensors:
        m = _BUFFER.match(name)
        if m:
            legacy |= m.group("role") in ("x", "w", "dL_dY")
            key = (m.group("prefix") or "", _ROLES[m.group("role")])
            found.setdefault(key, {})[m.group("what")] = name
    if not any("amax_history" in v for v in found.values()):
        return None
    # Here, not at the top: numerics.fp8 imports torch, and the reader registry imports this
    # module for every input (an empty folder is refused before torch loads).
    from fp8export.numerics.fp8 import E4M3_MAX, E5M2_MAX, multiplier_to_scale

    state = TrainingState(framework=FRAMEWORK,
                          version="float8_experimental" if legacy else "torchao-0.4-0.9-delayed")
    lengths: dict[str, int] = {}
    for (module, role), names in sorted(found.items()):
        if role == "grad_output":  # backward quantity (E5M2): never an inference scale
            continue
        if "amax_history" not in names:
            state.warnings.append(f"{module}: torchao {role} buffers without fp8_amax_history_"
                                  f"{role}; not used.")
            continue
        hist_name = names["amax_history"]
        history = _array(tensors[hist_name], hist_name)
        if history.size == 0:
            raise Fp8ExportError(f"{hist_name}: empty amax history; torchao stores [history_len] "
                                 "values. The checkpoint is corrupt.")
        notes: list[str] = []
        if "amax" in names:
            newest = _one(tensors[names["amax"]], names["amax"])
            initial = E5M2_MAX if role == "grad_output" else E4M3_MAX
            if (math.isfinite(newest) and newest > 0 and newest != initial
                    and newest != float(history[0])):
                history = np.concatenate([[newest], history]).astype(np.float32)
                notes.append(f"fp8_amax_{role} ({newest:g}) is newer than the saved history; "
                             "put in front")
        stored: float | None = None
        if "scale" in names:
            mult = _one(tensors[names["scale"]], names["scale"])
            if mult == 1.0:
                notes.append("stored scale is torchao's initial 1.0 (never updated)")
            else:
                stored = float(multiplier_to_scale(mult, names["scale"]))
        lengths[module] = int(tensors[hist_name].numel())
        state.histories.append(AmaxHistory(module=module, role=role,
                                           history=np.ascontiguousarray(history, np.float32),
                                           stored_scale=stored, notes=tuple(notes)))
    state.details["history_len"] = lengths
    state.details["ignored"] = "grad_output buffers (backward, E5M2)"
    return state
