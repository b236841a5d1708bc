"""bf16 and fp16 linear layers on CPUs without 16-bit matrix units, computed in fp32.

On a CPU without AVX512-BF16 / AMX (torch's ``mkldnn._is_mkldnn_bf16_supported()`` is False:
every AVX2 machine, e.g. most CI runners), torch multiplies bf16 matrices in a generic kernel:
measured 42x slower than an fp32 GEMM of the same shape on this project's AVX2 EPYC VM, which
made a 5 M-parameter model's bf16 forward 7x slower than in fp32. What a bf16 GEMM computes is
the products of bf16 values accumulated in fp32 and rounded to bf16 once; converting the
operands to fp32 (exact), multiplying in fp32 and rounding the result is that computation (up
to the order of the sum, as between any two GEMM kernels; against the fp64 result rounded to
bf16 it matched 99.99 % of the outputs, the generic kernel 99.98 %). So on such CPUs the models
fp8export runs for numbers (the reference, calibration, the FP8 runtime's high-precision
layers) compute their 16-bit linears that way: :func:`fp32_linears`. Nothing changes on CPUs
with 16-bit units, on GPUs, or in traced graphs (ONNX export builds its own models).

``FP8EXPORT_CPU_GEMM=native`` keeps torch's own kernel (``fp32`` forces the conversion).
"""

from __future__ import annotations

import functools
import os
import weakref

_ENV = "FP8EXPORT_CPU_GEMM"


@functools.cache
def _slow(dtype_name: str) -> bool:
    import torch

    choice = os.environ.get(_ENV, "").strip().lower()
    if choice in ("native", "fp32"):
        return choice == "fp32"
    check = {"bfloat16": "_is_mkldnn_bf16_supported",
             "float16": "_is_mkldnn_fp16_supported"}[dtype_name]
    try:
        return not bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # an older or trimmed torch: leave it alone
        return False


def converts(dtype) -> bool:
    """Whether CPU linears of ``dtype`` (bf16 / fp16) run in fp32 on this machine."""
    import torch

    if dtype not in (torch.bfloat16, torch.float16):
        return False
    return _slow(str(dtype).removeprefix("torch."))


def _forward(self, x):
    import torch

    w = self.weight
    if x.device.type == "cpu" and w.dtype == x.dtype and converts(w.dtype):
        b = self.bias
        y = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        return y.to(x.dtype)
    return torch.nn.functional.linear(x, w, self.bias)


class _Fp32Forward:
    """``module.forward`` for :func:`fp32_linears`: holds its module weakly, so the module is
    freed when its last reference goes (a bound method in its own ``__dict__`` would make a
    reference cycle, leaving a streamed layer's weights on the device until the collector
    runs); a deep copy calls the copied module."""

    __slots__ = ("module",)

    def __init__(self, module):
        self.module = weakref.ref(module)

    def __call__(self, x):
        return _forward(self.module(), x)

    def __deepcopy__(self, memo):
        module = self.module()
        return _Fp32Forward(memo.get(id(module), module))


def fp32_linears(model, device="cpu"):
    """On a CPU ``device``: give every plain ``nn.Linear`` of ``model`` the forward above (it
    still decides per call, on the device and dtype it then sees); returns ``model``. Modules
    with a forward of their own (a subclass's, accelerate's offload hooks) are left alone, and
    so are models placed on a GPU (their kernels are fast, and torch.compile traces them)."""
    import torch

    if torch.device(device).type != "cpu":
        return model
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward \
                and "forward" not in vars(module) and not hasattr(module, "_hf_hook"):
            module.forward = _Fp32Forward(module)
    return model
