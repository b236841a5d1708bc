"""The fused activation quantize must be bit-identical to the eager DESIGN.md quantize."""

import pytest
import torch

from fp8export.numerics.fp8 import E4M3_MAX, quantize_e4m3
from fp8export.runners.fp8_quant import quantize_eager, quantize_input


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


@pytest.mark.gpu
def test_runtime_launch_skips_the_jit_and_stays_bit_identical():
    """After the first call of a shape class, quantize_input launches the compiled kernel
    directly (checked against the JIT once); many fresh inputs later it is still exact."""
    from fp8export.runners.fp8_quant import _launcher

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
