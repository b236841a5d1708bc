"""What calibration observes: convert's selection of linears, and the fused groups among them.

Members of a fused group (q/k/v, gate/up) feed one fused GEMM, so they share one input scale:
the group's max (DESIGN.md, "Fused groups").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# Name patterns of projections that read the same input (used when the checkpoint's family
# table does not say): siblings under one parent share one input scale.
_FUSED_LEAVES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"),
                 ("query", "key", "value"), ("q", "k", "v"), ("wi_0", "wi_1"))


def default_modules(checkpoint: Path, config: dict | None, *, include=(), exclude=(),
                    fuse_scales: bool = True) -> tuple[list[str], dict[str, list[str]]]:
    """What ``convert`` quantizes (its selection) and its fused groups."""
    from fp8export.checkpoint.source import open_checkpoint
    from fp8export.scales.select import select_targets

    with open_checkpoint(checkpoint) as ckpt:
        sel = select_targets(ckpt.tensors(), ckpt.config, include=include, exclude=exclude,
                             fuse_scales=fuse_scales)
    return sel.modules, {k: list(v) for k, v in sel.groups.items()}


def groups_by_name(modules: Sequence[str], config: dict | None = None) -> dict[str, list[str]]:
    """Fused groups among ``modules`` by the family table, else by sibling leaf names."""
    family = None
    try:
        from fp8export.scales.families import family_of, fused_group_of

        family = family_of(config)
    except ImportError:  # pragma: no cover - the selection module ships with fp8export
        fused_group_of = None
    present = set(modules)
    groups: dict[str, list[str]] = {}
    for m in modules:
        fg = fused_group_of(m, family) if (fused_group_of and family) else None
        if fg is None:
            parent, _, leaf = m.rpartition(".")
            for leaves in _FUSED_LEAVES:
                if leaf in leaves:
                    pre = f"{parent}." if parent else ""
                    fg = (f"{pre}{'_'.join(leaves)}", tuple(pre + x for x in leaves))
                    break
        if fg is None:
            continue
        name, members = fg
        groups.setdefault(name, [x for x in members if x in present])
    return {g: ms for g, ms in groups.items() if len(ms) >= 2}


def share_groups(amax: dict[str, float], groups: dict[str, list[str]]) -> dict[str, float]:
    """Members of a fused group get the group's max (they feed one fused GEMM, DESIGN.md)."""
    out = dict(amax)
    for members in groups.values():
        seen = [amax[m] for m in members if m in amax]
        if seen:
            top = max(seen)
            for m in members:
                if m in amax:
                    out[m] = top
    return out


