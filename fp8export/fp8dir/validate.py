"""What an FP8 folder must satisfy before anything runs it: pure checks on its parts.

An FP8 folder is an input too: someone can drop a layer from the manifest (its E4M3 codes would
then be used as if they were weights), point a layer at another layer's weight, leave a stray
``input_scale`` of 1e-30 beside a layer, store a scale as BOOL (read as 1.0) or as 3e38, store a
tensor as E5M2, or strip ``quantization_config`` from config.json (engines load by config.json,
fp8export by the manifest). Every consumer must refuse such a folder the same way, so the
checks live here, on plain data, for the one reader to run (:func:`validate_folder`):

* **every FP8 tensor is a listed layer's weight**, of E4M3, 2-D, named ``<layer>.weight``, used
  by one layer only; every listed layer has its weight and its weight scale under the one name
  its format's engines read (``weight_scale``, or ``weight_scale_inv`` for block scales of the
  vllm dialect), and no second one under the other name;
* **scales**: a float dtype (F32/F16/BF16, or F8_E8M0 for UE8M0 block scales), finite, > 0
  and within :data:`MIN_SCALE` ..
  :data:`MAX_SCALE` (a scale is amax/448; no real tensor is that small or large), equal to the
  manifest's value where it records one; an ``input_scale`` exactly where the manifest says the
  layer's activations are static;
* **config.json and the manifest agree**: the ``quantization_config`` that engines load is the
  one the manifest recorded.

Each check raises :class:`~fp8export.errors.Fp8ExportError` naming the folder, the layer or
tensor and the rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fp8export.errors import Fp8ExportError

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
SCALE_DTYPES = ("F32", "F16", "BF16", "F8_E8M0")  # E8M0: UE8M0 power-of-two block scales
MIN_SCALE = 1e-12  # amax 4.5e-10
MAX_SCALE = 1e12  # amax 4.5e14
REL_TOLERANCE = 1e-6  # a scale stored as F32 against the manifest's float64 value
_FIX = "Re-run `fp8export convert`; the folder was damaged or edited."


def _bad(folder: Path, what: str) -> Fp8ExportError:
    return Fp8ExportError(f"{folder}: {what}. {_FIX}")


def check_layers(folder: Path, quantized: Mapping[str, Any],
                 tensors: Mapping[str, tuple[str, tuple[int, ...]]],
                 scale_suffix: str = "weight_scale") -> None:
    """The manifest's layers against the stored tensors (``name -> (dtype, shape)``);
    ``scale_suffix``: the weight scale's name in the folder's format (:func:`scale_suffix`)."""
    owner: dict[str, str] = {}
    for layer, entry in quantized.items():
        entry = entry or {}
        weight = entry.get("weight", f"{layer}.weight")
        if weight != f"{layer}.weight":
            raise _bad(folder, f"layer {layer}: the manifest points it at {weight}, not its own "
                               f"{layer}.weight")
        if weight in owner:
            raise _bad(folder, f"layer {layer}: {weight} is also the weight of {owner[weight]}")
        owner[weight] = layer
        stored = tensors.get(weight)
        if stored is None:
            raise _bad(folder, f"layer {layer}: weight tensor {weight} is missing")
        dtype, shape = stored
        if dtype != "F8_E4M3" or len(shape) != 2:
            raise _bad(folder, f"layer {layer}: {weight} is {dtype} {list(shape)}, not a 2-D "
                               "F8_E4M3 tensor")
        if f"{layer}.{scale_suffix}" not in tensors:
            raise _bad(folder, f"layer {layer}: {layer}.{scale_suffix} is missing, so its FP8 "
                               "values cannot be scaled")
        other = "weight_scale" if scale_suffix == "weight_scale_inv" else "weight_scale_inv"
        if f"{layer}.{other}" in tensors:
            raise _bad(folder, f"layer {layer}: {layer}.{other} is stored beside "
                               f"{layer}.{scale_suffix}, which is the one this format's engines "
                               "read; a tool reading the other would compute another model")
        if entry.get("input_scale") is not None and f"{layer}.input_scale" not in tensors:
            raise _bad(folder, f"layer {layer}: {layer}.input_scale is missing, so its FP8 "
                               "values cannot be scaled")
        stray = f"{layer}.input_scale"
        if stray in tensors and entry.get("input_scale") is None:
            raise _bad(folder, f"layer {layer}: tensor {stray} is stored but the manifest says "
                               "the layer's activations are dynamic")
    unlisted = sorted(n for n, (dtype, _) in tensors.items()
                      if dtype in FP8_DTYPES and n not in owner)
    if unlisted:
        raise _bad(folder, f"{len(unlisted)} FP8 tensor(s) belong to no layer of the manifest "
                           f"({', '.join(unlisted[:3])}): their raw codes would be used "
                           "unscaled")


def scale_suffix(manifest: Mapping[str, Any]) -> str:
    """The weight scale's tensor suffix in a folder convert wrote: ``weight_scale``, or the
    fine-grained dialect's ``weight_scale_inv`` (block scales written with ``--format vllm``)."""
    block = manifest.get("weight_granularity") == "block"
    return "weight_scale_inv" if block and manifest.get("output_format") == "vllm" \
        else "weight_scale"


def check_scale(folder: Path, name: str, dtype: str, values: Any,
                recorded: float | None = None) -> None:
    """One scale tensor: ``dtype`` (its safetensors dtype), ``values`` (its numbers, any
    sequence or array), and the manifest's ``recorded`` value if it has one."""
    import numpy as np

    if dtype not in SCALE_DTYPES:
        raise _bad(folder, f"{name} is {dtype}; a scale is a float (F32, F16, BF16, or "
                           "F8_E8M0 power-of-two block scales)")
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if v.size == 0:
        raise _bad(folder, f"{name} is empty")
    if not np.isfinite(v).all() or (v <= 0).any():
        raise _bad(folder, f"{name} holds {v[~np.isfinite(v) | (v <= 0)][0]!r}; a scale is a "
                           "positive finite number")
    low, high = float(v.min()), float(v.max())
    if low < MIN_SCALE or high > MAX_SCALE:
        raise _bad(folder, f"{name} is {low if low < MIN_SCALE else high:g}, outside "
                           f"{MIN_SCALE:g} .. {MAX_SCALE:g} (a scale is amax/448; no real "
                           "tensor's amax is that small or large)")
    if recorded is not None and isinstance(recorded, (int, float)) and math.isfinite(recorded) \
            and not math.isclose(high, float(recorded), rel_tol=REL_TOLERANCE):
        raise _bad(folder, f"{name} is {high:.9g} but the manifest records {recorded:.9g}")


def check_config(folder: Path, config: Mapping[str, Any] | None,
                 manifest: Mapping[str, Any]) -> None:
    """config.json's ``quantization_config`` is the one the manifest recorded (what engines
    load must be what fp8export verifies). ``config`` None: the folder has no config.json (its
    source had none), so no engine loads it and the manifest alone records the config."""
    recorded = manifest.get("quantization_config")
    if recorded is None or config is None:
        return  # a manifest that records none, or a folder without config.json
    have = config.get("quantization_config")
    if have is None:
        raise _bad(folder, "config.json has no quantization_config, so engines would load the "
                           "FP8 codes as plain weights; the manifest records one")
    if have != recorded:
        keys = sorted(k for k in set(have) | set(recorded) if have.get(k) != recorded.get(k)) \
            if isinstance(have, dict) else ["(not an object)"]
        raise _bad(folder, "config.json's quantization_config differs from the one the manifest "
                           f"recorded (at {', '.join(keys[:4])}), so engines would load another "
                           "model than the one verified")


def validate_folder(folder: Path, manifest: Mapping[str, Any], config: Mapping[str, Any] | None,
                    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
                    values: Callable[[str], Any]) -> None:
    """Every check above; ``values(name)`` gives a (scale) tensor's numbers."""
    quantized = manifest.get("quantized") or {}
    suffix = scale_suffix(manifest)
    check_layers(folder, quantized, tensors, suffix)
    for layer, entry in quantized.items():
        entry = entry or {}
        for key, name in (("weight_scale", f"{layer}.{suffix}"),
                          ("input_scale", f"{layer}.input_scale")):
            if name in tensors:
                # per-channel and block: the manifest records the largest scale, compared as
                # well; a scale of another dtype is refused before its values are read
                dtype = tensors[name][0]
                check_scale(folder, name, dtype,
                            values(name) if dtype in SCALE_DTYPES else [1.0], entry.get(key))
    check_config(folder, config, manifest)
