"""``Fp8Linear``: a linear layer whose weight stays in E4M3, with per-tensor scales (or per
output channel, and per-token dynamic inputs; or per ``bn x bk`` block with inputs quantized per
token group, the DeepSeek-V3 format).

Two execution paths compute the same function (DESIGN.md "Conventions": scale = amax / 448):

* **scaled_mm** (CUDA, compute capability >= 8.9): the input is quantized to E4M3 with the
  static ``input_scale`` (or a dynamic per-tensor ``amax / 448`` when the folder has none) and
  multiplied with the E4M3 weight by ``torch._scaled_mm`` (fp32 accumulation, bf16 output).
* **emulate** (everywhere): the same quantize step as a fake-quantize, the weight dequantized
  to float32, the matmul in float32, the result cast to the layer's output dtype. This is the
  function the ONNX Q/DQ graph computes (QuantizeLinear → DequantizeLinear → MatMul).

The GEMM itself (``torch._scaled_mm``, or a Triton kernel for a few rows) is in
``fp8_gemm.py``. K and N must be multiples of 16: a layer that is not falls back to emulation
and says so in ``fallback_reason``. Projections that share one input and one pair of scales
(q/k/v, gate/up) run as one GEMM: ``fp8_fused.py``. Block-scaled layers run
``fp8_block.block_matmul`` on the GPU (cuBLAS block-wise ``torch._scaled_mm`` where it runs,
else a Triton kernel); weight-only layers (``dynamic="none"``) multiply the input, unquantized,
with the dequantized weight.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from fp8export.numerics.block import expand_blocks, fake_quantize_groups, grid_shape
from fp8export.numerics.fp8 import E4M3_DTYPE, E4M3_MAX, quantize_e4m3
from fp8export.runtime.fp8_gemm import fp8_matmul, rowwise_matmul

MODES = ("auto", "emulate", "scaled_mm")


def scaled_mm_available(device: torch.device | str | None = None) -> bool:
    """True when ``torch._scaled_mm`` can run E4M3 GEMMs on ``device`` (CUDA, CC >= 8.9)."""
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return False
    return _cuda_fp8_ok(dev.index if dev.index is not None else -1)


@functools.cache
def _cuda_fp8_ok(index: int) -> bool:  # cached: forward() asks on every call
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    dev = torch.device("cuda", index if index >= 0 else torch.cuda.current_device())
    return torch.cuda.get_device_capability(dev) >= (8, 9)


def dynamic_scale(x: torch.Tensor, per_token: bool = False) -> torch.Tensor:
    """Dequantization scale ``amax / 448`` of ``x`` as float32: a scalar tensor, or with
    ``per_token`` one per row (amax over the last dimension, shape ``[..., 1]``).

    An all-zero input (row) gets scale 1 (any scale quantizes zeros exactly), never 0.
    """
    a = x.detach().abs()
    amax = (a.amax(dim=-1, keepdim=True) if per_token else a.amax()).to(torch.float32)
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


DYNAMIC = ("tensor", "token", "group", "none")


class Fp8Linear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` stored as E4M3 ``[out, in]`` and float32 per-tensor scales.

    Args:
        weight: E4M3 tensor ``[out_features, in_features]``.
        weight_scale: dequantization factor of the weight (float or 1-element tensor).
        input_scale: static dequantization factor of the input, or None (dynamic).
        bias: optional ``[out_features]`` tensor in high precision.
        mode: "auto" (scaled_mm where available, else emulate), "emulate" or "scaled_mm".
        out_dtype: dtype of the output (and of the bias); bf16 by default.
        dynamic: without ``input_scale``, one input scale per "tensor", per "token" (row), per
            token and "group" of ``group_size`` input elements, or "none" (weight-only: the
            input is not quantized).
        block: ``(bn, bk)`` when ``weight_scale`` is a block grid ``[ceil(out/bn),
            ceil(in/bk)]``.

    ``weight_scale`` may hold one value per output channel (``[out]`` or ``[out, 1]``). Such a
    layer, or a per-token one, runs ``torch._scaled_mm`` with row-wise scales on the GPU.
    """

    def __init__(self, weight: torch.Tensor, weight_scale, input_scale=None, bias=None,
                 mode: str = "auto", out_dtype: torch.dtype = torch.bfloat16,
                 dynamic: str = "tensor", block: tuple[int, int] | None = None,
                 group_size: int | None = None):
        super().__init__()
        if weight.dtype != E4M3_DTYPE or weight.dim() != 2:
            raise ValueError(f"Fp8Linear needs a 2-D float8_e4m3fn weight, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
        if dynamic not in DYNAMIC:
            raise ValueError(f"dynamic must be one of {DYNAMIC}, got {dynamic!r}")
        if dynamic == "group" and not (group_size and group_size > 0):
            raise ValueError("dynamic='group' needs a positive group_size")
        self.out_features, self.in_features = weight.shape
        self.block = tuple(block) if block is not None else None
        self.group_size = group_size if dynamic == "group" else None
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", _weight_scale(weight_scale, self.out_features)
                             if self.block is None else _grid(weight_scale, weight.shape,
                                                              self.block))
        self.register_buffer("input_scale", None if input_scale is None else _scalar(input_scale))
        self.register_buffer("bias", None if bias is None else bias.detach().to(out_dtype))
        self.mode = mode
        self.out_dtype = out_dtype
        self.dynamic = dynamic
        self.fallback_reason: str | None = None
        if self.block is not None or dynamic in ("group", "none"):
            from fp8export.runtime.fp8_block import block_fallback_reason

            self.fallback_reason = block_fallback_reason(self)
        elif self.in_features % 16 or self.out_features % 16:
            self.fallback_reason = (f"in/out features {self.in_features}x{self.out_features} "
                                    "are not multiples of 16 (torch._scaled_mm needs that)")
        self._refresh()

    # -- the eager fast path ------------------------------------------------------------------
    # Eager decode and short prefill are bound by host time per layer, so the GPU forward reads
    # plain attributes prepared here (buffers live behind nn.Module.__getattr__) and checks the
    # device once per move, not per call. Kept current by _apply (.to/.cuda/.half) and
    # __setattr__ (a buffer replaced by assignment); in-place updates keep the same tensors.
    _BUFFERS = ("weight", "weight_scale", "input_scale", "bias")

    def _refresh(self) -> None:
        fast = None
        w = self._buffers.get("weight")
        if (w is not None and w.is_cuda and self.mode != "emulate" and self.per_tensor
                and self.fallback_reason is None and scaled_mm_available(w.device)):
            b = self._buffers
            fast = (w, w.t(), b["weight_scale"], b["input_scale"], b["bias"])
        self.__dict__["_fast"] = fast

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._refresh()
        return out

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in self._BUFFERS and "_fast" in self.__dict__:
            self._refresh()

    @property
    def rowwise(self) -> bool:
        """Scales per output channel or per token (not one pair of scalars)."""
        ws = self._buffers.get("weight_scale")
        return self.block is None and ((ws is not None and ws.dim() > 0) or (
            self._buffers.get("input_scale") is None and self.dynamic == "token"))

    @property
    def per_tensor(self) -> bool:
        """One pair of scalars: a per-tensor weight scale and a per-tensor input scale."""
        return not self.rowwise and self.block is None and (
            self._buffers.get("input_scale") is not None or self.dynamic == "tensor")

    def extra_repr(self) -> str:
        act = "static" if self.input_scale is not None else f"dynamic per {self.dynamic}"
        if self.group_size:
            act += f"({self.group_size})"
        if self.block is not None:
            act += f", weight per {self.block[0]}x{self.block[1]} block"
        elif self.weight_scale.dim():
            act += ", weight per channel"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, input={act}, mode={self.mode}")

    # -- paths --------------------------------------------------------------------------------
    def uses_scaled_mm(self, device: torch.device) -> bool:
        """Whether a forward on ``device`` takes the real FP8 GEMM path."""
        if self.mode == "emulate" or self.fallback_reason is not None:
            return False
        ok = scaled_mm_available(device)
        if self.mode == "scaled_mm" and not ok:
            raise RuntimeError("Fp8Linear mode='scaled_mm' needs a CUDA GPU with compute "
                               "capability >= 8.9 (Ada, Hopper or newer)")
        return ok

    def input_scale_for(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            return self.input_scale
        return dynamic_scale(x, per_token=self.dynamic == "token")

    def weight_scale_rows(self) -> torch.Tensor:
        """The weight scale broadcastable against ``weight`` ``[out, in]`` (a block grid
        expanded over its tiles)."""
        ws = self.weight_scale
        if self.block is not None:
            return expand_blocks(ws, (self.out_features, self.in_features), self.block)
        return ws[:, None] if ws.dim() else ws

    def fake_quantized_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the FP8 GEMM sees it, dequantized to float32."""
        if self.input_scale is None and self.dynamic == "group":
            return fake_quantize_groups(x, self.group_size)
        if self.input_scale is None and self.dynamic == "none":
            return x.to(torch.float32)
        s_in = self.input_scale_for(x)
        return quantize_e4m3(x, s_in).to(torch.float32) * s_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = self._fast
        if fast is not None and x.is_cuda:
            w, wt, ws, s_in, bias = fast
            if s_in is None:
                s_in = dynamic_scale(x)
            y = fp8_matmul(x.reshape(-1, self.in_features), w, s_in, ws, bias, self.out_dtype,
                           weight_t=wt)
            return y.view(*x.shape[:-1], self.out_features)
        if self.uses_scaled_mm(x.device):
            return self.forward_scaled_mm(x)
        return self.forward_emulated(x)

    def forward_emulated(self, x: torch.Tensor) -> torch.Tensor:
        """Exact emulation: fake-quantize x, dequantize W, fp32 matmul, cast the result."""
        xq = self.fake_quantized_input(x)
        w = self.weight.to(torch.float32) * self.weight_scale_rows()
        y = torch.nn.functional.linear(xq, w)
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(self.out_dtype)

    def forward_scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """Real FP8 GEMM (fp32 accumulate, ``out_dtype`` result): ``fp8_gemm.fp8_matmul``."""
        x2 = x.reshape(-1, self.in_features)
        if self.block is not None or (self.input_scale is None and self.dynamic in ("group",
                                                                                     "none")):
            from fp8export.runtime.fp8_block import block_forward

            return block_forward(self, x2).view(*x.shape[:-1], self.out_features)
        s_in = self.input_scale_for(x2)
        if self.rowwise:
            y = rowwise_matmul(x2, self.weight, s_in, self.weight_scale, self.bias,
                               self.out_dtype)
        else:
            y = fp8_matmul(x2, self.weight, s_in, self.weight_scale, self.bias, self.out_dtype)
        return y.view(*x.shape[:-1], self.out_features)


def _weight_scale(value, out_features: int) -> torch.Tensor:
    """A 0-d scale, or ``[out]`` per-channel scales (from ``[out]`` or ``[out, 1]``)."""
    t = torch.as_tensor(value, dtype=torch.float32).detach().reshape(-1)
    if t.numel() == out_features and out_features > 1:
        return t.clone()
    return _scalar(t)


def _grid(value, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """A block scale grid ``[ceil(out/bn), ceil(in/bk)]`` as float32."""
    t = torch.as_tensor(value, dtype=torch.float32).detach()
    want = grid_shape(tuple(shape), block)
    if tuple(t.shape) != want:
        raise ValueError(f"block scale grid must be {want} for a {tuple(shape)} weight in blocks "
                         f"of {block}, got {tuple(t.shape)}")
    return t.clone()


def _scalar(value) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float32).detach().reshape(-1)
    if t.numel() != 1:
        raise ValueError(f"per-tensor scale must have one element, got shape {tuple(t.shape)}")
    return t.reshape(()).clone()
