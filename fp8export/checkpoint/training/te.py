"""Transformer Engine FP8 state → :class:`TrainingState`, and TE parameter names → HF-style names.

Facts used here (``reference/training_amax_formats.md`` §1.3–§1.5, from TE's
``pytorch/module/base.py``, ``pytorch/csrc/common.h`` and ``common/recipe/delayed_scaling.cu``):

* forward quantizer slots are ``3·g + {0 input, 1 weight, 2 output}`` for GEMM ``g``;
  ``scale_fwd`` is float32 ``[3·num_gemms]``, ``amax_history_fwd`` float32 ``[L, 3·num_gemms]``;
* ``scale`` is a *multiplier* (``q = x·scale``): our dequantization scale is ``1/scale``;
* after each update TE rolls the history by −1 and zeroes row 0, so row 0 is the accumulator of
  the step in progress (non-zero only when saved mid-step or in calibration mode), row ``L-1``
  the newest completed amax, rows ``L-2 … 1`` older ones. Newest first is therefore
  ``[row 0 if non-zero] + rows L-1, L-2, …, 1``;
* with ``amax_history_len=1`` (Megatron's default) the saved history is all zeros after an
  update and only ``scale`` carries information;
* in calibration mode TE copies the batch amax into row 0 and never updates ``scale`` (1.0).

Name mapping (what a TE module's parameters are called here, so that each history's ``module``
matches a ``<module>.weight`` tensor):

=====================  ==============================  =====================================
TE module              stored parameter                presented as
=====================  ==============================  =====================================
Linear                 ``P.weight`` / ``P.bias``       unchanged (module ``P``)
LayerNormLinear        ``P.weight``,                   unchanged (module ``P``; the input
                       ``P.layer_norm_weight``         amax is of the post-LN tensor)
Linear/LNLinear split  ``P.<x>_weight``                ``P.<x>.weight`` (all share slot 0/1)
LayerNormMLP           ``P.fc1_weight``/``fc1_bias``   ``P.fc1.weight`` / ``P.fc1.bias``
                       ``P.fc2_weight``/``fc2_bias``   ``P.fc2.weight`` / ``P.fc2.bias``
GroupedLinear          ``P.weight<i>`` / ``P.bias<i>``  ``P.<i>.weight`` / ``P.<i>.bias``
DotProductAttention    (no weights)                    histories role ``other``, module ``P``
=====================  ==============================  =====================================

``_extra_state`` entries themselves are not tensors of the model and are hidden by the reader.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fp8export.checkpoint.training.base import AmaxHistory, TrainingState
from fp8export.checkpoint.training.te_unpickle import RecipeStandIn, decode_extra_state
from fp8export.errors import Fp8ExportError

FRAMEWORK = "transformer-engine"
EXTRA_STATE = "_extra_state"

# DotProductAttention's own slots (META_QKV = GEMM1_OUTPUT, META_O = GEMM2_INPUT,
# META_S = GEMM3_OUTPUT; TE 1.13 and 2.x): attention quantities, never a linear's input.
ATTENTION_SLOTS = {2: "qkv", 3: "o", 8: "s"}
# Values one state tensor may hold: TE's default history (1024 steps) for 4096 quantizer slots
# (1365 GEMMs) is 2^22; this is 4x that.
MAX_STATE_VALUES = 1 << 24

_GROUPED_WEIGHT = re.compile(r"^weight(\d+)$")
_GROUPED_BIAS = re.compile(r"^bias(\d+)$")


@dataclass(frozen=True)
class TeGemm:
    """One GEMM of a TE module: its forward slots and the linear module(s) it feeds."""

    index: int  # g: input slot 3g, weight slot 3g+1
    modules: tuple[str, ...]  # presented module names (several for parameters_split)


@dataclass(frozen=True)
class TeModule:
    """A TE module found in a state dict, from the names of its direct parameters."""

    prefix: str
    kind: str  # Linear, LayerNormLinear, LayerNormMLP, GroupedLinear, DotProductAttention, unknown
    gemms: tuple[TeGemm, ...]
    renames: dict[str, str] = field(default_factory=dict)  # stored full name → presented name

    @property
    def layer(self) -> str:
        return f"{self.prefix}.{EXTRA_STATE}" if self.prefix else EXTRA_STATE


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _children(names: Iterable[str]) -> dict[str, set[str]]:
    """Module prefix → the names of its direct entries, in one pass over all names (looking
    them up per module would be quadratic: 60k tensors took a minute)."""
    out: dict[str, set[str]] = {}
    for n in names:
        parent, _, leaf = n.rpartition(".")
        out.setdefault(parent, set()).add(leaf)
    return out


def plan_module(prefix: str, names: Iterable[str]) -> TeModule:
    """Classify the TE module at ``prefix`` from its direct parameter names (no data read)."""
    return _plan(prefix, _children(names).get(prefix, set()))


def _plan(prefix: str, children: set[str]) -> TeModule:
    params = children - {EXTRA_STATE}
    renames: dict[str, str] = {}
    if "fc1_weight" in params and "fc2_weight" in params:
        for p in params:
            for fc in ("fc1", "fc2"):
                if p in (f"{fc}_weight", f"{fc}_bias"):
                    renames[_join(prefix, p)] = _join(prefix, f"{fc}.{p[len(fc) + 1:]}")
        gemms = (TeGemm(0, (_join(prefix, "fc1"),)), TeGemm(1, (_join(prefix, "fc2"),)))
        return TeModule(prefix, "LayerNormMLP", gemms, renames)
    grouped = sorted(int(m.group(1)) for p in params if (m := _GROUPED_WEIGHT.match(p)))
    if grouped:
        if grouped != list(range(len(grouped))):
            raise Fp8ExportError(
                f"{_join(prefix, 'weight<i>')}: GroupedLinear weights are numbered {grouped[:8]}, "
                "not 0…N-1; the checkpoint is incomplete.")
        for p in params:
            if m := (_GROUPED_WEIGHT.match(p) or _GROUPED_BIAS.match(p)):
                kind = "weight" if p.startswith("weight") else "bias"
                renames[_join(prefix, p)] = _join(prefix, f"{m.group(1)}.{kind}")
        gemms = tuple(TeGemm(i, (_join(prefix, str(i)),)) for i in grouped)
        return TeModule(prefix, "GroupedLinear", gemms, renames)
    kind = "LayerNormLinear" if "layer_norm_weight" in params else "Linear"
    if "weight" in params:
        return TeModule(prefix, kind, (TeGemm(0, (prefix,)),), renames)
    # parameters_split: TE registers f"{split_name}weight" (e.g. query_weight) and shares one
    # set of FP8 slots between them.
    split = sorted(p[: -len("weight")] for p in params
                   if p.endswith("weight") and p != "layer_norm_weight" and p != "weight")
    if split:
        subs = []
        for s in split:
            sub = s.rstrip("_") or "weight"
            subs.append(_join(prefix, sub))
            renames[_join(prefix, f"{s}weight")] = _join(prefix, f"{sub}.weight")
            if f"{s}bias" in params:
                renames[_join(prefix, f"{s}bias")] = _join(prefix, f"{sub}.bias")
        return TeModule(prefix, kind, (TeGemm(0, tuple(subs)),), renames)
    return TeModule(prefix, "DotProductAttention" if not params else "unknown", (), renames)


def plan_modules(names: Iterable[str]) -> dict[str, TeModule]:
    """Every TE module (every ``<prefix>._extra_state``) in a list of state-dict names."""
    names = list(names)
    prefixes = [n[: -len(EXTRA_STATE)].rstrip(".") for n in names
                if n == EXTRA_STATE or n.endswith("." + EXTRA_STATE)]
    children = _children(names)
    plans = {p: _plan(p, children.get(p, set())) for p in prefixes}
    stored = set(names)
    seen: dict[str, str] = {}
    for plan in plans.values():
        for old, new in plan.renames.items():
            if new in stored or new in seen:
                raise Fp8ExportError(
                    f"{old}: would be presented as {new!r}, which already names another tensor; "
                    "the checkpoint mixes TE and non-TE names for one module.")
            seen[new] = old
    return plans


# ------------------------------------------------------------------------------ state

def _float_array(value: Any, layer: str, key: str, ndim: int) -> np.ndarray:
    import torch

    if not isinstance(value, torch.Tensor):
        raise Fp8ExportError(f"{layer}: '{key}' is a {type(value).__name__}, not a tensor; the FP8 "
                             "extra state is corrupt.")
    if not value.dtype.is_floating_point or value.dim() != ndim:
        raise Fp8ExportError(
            f"{layer}: '{key}' is a {value.dtype} tensor of shape {tuple(value.shape)}; "
            f"Transformer Engine stores a {ndim}-D float32 tensor. The FP8 extra state is "
            "corrupt.")
    # Checked before the copy below materializes it: a view of a few stored values (stride 0)
    # can claim a billion rows.
    if math.prod(value.shape) > MAX_STATE_VALUES:
        raise Fp8ExportError(
            f"{layer}: '{key}' has shape {list(value.shape)}, more values than any Transformer "
            f"Engine state holds (limit {MAX_STATE_VALUES}: histories of up to thousands of "
            "steps for hundreds of GEMMs). The FP8 extra state is corrupt or hostile.")
    return value.detach().to(torch.float32).cpu().numpy().copy()


def _recipe_facts(state: dict, layer: str) -> dict[str, Any]:
    recipe = state.get("recipe")
    facts: dict[str, Any] = {}
    if isinstance(recipe, RecipeStandIn):
        facts["recipe"] = recipe.recipe_name
        for key in ("margin", "amax_history_len", "reduce_amax", "fp8_dpa", "fp8_mha"):
            v = recipe.get(key)
            if isinstance(v, (bool, int, float, str)):
                facts[key] = v
        algo = recipe.get("amax_compute_algo")
        facts["amax_compute_algo"] = algo if isinstance(algo, str) else "custom" if algo else None
        fmt = recipe.get("fp8_format")
        if fmt is not None:
            facts["fp8_format"] = getattr(fmt, "name", "unknown")
    elif recipe is not None:
        raise Fp8ExportError(f"{layer}: 'recipe' is a {type(recipe).__name__}, not a Transformer "
                             "Engine recipe; the FP8 extra state is corrupt.")
    extra = state.get("extra_fp8_variables")
    if isinstance(extra, dict):
        for key in ("num_gemms", "fp8_max_fwd"):
            if isinstance(extra.get(key), (int, float)) and not isinstance(extra.get(key), bool):
                facts[key] = extra[key]
    return facts


def _newest_first(column: np.ndarray) -> np.ndarray:
    """TE history column (row 0 accumulator, row L-1 newest) → newest-first float32 array."""
    older = column[1:][::-1]  # rows L-1, L-2, …, 1
    head = column[:1] if column[0] != 0 else column[:0]
    return np.ascontiguousarray(np.concatenate([head, older]), dtype=np.float32)


def _stored_scale(multiplier: float, layer: str, slot: int) -> tuple[float | None, tuple[str, ...]]:
    if multiplier == 1.0:  # TE's initial value: the scale was never updated
        return None, ("stored scale is TE's initial 1.0 (never updated)",)
    if not math.isfinite(multiplier) or multiplier <= 0:
        raise Fp8ExportError(
            f"{layer}: stored FP8 multiplier of forward slot {slot} is {multiplier}; Transformer "
            "Engine keeps it finite and > 0. The FP8 extra state is corrupt; convert with "
            "--scales calibrate instead.")
    # Here, not at the top: numerics.fp8 imports torch, and the reader registry imports this
    # module for every input.
    from fp8export.numerics.fp8 import multiplier_to_scale

    return float(multiplier_to_scale(multiplier, f"{layer} slot {slot}")), ()


@dataclass
class _Decoded:
    layout: str
    histories: list[AmaxHistory]
    details: dict[str, Any]
    warning: str | None = None


def _decode_module(plan: TeModule, value: Any) -> _Decoded:
    layer = plan.layer
    state, layout = decode_extra_state(value, layer)
    details: dict[str, Any] = {"kind": plan.kind, "layout": layout}
    targets = ", ".join(m for g in plan.gemms for m in g.modules) or plan.prefix or "<root>"
    if state is None:
        return _Decoded(layout, [], details, (
            f"{layer}: empty FP8 state ({targets}): the last forward before saving ran outside "
            "FP8 autocast, or the recipe keeps no state; no history to reuse."))
    if isinstance(state, list) and len(state) == 4:
        # TE <= 0.2 saved [scale_fwd, amax_history_fwd, scale_bwd, amax_history_bwd]
        # (TE's own set_extra_state keeps this backward-compatibility branch).
        state = {"scale_fwd": state[0], "amax_history_fwd": state[1]}
    if not isinstance(state, dict):
        raise Fp8ExportError(f"{layer}: FP8 extra state decodes to a {type(state).__name__}, not "
                             "Transformer Engine's dict; the checkpoint is corrupt.")
    details.update(_recipe_facts(state, layer))
    if "scale_fwd" not in state and "amax_history_fwd" not in state:
        recipe = details.get("recipe", "an unknown recipe")
        return _Decoded(layout, [], details, (
            f"{layer}: recipe {recipe} keeps no amax history (stateless scaling) for {targets}; "
            "nothing to reuse."))
    scale = _float_array(state.get("scale_fwd"), layer, "scale_fwd", 1)
    hist = _float_array(state.get("amax_history_fwd"), layer, "amax_history_fwd", 2)
    n = scale.shape[0]
    if hist.shape[1] != n or n == 0 or n % 3 or hist.shape[0] == 0:
        raise Fp8ExportError(
            f"{layer}: amax_history_fwd has shape {list(hist.shape)} and scale_fwd {n} entries; "
            "Transformer Engine stores [L, 3·num_gemms] and 3·num_gemms. The FP8 extra state "
            "is corrupt.")
    num_gemms = n // 3
    declared = details.get("num_gemms")
    if declared is not None and declared != num_gemms:
        raise Fp8ExportError(f"{layer}: extra_fp8_variables says num_gemms={declared} but the "
                             f"forward state has {n} slots (3 per GEMM); the state is corrupt.")
    if plan.kind == "DotProductAttention" and num_gemms != 3:
        return _Decoded(layout, [], details, (
            f"{layer}: attention FP8 state with {num_gemms} GEMM(s) instead of 3; not read (it "
            "is never used for linear scales)."))
    expected = 2 if plan.kind == "LayerNormMLP" else len(plan.gemms) or None
    if expected is not None and num_gemms != expected:
        raise Fp8ExportError(
            f"{layer}: {plan.kind} should have {expected} GEMM(s) of FP8 state but has "
            f"{num_gemms}; the extra state does not belong to this module's parameters.")
    length = int(hist.shape[0])
    details["history_len"] = length
    calibration = bool(np.all(scale == 1.0) and np.any(hist[0] != 0) and not np.any(hist[1:]))
    if calibration:
        details["calibration_mode"] = True
    notes_common: tuple[str, ...] = (f"te layout {layout}",)
    if calibration:
        notes_common += ("calibration-mode state: TE never updated the scale; amax from row 0",)
    histories: list[AmaxHistory] = []
    for gemm in plan.gemms:
        for role, slot in (("input", 3 * gemm.index), ("weight", 3 * gemm.index + 1)):
            stored, notes = _stored_scale(float(scale[slot]), layer, slot)
            column = _newest_first(hist[:, slot])
            for module in gemm.modules:
                histories.append(AmaxHistory(module=module, role=role, history=column.copy(),
                                             stored_scale=stored, notes=notes_common + notes))
    if plan.kind == "DotProductAttention":
        for slot, what in ATTENTION_SLOTS.items():
            stored, notes = _stored_scale(float(scale[slot]), layer, slot)
            histories.append(AmaxHistory(
                module=plan.prefix, role="other", history=_newest_first(hist[:, slot]),
                stored_scale=stored,
                notes=notes_common + notes + (f"attention {what} slot {slot}; not a GEMM input",)))
    return _Decoded(layout, histories, details)


def _version(layouts: set[str], recipes: bool) -> str:
    if "te-uint8-pickle" in layouts:
        name = "te-2.x-pickle" if recipes else "te-0.6-0.11-pickle"
        layouts = (layouts - {"te-uint8-pickle"}) | {name}
    layouts -= {"none", "empty"}
    return "+".join(sorted(layouts)) or "te-empty"


def te_training_state(entries: Mapping[str, Any], plans: Mapping[str, TeModule] | None = None
                      ) -> TrainingState:
    """Decode every ``_extra_state`` in ``entries`` (stored names → values) into one state.

    ``plans`` (from :func:`plan_modules`) may be given when already computed. History modules use
    the presented (renamed) names. Raises Fp8ExportError naming the layer on corrupt state.
    """
    plans = plan_modules(entries) if plans is None else plans
    state = TrainingState(framework=FRAMEWORK, version=None)
    layouts: set[str] = set()
    modules: dict[str, Any] = {}
    history_len: dict[str, int] = {}
    recipes = False
    for prefix, plan in sorted(plans.items()):
        decoded = _decode_module(plan, entries[plan.layer])
        layouts.add(decoded.layout)
        recipes |= "recipe" in decoded.details
        modules[prefix or "<root>"] = decoded.details
        state.histories.extend(decoded.histories)
        history_len.update((h.module, decoded.details["history_len"])
                           for h in decoded.histories if h.role != "other")
        if decoded.warning:
            state.warnings.append(decoded.warning)
        if plan.kind == "unknown":
            state.warnings.append(f"{plan.layer}: module type not recognised from its parameters; "
                                  "its FP8 state is not used.")
    state.version = _version(layouts, recipes)
    state.details["modules"] = modules
    state.details["history_len"] = history_len
    state.details["ignored"] = "backward (gradient) slots, GEMM output slots"
    return state

