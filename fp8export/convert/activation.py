"""Static activation ranges for ``convert --scales auto|history|calibrate|weights``.

- ``history``: the checkpoint's FP8 training state through the history policy
  (``fp8export.scales.history.ranges_from_history``; ``--amax-algo``, ``--margin``).
- ``calibrate``: ``fp8export.calibration.api.calibrate_ranges``, which reads a saved
  ``amax.json`` (``--calib-amax``, from ``fp8export calibrate``) or calibrates on ``--calib-data``.
- ``weights``: no activation ranges; activations are quantized dynamically at run time.
- ``auto``: history when the checkpoint has training state, else calibration when data (or an
  amax file) is given, else weights only.

Calibration (torch, transformers) is imported only when its mode runs. Fused siblings (q/k/v,
gate/up) read the same input, so with ``fuse_scales`` they share one range: the max of the group.
Layers left without a usable range are reported by the caller (they run with dynamic
activations in a second compressed-tensors group; see docs/fp8-folder.md).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fp8export.convert.config import ConvertConfig, ScalesMode
from fp8export.errors import Fp8ExportError
from fp8export.notes import Note, NoteKind
from fp8export.scales.groups import group_max
from fp8export.scales.history import ranges_from_history
from fp8export.scales.ranges import ActivationRange

if TYPE_CHECKING:
    from fp8export.checkpoint.source import Checkpoint


def _has_history(state: Any) -> bool:
    return state is not None and bool(getattr(state, "histories", None))


def _from_history(cfg: ConvertConfig, ckpt: Checkpoint, state: Any, modules: list[str]
                  ) -> tuple[dict[str, ActivationRange], list[str]]:
    if not _has_history(state):
        raise Fp8ExportError(
            f"{ckpt.path}: --scales history, but the checkpoint holds no FP8 training state "
            "(Transformer Engine extra_state, Keras float8 variables or torchao buffers). Use "
            "--scales calibrate --calib-data PATH, or --scales weights.")
    try:
        ranges, notes = ranges_from_history(state, modules, amax_algo=cfg.amax_algo,
                                            margin=cfg.margin)
    except Fp8ExportError as exc:  # policy errors name the layer; add the checkpoint
        if ckpt.path.name in str(exc):
            raise
        raise Fp8ExportError(f"{ckpt.path}: {exc}") from exc
    return dict(ranges), [*getattr(state, "warnings", []), *notes]


def _from_calibration(cfg: ConvertConfig, modules: list[str],
                      groups: dict[str, list[str]] | None
                      ) -> tuple[dict[str, ActivationRange], list[str]]:
    # calibrate_ranges reads --calib-amax itself when given, else runs the calibrators.
    from fp8export.calibration.api import calibrate_ranges

    ranges, info = calibrate_ranges(cfg, modules, groups=groups or None)
    info = info if isinstance(info, dict) else {}
    what = (f"activation ranges from {cfg.calib_amax.name}" if cfg.calib_amax is not None
            else "calibrated activation ranges")
    facts = [f"{k} {info[k]}" for k in ("method", "samples") if info.get(k) is not None]
    notes = [what + (f" ({', '.join(facts)})" if facts else "")]
    notes.extend(str(n) for n in info.get("notes") or [])
    return dict(ranges), notes


def resolve_activation_ranges(cfg: ConvertConfig, ckpt: Checkpoint, modules: list[str], *,
                              groups: dict[str, list[str]] | None = None,
                              ) -> tuple[dict[str, ActivationRange], list[str]]:
    """Activation ranges for ``modules`` per ``cfg.scales``, and notes for the user.

    Args:
        cfg: the convert options (``scales``, ``calib_*``, ``amax_algo``, ``margin``).
        ckpt: the opened checkpoint (for its training state).
        modules: the linear modules that become FP8.
        groups: fused groups (name -> member modules) that share one input range; ``None`` or
            ``{}`` to keep every module's own range.

    Returns:
        ``(ranges, notes)``: ranges only for modules in ``modules`` whose amax is finite and > 0.
        An empty dict means dynamic activations.
    """
    mode = cfg.scales
    notes: list[str] = []
    state = ckpt.training_state() if mode in (ScalesMode.AUTO, ScalesMode.HISTORY) else None
    if mode is ScalesMode.AUTO:
        if _has_history(state):
            mode = ScalesMode.HISTORY
            notes.append("--scales auto: using the checkpoint's FP8 training history")
        elif cfg.calib_data is not None or cfg.calib_amax is not None:
            mode = ScalesMode.CALIBRATE
            notes.append("--scales auto: no training history; " + (
                f"activation ranges from {cfg.calib_amax.name}" if cfg.calib_amax is not None
                else "calibrating on the given data"))
        else:
            notes.append(Note("weights only: activations are dynamic (no training history "
                              "or calibration data)", NoteKind.ACTIVATIONS))
            return {}, notes
    if mode is ScalesMode.WEIGHTS:
        notes.append(Note("weights only (--scales weights): activations are dynamic",
                          NoteKind.ACTIVATIONS))
        return {}, notes
    if mode is ScalesMode.HISTORY:
        ranges, more = _from_history(cfg, ckpt, state, modules)
    else:
        ranges, more = _from_calibration(cfg, modules, groups)
    notes.extend(more)

    wanted = set(modules)
    usable: dict[str, ActivationRange] = {}
    unusable: list[str] = []
    for name, r in ranges.items():
        if name not in wanted:
            continue
        if math.isfinite(r.amax) and r.amax > 0.0:
            usable[name] = r
        else:
            unusable.append(f"{name} (amax {r.amax})")
    if unusable:
        notes.append(f"{len(unusable)} activation range(s) are zero or not finite and were not "
                     f"used: {', '.join(sorted(unusable)[:5])}")
    for group, members in (groups or {}).items():
        top_amax = group_max({m: r.amax for m, r in usable.items()}, members)
        if top_amax is None:
            continue
        top = next(usable[m] for m in members if m in usable and usable[m].amax == top_amax)
        # a member without a range of its own reads the same input: it takes the group's
        for m in members:
            r = usable.get(m)
            if r is None or r.amax != top.amax:
                base = r or top
                usable[m] = replace(base, module=m, amax=top.amax,
                                    details={**base.details, "shared_with_fused_group": group,
                                             **({"own_amax": r.amax} if r else {})})
    return usable, notes
