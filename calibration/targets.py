"""What calibration observes: convert's selection of linears, and the fused groups among them.

Members of a fused group (q/k/v, gate/up) feed one fused GEMM, so they share one input scale:
the group's max (DESIGN.md, "Fused groups").
"""

from __future__ import annotations

from pathlib import Path


def default_modules(checkpoint: Path, *, include=(), exclude=(),
                    fuse_scales: bool = True) -> tuple[list[str], dict[str, list[str]]]:
    """What ``convert`` quantizes (its selection) and its fused groups."""
    from fp8export.checkpoint.source import open_checkpoint
    from fp8export.scales.select import select_targets

    with open_checkpoint(checkpoint) as ckpt:
        sel = select_targets(ckpt.tensors(), ckpt.config, include=include, exclude=exclude,
                             fuse_scales=fuse_scales)
    return sel.modules, {k: list(v) for k, v in sel.groups.items()}
