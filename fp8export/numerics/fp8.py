"""E4M3 / E5M2 numerics with one scale convention (DESIGN.md "Conventions").

``scale`` is always a *dequantization factor*: ``scale = amax / 448``,
``q = cast_rne(clamp(x / scale, -448, 448))`` and ``x ≈ q * scale``. This is the meaning of
ONNX ``QuantizeLinear``'s ``y_scale``, vLLM's and compressed-tensors' ``weight_scale`` /
``input_scale`` and ModelOpt's exports. Transformer Engine and torchao store the reciprocal;
their readers convert with :func:`multiplier_to_scale`.

The cast itself is torch's ``float8_e4m3fn`` conversion (round to nearest, ties to even); we
clamp first because a cast of an out-of-range value is not guaranteed to saturate (it may give
NaN). That clamp-then-cast rule and the amax checks are the FP8-specific logic no library
gives us.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from fp8export.errors import Fp8ExportError

if TYPE_CHECKING:  # torch is imported where a function needs it (lazily: convert's
    import torch  # default path runs without it)

E4M3_MAX = 448.0
"""Largest finite OCP float8_e4m3fn value (no infinities; 0x7F/0xFF are NaN)."""
E5M2_MAX = 57344.0
"""Largest finite float8_e5m2 value. E5M2 is read (training gradients), never written."""

_TORCH_DTYPES = {"E4M3_DTYPE": "float8_e4m3fn", "E5M2_DTYPE": "float8_e5m2"}


def __getattr__(name: str):
    # E4M3_DTYPE / E5M2_DTYPE are torch dtypes: resolved on first use, so importing this
    # module (amax checks, scales) does not import torch.
    if name in _TORCH_DTYPES:
        import torch

        return getattr(torch, _TORCH_DTYPES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_amax(amax: float, name: str) -> float:
    """Return ``amax`` as a float if it can become a scale, else raise naming the tensor.

    An amax that is zero, negative, NaN or Inf never becomes a scale (DESIGN.md).
    """
    value = float(amax)
    if not math.isfinite(value):
        raise Fp8ExportError(
            f"{name}: amax is {value}, not a finite number; the tensor or its recorded history "
            "holds NaN/Inf. Fix the source values, or exclude it with --exclude."
        )
    if value <= 0.0:
        raise Fp8ExportError(
            f"{name}: amax is {value}; a scale needs amax > 0 (an all-zero tensor or an empty "
            "history). Exclude it with --exclude, or give calibration data that reaches it."
        )
    return value


def amax_to_scale(amax: float, name: str = "tensor") -> np.float32:
    """Dequantization scale ``amax / 448`` as float32 (computed in float64, rounded once)."""
    value = check_amax(amax, name)
    scale = np.float32(value / E4M3_MAX)
    if not np.isfinite(scale) or scale <= 0:
        # amax below ~6e-43 underflows float32; no real tensor has such a range.
        raise Fp8ExportError(f"{name}: amax {value!r} gives a scale that float32 cannot hold.")
    return scale


def amax_to_scales(amax: np.ndarray, name: str = "tensor") -> np.ndarray:
    """float32 dequantization factors ``amax / 448`` of a weight's output channels (``[out]``)
    or blocks (``[gr, gc]``), each computed in float64 and rounded once. An all-zero channel or
    block has no range of its own: it takes the smallest scale of the others (any positive
    scale quantizes zeros exactly; this one keeps the scales in a range every scale dtype
    holds). Raises naming the first channel or block whose amax is not finite, and when every
    one is zero."""
    amax = np.asarray(amax, dtype=np.float64)
    unit = "output channel" if amax.ndim == 1 else "block"
    bad = ~np.isfinite(amax) | (amax < 0)
    if bad.any():
        where = tuple(int(v) for v in np.argwhere(bad)[0])
        raise Fp8ExportError(f"{name}: {unit} {where[0] if len(where) == 1 else where} has amax "
                             f"{float(amax[where])!r}; a weight with NaN/Inf cannot be "
                             "quantized. Fix the checkpoint or --exclude the module.")
    scales = (amax / E4M3_MAX).astype(np.float32)
    positive = scales > 0
    if not positive.any():
        raise Fp8ExportError(f"{name}: every {unit} is zero; nothing to scale.")
    scales[~positive] = scales[positive].min()
    return scales


def multiplier_to_scale(multiplier: float, name: str = "tensor") -> np.float32:
    """Convert a quantization multiplier (TE/torchao ``scale = 448/amax``) to our scale."""
    value = float(multiplier)
    if not math.isfinite(value) or value <= 0.0:
        raise Fp8ExportError(
            f"{name}: stored FP8 multiplier is {value}; it must be finite and > 0."
        )
    return np.float32(1.0 / value)


def tensor_amax(x: torch.Tensor) -> float:
    """max(|x|) of a tensor in float32, as a Python float (NaN if x holds NaN)."""
    if x.numel() == 0:
        return 0.0
    return float(x.detach().float().abs().max())


def quantize_e4m3(x: torch.Tensor, scale: float | np.floating | torch.Tensor) -> torch.Tensor:
    """Quantize ``x`` to float8_e4m3fn with dequantization factor ``scale``.

    Computes ``x / scale`` in float32 (as ONNX QuantizeLinear does), clamps to ±448 and casts
    with round-to-nearest-even. Returns a ``torch.float8_e4m3fn`` tensor of x's shape.
    """
    import torch

    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    y = x.to(torch.float32) / s
    return y.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(q: torch.Tensor, scale: float | np.floating | torch.Tensor,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q * scale`` in float32, returned as ``dtype`` (default float32). Accepts E4M3 or E5M2
    input."""
    import torch

    s = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    return (q.to(torch.float32) * s).to(dtype or torch.float32)


def fake_quantize_e4m3(x: torch.Tensor, scale: float | np.floating | torch.Tensor) -> torch.Tensor:
    """Quantize then dequantize, returning x's dtype: the exact FP8 round trip, emulated."""
    return dequantize(quantize_e4m3(x, scale), scale, dtype=x.dtype)
