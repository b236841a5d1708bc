"""Read the written FP8 folder back before publishing it, and fail loudly on any defect.

Every output shard is reopened with the real ``safetensors.safe_open``. Checked: the tensor
names are exactly those planned, each dtype and shape is as planned (F8_E4M3 weights, F32
scales), every scale is finite, > 0 and equal to the scale we computed, and every quantized
weight, dequantized from disk, is within :data:`MIN_WEIGHT_SQNR_DB` of its source (SQNR
recomputed from the source checkpoint). The index (when sharded) must map every tensor to
the shard that holds it. All problems are collected into one Fp8ExportError.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from fp8export.checkpoint.source import Checkpoint
from fp8export.checkpoint.weights import MIN_WEIGHT_SQNR_DB, roundtrip_sqnr
from fp8export.checkpoint.write import INDEX_NAME, ShardPlan
from fp8export.errors import Fp8ExportError

_MAX_LISTED = 10


def verify_output(out_dir: Path, plans: list[ShardPlan], ckpt: Checkpoint,
                  weight_scales: dict[str, np.float32], input_scales: dict[str, np.float32],
                  *, min_sqnr_db: float = MIN_WEIGHT_SQNR_DB) -> dict[str, float]:
    """Check ``out_dir`` against the plan; return the SQNR (dB) of each module read back."""
    from safetensors import SafetensorError, safe_open

    problems: list[str] = []
    sqnr: dict[str, float] = {}
    for plan in plans:
        path = out_dir / plan.file_name
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError) as exc:
            problems.append(f"{plan.file_name}: cannot be reopened ({exc})")
            continue
        with handle as f:
            planned = {e.tensor.name: e for e in plan.entries}
            found = set(f.keys())
            missing = sorted(set(planned) - found)
            extra = sorted(found - set(planned))
            if missing or extra:
                problems.append(f"{plan.file_name}: tensors differ from the plan "
                                f"(missing {missing[:3]}, unexpected {extra[:3]})")
            for name, entry in planned.items():
                if name not in found:
                    continue
                sl = f.get_slice(name)
                dtype, shape = sl.get_dtype(), tuple(sl.get_shape())
                if dtype != entry.tensor.dtype or shape != entry.tensor.shape:
                    problems.append(f"{plan.file_name}: {name} is {dtype} {list(shape)}, "
                                    f"expected {entry.tensor.dtype} {list(entry.tensor.shape)}")
                    continue
                if entry.kind in ("weight_scale", "input_scale"):
                    value = float(f.get_tensor(name).reshape(-1)[0])
                    want = float((weight_scales if entry.kind == "weight_scale"
                                  else input_scales)[entry.source])
                    if not (math.isfinite(value) and value > 0.0):
                        problems.append(f"{plan.file_name}: {name} = {value} is not a finite "
                                        "positive scale")
                    elif value != want:
                        problems.append(f"{plan.file_name}: {name} = {value!r} but {want!r} "
                                        "was computed")
                elif entry.kind == "weight":
                    module = name[: -len(".weight")]
                    scale_name = f"{module}.weight_scale"
                    if scale_name not in found:
                        continue
                    scale = float(f.get_tensor(scale_name).reshape(-1)[0])
                    if not (math.isfinite(scale) and scale > 0.0):
                        continue  # reported with the scale itself
                    value = roundtrip_sqnr(ckpt.load(entry.source), f.get_tensor(name), scale)
                    sqnr[module] = value
                    if not value >= min_sqnr_db:
                        problems.append(
                            f"{name}: the FP8 weight read back from {plan.file_name} has SQNR "
                            f"{value:.1f} dB against the source (minimum {min_sqnr_db:.0f} dB)")
    index = out_dir / INDEX_NAME
    if len(plans) > 1:
        problems.extend(_check_index(index, plans))
    elif index.exists():
        problems.append(f"{INDEX_NAME}: present, but the output has a single shard")
    if problems:
        shown = "; ".join(problems[:_MAX_LISTED])
        more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        raise Fp8ExportError(
            f"read-back verification of the FP8 output failed, so nothing was written: {shown}"
            f"{more}. A weight with low SQNR has outliers FP8 cannot hold per-tensor: leave it "
            "in high precision with --exclude (or, for a q/k/v or gate/up member whose siblings "
            "are much larger, give it its own scale with --no-fuse-scales); any other failure "
            "is a bug or a failing disk.")
    return sqnr


def _check_index(index: Path, plans: list[ShardPlan]) -> list[str]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{INDEX_NAME}: unreadable ({exc})"]
    want = {e.tensor.name: p.file_name for p in plans for e in p.entries}
    if weight_map != want:
        wrong = sorted(k for k in set(want) | set(weight_map) if weight_map.get(k) != want.get(k))
        return [f"{INDEX_NAME}: weight_map disagrees with the shards for {wrong[:3]}"]
    return []
