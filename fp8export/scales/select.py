"""Which tensors become FP8: the 2-D weights of linear layers, minus default exclusions.

Rules, in order of precedence (also in ``fp8export convert --help``):
1. ``--exclude GLOB`` wins over everything: a module it matches stays in high precision.
2. ``--include GLOB`` wins over the default exclusions: a module it matches is quantized when
   its ``.weight`` is a 2-D floating tensor (even ``lm_head``).
3. Otherwise the model family's table decides (:mod:`fp8export.scales.families`), or, for
   unknown families, the fallback rule: 2-D floating ``*.weight`` tensors of modules that are
   not embeddings, norms, output heads or MoE routers.
Globs are ``fnmatch`` patterns on module names (``model.layers.*.mlp.down_proj``).

Selection works on metadata only (names, dtypes, shapes). Value checks (NaN/Inf, all-zero)
need the data and happen in :mod:`fp8export.scales.weights`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import Any

from fp8export.checkpoint.source import TensorInfo
from fp8export.errors import Fp8ExportError
from fp8export.scales.families import (
    Family,
    default_exclusion,
    family_of,
    fused_group_of,
    moe_routers,
    role_of,
)

FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
_MAX_LISTED = 12


@dataclass(frozen=True)
class Target:
    """One linear weight that becomes FP8."""

    module: str  # "model.layers.0.self_attn.q_proj"
    weight: str  # "<module>.weight"
    shape: tuple[int, ...]
    dtype: str  # source dtype, safetensors spelling
    layout: str  # "out_in" (nn.Linear) or "in_out" (Conv1D, Keras kernels)
    file: str  # source file name (for shard mirroring)
    fused_group: str | None = None  # siblings sharing scales: "model.layers.0.self_attn.qkv"


@dataclass
class Selection:
    """Result of :func:`select_targets`."""

    family: str | None
    targets: list[Target]
    excluded: dict[str, str]  # tensor name -> reason (every tensor that is not a target weight)
    groups: dict[str, list[str]]  # fused group -> member modules (only groups of 2+ targets)
    ignore: list[str]  # modules with a 2-D weight left in high precision (format ignore lists)
    notes: list[str] = field(default_factory=list)

    @property
    def modules(self) -> list[str]:
        return [t.module for t in self.targets]

    def without(self, modules: Iterable[str], reason: str) -> Selection:
        """A copy with ``modules`` moved from the targets to the excluded list."""
        drop = set(modules)
        kept = [t for t in self.targets if t.module not in drop]
        excluded = dict(self.excluded)
        for t in self.targets:
            if t.module in drop:
                excluded[t.weight] = reason
        ignore = sorted(set(self.ignore) | (drop & {t.module for t in self.targets}))
        groups = _groups(kept)
        kept = [replace(t, fused_group=t.fused_group if t.fused_group in groups else None)
                for t in kept]
        return Selection(self.family, kept, excluded, groups, ignore, list(self.notes))


def _matching(patterns: Sequence[str], module: str) -> str | None:
    for p in patterns:
        if fnmatchcase(module, p):
            return p
    return None


# Keras variables that are not kernels keep their own names (``<layer>.vars.<i>``,
# ``<layer>.embeddings``, ``<layer>.gamma``): the layer's name says what they are.
_KERAS_VARIABLE = re.compile(r"\.(vars\.\d+|embeddings|gamma|beta)$")


def _non_weight_reason(info: TensorInfo) -> str:
    if info.name.endswith((".experts.gate_up_proj", ".experts.down_proj")) \
            and len(info.shape) == 3:
        return ("MoE experts stored fused (3-D): kept in high precision (FP8 experts are "
                "written one linear per expert; convert a per-expert checkpoint)")
    layer = _KERAS_VARIABLE.sub("", info.name)
    if layer != info.name and (reason := default_exclusion(layer)) is not None:
        return reason
    if info.name.endswith(".bias"):
        return "bias (copied unchanged)"
    if info.name.endswith(".weight"):
        if len(info.shape) == 4 and info.shape[1] == 3:
            return "convolution with 3 input channels (kept in high precision)"
        if len(info.shape) >= 3:
            return f"{len(info.shape)}-D weight, not a linear layer (copied unchanged)"
        return "1-D weight: norm or scale (copied unchanged)"
    return "not a weight (copied unchanged)"


def _groups(targets: list[Target]) -> dict[str, list[str]]:
    members: dict[str, list[str]] = {}
    for t in targets:
        if t.fused_group:
            members.setdefault(t.fused_group, []).append(t.module)
    return {g: m for g, m in members.items() if len(m) >= 2}


def select_targets(tensors: Sequence[TensorInfo], config: dict[str, Any] | None, *,
                   include: Sequence[str] = (), exclude: Sequence[str] = (),
                   fuse_scales: bool = True) -> Selection:
    """Decide which tensors of a checkpoint become FP8.

    Args:
        tensors: every tensor of the checkpoint (``Checkpoint.tensors()``), in source order.
        config: the model's config.json (None for a bare state dict: fallback rule).
        include, exclude: fnmatch globs on module names (see the module docstring).
        fuse_scales: record fused groups (q/k/v, gate/up) so they share scales; when False each
            projection keeps its own scales.

    Returns:
        A :class:`Selection`. Raises Fp8ExportError listing every tensor that should be a
        weight but is integer or already FP8.
    """
    family: Family | None = family_of(config)
    targets: list[Target] = []
    excluded: dict[str, str] = {}
    ignore: set[str] = set()
    bad: list[str] = []
    already_fp8: list[TensorInfo] = []
    used_include: set[str] = set()
    used_exclude: set[str] = set()

    for info in tensors:
        if not info.name.endswith(".weight") or len(info.shape) != 2:
            excluded[info.name] = _non_weight_reason(info)
            continue
        module = info.name[: -len(".weight")]
        role, reason = role_of(module, family)
        ex = _matching(exclude, module)
        inc = _matching(include, module)
        if ex is not None:
            used_exclude.add(ex)
            excluded[info.name] = f"excluded by --exclude {ex!r}"
            ignore.add(module)
            continue
        if inc is not None:
            used_include.add(inc)
        elif role != "linear":
            excluded[info.name] = reason or "not a linear layer"
            # Every module with a 2-D weight left in high precision goes to the ignore list:
            # a "Linear" target would otherwise match it (ignoring an Embedding is harmless).
            ignore.add(module)
            continue
        if info.dtype in FP8_DTYPES:
            already_fp8.append(info)
            continue
        if info.dtype not in FLOAT_DTYPES:
            bad.append(f"{info.name} ({info.file.name}) has dtype {info.dtype} where a floating "
                       "linear weight is expected")
            continue
        if info.numel == 0:
            excluded[info.name] = "empty weight (no elements)"
            ignore.add(module)
            continue
        transposed = info.transposed or (family is not None and module.rsplit(".", 1)[-1]
                                         in family.in_out)
        group = fused_group_of(module, family) if fuse_scales else None
        targets.append(Target(module=module, weight=info.name, shape=tuple(info.shape),
                              dtype=info.dtype, layout="in_out" if transposed else "out_in",
                              file=info.file.name, fused_group=group[0] if group else None))

    if already_fp8:  # said once: the input is an FP8 checkpoint, not a broken one
        first = already_fp8[0]
        dtypes = "/".join(sorted({i.dtype for i in already_fp8}))
        fp8 = (f"{len(already_fp8)} linear weight(s) are already {dtypes} (e.g. {first.name} "
               f"in {first.file.name})")
        if not bad:
            raise Fp8ExportError(
                f"{fp8}: this checkpoint is already quantized to FP8, so there is nothing to "
                "convert. To check it, verify it as the candidate: fp8export verify ORIGINAL "
                "THIS; to convert again, give convert the bf16/fp16/fp32 original.")
        bad.append(f"{fp8}: this checkpoint looks quantized; convert its bf16/fp16/fp32 "
                   "original instead")
    if bad:
        count = len(bad) + max(len(already_fp8) - 1, 0)
        shown = "; ".join(bad[:_MAX_LISTED])
        more = f" (and {len(bad) - _MAX_LISTED} more)" if len(bad) > _MAX_LISTED else ""
        raise Fp8ExportError(
            f"{count} tensor(s) cannot become FP8: {shown}{more}. Fix the checkpoint, or "
            "leave these modules out with --exclude GLOB.")

    routers = moe_routers([t.module for t in targets], [i.name for i in tensors])
    if routers:
        raise Fp8ExportError(
            f"--include {', '.join(repr(p) for p in sorted(used_include))} selects "
            f"{len(routers)} MoE router(s) ({', '.join(routers[:3])}"
            f"{' ...' if len(routers) > 3 else ''}): engines build routers unquantized (vLLM, "
            "transformers), so an FP8 router would load as raw codes or not at all. Narrow the "
            "--include glob, or add --exclude for the routers.")
    groups = _groups(targets)
    targets = [replace(t, fused_group=t.fused_group if t.fused_group in groups else None)
               for t in targets]
    notes: list[str] = []
    # vLLM loads q/k/v (gate/up) as one layer and refuses a group that is only partly quantized.
    target_modules = {t.module for t in targets}
    for info in tensors:
        module = info.name[: -len(".weight")] if info.name.endswith(".weight") else None
        if module and module not in target_modules and family is not None and fuse_scales:
            fg = fused_group_of(module, family)
            if fg and any(m in target_modules for m in fg[1]):
                notes.append(f"{module} is left in high precision but its fused siblings are "
                             "FP8; vLLM refuses partly quantized fused layers (quantize or "
                             "exclude the whole group)")
    if family is not None:
        ignore.update(h for h in family.tied_heads if h not in target_modules)
    elif "lm_head" not in target_modules:
        ignore.add("lm_head")
    for flag, patterns, used in (("--include", include, used_include),
                                 ("--exclude", exclude, used_exclude)):
        for p in patterns:
            if p not in used:
                notes.append(f"{flag} {p!r} matched no 2-D weight")
    return Selection(family=family.name if family else None, targets=targets, excluded=excluded,
                     groups=groups, ignore=sorted(ignore), notes=notes)
