"""Fused groups share one scale: the max over the group (DESIGN.md).

q/k/v and gate/up read the same input and run as one fused GEMM in vLLM and TensorRT, which
has one weight scale and one input scale; so every member uses the group's max amax (or
scale). Convert's weight scan, its history weight scales, its activation ranges, calibration
and the accuracy-budget search all find groups and share through here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

V = TypeVar("V", bound=float)


def group_max(values: Mapping[str, V], members: Iterable[str]) -> V | None:
    """The largest value among the members that have one; None when none has."""
    have = [values[m] for m in members if m in values]
    return max(have) if have else None


def share_max(values: Mapping[str, V], groups: Mapping[str, Iterable[str]]) -> dict[str, V]:
    """``values`` with every member of a group set to the group's max.

    Members without a value stay without one. A group holding a NaN or Inf is left as it is
    (the caller reports the offender; a max over it would hide which member it was).
    """
    out = dict(values)
    for members in groups.values():
        members = list(members)
        have = [values[m] for m in members if m in values]
        if not have or not all(math.isfinite(v) for v in have):
            continue
        top = max(have)
        for m in members:
            if m in values:
                out[m] = top
    return out


def fused_groups(modules: Iterable[str], config: Mapping[str, Any] | None
                 ) -> dict[str, list[str]]:
    """Fused group -> its members among ``modules``, by the family table (the rule convert's
    selection uses); groups of one member are dropped. No family, no groups."""
    from fp8export.scales.families import family_of, fused_group_of

    family = family_of(dict(config) if config is not None else None)
    present = list(modules)
    found: dict[str, list[str]] = {}
    for m in present:
        fg = fused_group_of(m, family)
        if fg is not None:
            found.setdefault(fg[0], [x for x in fg[1] if x in set(present)])
    return {g: ms for g, ms in found.items() if len(ms) >= 2}
