"""GPTQ's column loop as one Triton kernel per block: the torch loop's codes, bit for bit."""

import math

import pytest
import torch

from fp8export.numerics import gptq_kernel
from fp8export.numerics.gptq import gptq_round


def _case(rows: int, n: int, scale_kind: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, n, generator=g) * 0.05
    w[0, :7] = -0.0  # a signed zero keeps its code (0x80)
    w[1, 3] = 1.0  # an outlier: the row's scale saturates the rest
    mix = torch.randn(n, n, generator=g) / math.sqrt(n)
    x = torch.randn(4 * n, n, generator=g) @ mix
    x[:, 2] = 0.0  # an input channel no data reaches
    h = (x.T @ x).double()
    if scale_kind == "tensor":
        scale = torch.tensor(float(w.abs().max()) / 448)
    elif scale_kind == "row":
        scale = w.abs().amax(1) / 448
    else:  # a 32 x 64 block grid expanded to every element
        blocks = w.abs().reshape(rows // 32, 32, -1, 64).amax((1, 3)) / 448
        scale = blocks.repeat_interleave(32, 0).repeat_interleave(64, 1)
    return w, h, scale


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n,scale_kind", [
    (96, 320, "tensor"),  # a partial last block (320 = 2 x 128 + 64)
    (1000, 576, "row"),  # SmolLM2's width, rows not a multiple of the tile
    (64, 256, "block"),
    (3, 128, "row"),  # fewer rows than one tile
])
def test_kernel_codes_are_the_torch_loops(rows, n, scale_kind, monkeypatch):
    if torch.cuda.get_device_capability() < (8, 9) or gptq_kernel._kernel() is None:
        pytest.skip("needs Triton and a GPU with E4M3 casts (sm_89+)")
    w, h, scale = _case(rows, n, scale_kind, seed=rows + n)
    w, h, scale = w.cuda(), h.cuda(), scale.cuda()
    assert gptq_kernel.enabled(w)
    for damp in (0.01, 1.0):
        fused = gptq_round(w, h, scale, damp=damp)
        monkeypatch.setenv("FP8EXPORT_GPTQ_KERNEL", "0")
        assert not gptq_kernel.enabled(w)
        loop = gptq_round(w, h, scale, damp=damp)
        monkeypatch.delenv("FP8EXPORT_GPTQ_KERNEL")
        assert torch.equal(fused.codes.view(torch.uint8), loop.codes.view(torch.uint8))
        assert fused.error_rounded == loop.error_rounded < loop.error_nearest


def test_off_the_gpu_the_torch_loop_runs():
    w = torch.zeros(4, 4)
    assert not gptq_kernel.enabled(w)
