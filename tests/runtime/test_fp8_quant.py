"""The fused activation quantize must be bit-identical to the eager DESIGN.md quantize."""

import pytest
import torch

from fp8export.numerics.fp8 import E4M3_MAX, quantize_e4m3
from fp8export.runtime.fp8_quant import quantize_eager, quantize_input


def _edge_values(device):
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[:-1] + grid[1:]) / 2
    extra = torch.tensor([1e9, -1e9, 449.0, -449.0, 0.0, -0.0, 1e-12])
    above = torch.nextafter(mids, torch.full_like(mids, 1e9))
    return torch.cat([grid, mids, above, extra]).to(device)


def test_eager_path_matches_numerics_module():
    x = torch.randn(64, 48) * 7
    s = torch.tensor(0.013)
    want = quantize_e4m3(x, s).view(torch.uint8)
    assert torch.equal(quantize_eager(x, s).view(torch.uint8), want)
    # on CPU quantize_input is the eager path
    assert torch.equal(quantize_input(x, s).view(torch.uint8), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_is_bit_identical_on_gpu(dtype):
    torch.manual_seed(0)
    for shape in [(1, 16), (7, 2048), (300, 8192)]:
        x = (torch.randn(shape, device="cuda") * 3).to(dtype)
        s = torch.tensor(float(x.float().abs().max()) / E4M3_MAX, device="cuda")
        a = quantize_input(x, s).view(torch.uint8)
        b = quantize_e4m3(x, s).view(torch.uint8)
        assert torch.equal(a, b), (shape, (a != b).sum().item())
    edges = _edge_values("cuda").to(dtype)
    one = torch.tensor(1.0, device="cuda")
    assert torch.equal(quantize_input(edges, one).view(torch.uint8),
                       quantize_e4m3(edges, one).view(torch.uint8))
    # a scale that makes the division inexact, inputs whose quotient lands within an ulp or
    # two of a rounding midpoint: an approximate division (Triton's plain ``/``) rounds some
    # of them the other way
    s = torch.tensor(0.3, device="cuda")
    near = _edge_values("cuda")[:-7] * s
    near = torch.cat([near, torch.nextafter(near, near * 2), torch.nextafter(near, near / 2)])
    near = near.to(dtype)
    assert torch.equal(quantize_input(near, s).view(torch.uint8),
                       quantize_e4m3(near, s).view(torch.uint8))


@pytest.mark.gpu
def test_runtime_launch_skips_the_jit_and_stays_bit_identical():
    """After the first call of a shape class, quantize_input launches the compiled kernel
    directly (checked against the JIT once); many fresh inputs later it is still exact."""
    from fp8export.runtime.fp8_quant import _launcher

    torch.manual_seed(1)
    s = torch.tensor(0.02, device="cuda")
    for i in range(20):
        x = torch.randn(3 + 16 * i, 512, device="cuda", dtype=torch.bfloat16) * 4
        assert torch.equal(quantize_input(x, s).view(torch.uint8),
                           quantize_e4m3(x, s).view(torch.uint8))
    assert _launcher().direct and _launcher().compiled, "fell back to the JIT launch path"
    # inside a CUDA graph the direct launch goes to the capturing stream: same bits on replay
    x = torch.randn(35, 512, device="cuda", dtype=torch.bfloat16) * 4
    quantize_input(x, s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = quantize_input(x, s)
    x.mul_(-0.5)
    graph.replay()
    assert torch.equal(captured.view(torch.uint8), quantize_e4m3(x, s).view(torch.uint8))


# ------------------------------------------------------------------ the launcher, on CPU
# Launcher's own logic (keys, adoption checked against the JIT, fallback) needs no GPU: here it
# drives a CPU kernel behind Triton's launch interface (``kernel[grid](...)``, ``warmup``,
# ``compiled[grid](...)``) that computes the eager quantize, so the bytes compared are real.
class _CpuKernel:
    """``compiled_extra``: whether the compiled entry takes the constexprs after the
    arguments (Triton versions differ); ``compiled_scale``: the scale factor the compiled entry
    applies (2.0: a direct launch that binds the wrong scale)."""

    def __init__(self, compiled_extra=True, compiled_scale=1.0, warmup_error=None):
        self.compiled_extra, self.compiled_scale = compiled_extra, compiled_scale
        self.warmup_error = warmup_error
        self.jit_calls = self.direct_calls = self.warmups = 0

    def __getitem__(self, grid):
        def jit(x, scale, out, n, BLOCK, **options):
            self.jit_calls += 1
            out.copy_(quantize_eager(x, scale))
        return jit

    def warmup(self, *args, grid, **kwargs):
        self.warmups += 1
        if self.warmup_error:
            raise self.warmup_error
        return _Compiled(self)


class _Compiled:
    def __init__(self, kernel: _CpuKernel):
        self.kernel = kernel

    def __getitem__(self, grid3):
        assert len(grid3) == 3
        k = self.kernel

        def direct(*args):
            if len(args) != (5 if k.compiled_extra else 4):
                raise TypeError(f"takes {5 if k.compiled_extra else 4} positional arguments")
            x, scale, out = args[:3]
            k.direct_calls += 1
            out.copy_(quantize_eager(x, scale * k.compiled_scale))
        return direct


def _launch(launcher, x, scale):
    out = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    launcher(((x.numel() + 2047) // 2048,), (x, scale, out, x.numel()), {"BLOCK": 2048})
    return out


@pytest.fixture()
def cpu_launcher(monkeypatch):
    from fp8export.runtime.fp8_quant import Launcher

    # CPU-only torch builds raise from the capture query; nothing is being captured here
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return lambda kernel: Launcher(kernel, out_arg=2)


@pytest.mark.parametrize("compiled_extra", [True, False])
def test_launcher_adopts_a_direct_launch_that_matches_the_jit(cpu_launcher, compiled_extra):
    kernel = _CpuKernel(compiled_extra=compiled_extra)
    launcher = cpu_launcher(kernel)
    s = torch.tensor(0.02)
    for i in range(4):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(i)) * 4
        assert torch.equal(_launch(launcher, x, s).view(torch.uint8),
                           quantize_e4m3(x, s).view(torch.uint8))
    # one JIT launch for the shape class, checked against the direct entry, then direct only
    assert kernel.jit_calls == 1 and kernel.warmups == 1 and kernel.direct_calls == 4
    assert launcher.direct and len(launcher.compiled) == 1 and launcher.error is None
    # another specialization (an element count not divisible by 16) is a new key: JIT again
    x = torch.randn(7, 3) * 4
    assert torch.equal(_launch(launcher, x, s).view(torch.uint8),
                       quantize_e4m3(x, s).view(torch.uint8))
    assert kernel.jit_calls == 2 and len(launcher.compiled) == 2


def test_launcher_refuses_a_direct_launch_that_differs(cpu_launcher):
    kernel = _CpuKernel(compiled_scale=2.0)  # binds the scale wrong: different codes
    launcher = cpu_launcher(kernel)
    s = torch.tensor(0.02)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 4
    want = quantize_e4m3(x, s).view(torch.uint8)
    assert torch.equal(_launch(launcher, x, s).view(torch.uint8), want)  # the JIT's bytes
    assert not launcher.direct and not launcher.compiled
    # both entry variants tried: one differs, the other does not take the constexprs
    assert launcher.error.split("; ")[0] == "output differs"
    assert "TypeError" in launcher.error and launcher.error.count("output differs") == 1
    assert torch.equal(_launch(launcher, x, s).view(torch.uint8), want)
    assert kernel.jit_calls == 2 and kernel.warmups == 1


def test_launcher_keeps_the_jit_when_warmup_fails(cpu_launcher):
    kernel = _CpuKernel(warmup_error=AttributeError("no warmup in this Triton"))
    launcher = cpu_launcher(kernel)
    x, s = torch.randn(16, 16) * 4, torch.tensor(0.02)
    assert torch.equal(_launch(launcher, x, s).view(torch.uint8),
                       quantize_e4m3(x, s).view(torch.uint8))
    assert not launcher.direct and launcher.error.startswith("warmup: AttributeError")


def test_launcher_adopts_nothing_while_capturing_or_when_disabled(cpu_launcher, monkeypatch):
    kernel = _CpuKernel()
    launcher = cpu_launcher(kernel)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x, s = torch.randn(16, 16) * 4, torch.tensor(0.02)
    _launch(launcher, x, s)
    assert kernel.warmups == 0 and not launcher.compiled  # the check would sync the capture
    monkeypatch.setenv("FP8EXPORT_DIRECT_LAUNCH", "0")
    off = cpu_launcher(_CpuKernel())
    assert not off.direct
    _launch(off, x, s)
    _launch(off, x, s)
    assert off.kernel.jit_calls == 2 and off.kernel.warmups == 0


def test_quantize_input_on_cpu_is_the_eager_path_for_any_layout():
    from fp8export.runtime.fp8_quant import triton_cdiv

    x = (torch.randn(32, 48) * 7).t()  # not contiguous
    s = torch.tensor(0.013)
    assert torch.equal(quantize_input(x, s).view(torch.uint8),
                       quantize_e4m3(x, s).view(torch.uint8))
    assert [triton_cdiv(n, 2048) for n in (1, 2048, 2049)] == [1, 1, 2]
