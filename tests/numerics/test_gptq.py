"""GPTQ on the E4M3 grid: same format (codes under the given scale), lower output error."""

import math

import pytest
import torch

from fp8export.numerics.fp8 import E4M3_DTYPE, quantize_e4m3
from fp8export.numerics.gptq import gptq_round, output_error


def _data(out=48, inp=64, tokens=512, seed=0, held_out=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    # real activations: correlated, a few directions carry most of the energy
    mix = torch.randn(inp, inp, generator=g) / math.sqrt(inp)
    outlier = torch.randn(1, inp, generator=g)
    n = tokens + held_out
    x = torch.randn(n, inp, generator=g) @ mix + 3.0 * torch.randn(n, 1, generator=g) * outlier
    x, rest = x[:tokens], x[tokens:]
    return (w, x, (x.T @ x).double(), rest) if held_out else (w, x, (x.T @ x).double())


def test_codes_are_e4m3_under_the_given_scale_and_lower_the_output_error():
    w, x, h, x2 = _data(held_out=4096)
    scale = torch.tensor(float(w.abs().max()) / 448)
    r = gptq_round(w, h, scale)
    assert r.codes.dtype == E4M3_DTYPE and r.codes.shape == w.shape
    nearest = quantize_e4m3(w, scale).float() * scale
    q = r.codes.float() * scale
    assert output_error(w, nearest, h) == pytest.approx(r.error_nearest, rel=1e-9)
    assert output_error(w, q, h) == pytest.approx(r.error_rounded, rel=1e-9)
    gain_db = 10 * math.log10(r.error_nearest / r.error_rounded)
    assert gain_db > 6.0  # measured 11.9 dB here
    # on held-out inputs of the same distribution the gain holds (not an overfit to H)
    held_near = float(((x2 @ (w - nearest).T) ** 2).sum())
    held_gptq = float(((x2 @ (w - q).T) ** 2).sum())
    assert 10 * math.log10(held_near / held_gptq) > 6.0  # measured 11.1 dB
    # the codes requantize to themselves: convert writes exactly these bytes
    assert torch.equal(quantize_e4m3(q, scale).view(torch.uint8), r.codes.view(torch.uint8))


def test_uncorrelated_inputs_give_nearest_rounding():
    """With H diagonal there is nothing to compensate along: GPTQ is round-to-nearest."""
    w, _, _ = _data()
    h = torch.diag(torch.rand(w.shape[1], generator=torch.Generator().manual_seed(1)) + 0.5)
    scale = torch.tensor(float(w.abs().max()) / 448)
    r = gptq_round(w, h.double(), scale)
    assert torch.equal(r.codes.view(torch.uint8), quantize_e4m3(w, scale).view(torch.uint8))


def test_per_channel_scales_and_dead_inputs():
    w, x, h = _data(out=16, inp=32)
    x[:, 5] = 0.0  # an input channel the data never reaches
    h = (x.T @ x).double()
    scale = w.abs().amax(1) / 448
    r = gptq_round(w, h, scale)
    q = r.codes.float() * scale[:, None]
    assert r.error_rounded < r.error_nearest
    # the dead channel is rounded to nearest and its weight is not moved by compensation
    nearest = quantize_e4m3(w, scale[:, None]).float() * scale[:, None]
    assert torch.equal(q[:, 5], nearest[:, 5])


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="disagree"):
        gptq_round(torch.zeros(4, 8), torch.eye(4, dtype=torch.float64), 1.0)


@pytest.mark.gpu
def test_cuda_rounding_matches_cpu():
    """convert runs GPTQ on the GPU when there is one: the same codes as on the CPU, up to
    the few columns where float32 rounding of the compensation tips a value across a tie."""
    w, _, h = _data(out=256, inp=512, tokens=2048)
    scale = torch.tensor(float(w.abs().max()) / 448)
    cpu = gptq_round(w, h, scale)
    gpu = gptq_round(w.cuda(), h.cuda(), scale.cuda())
    assert gpu.codes.device.type == "cuda"
    same = (cpu.codes.view(torch.uint8) == gpu.codes.cpu().view(torch.uint8)).float().mean()
    assert float(same) > 0.99
    assert gpu.error_rounded == pytest.approx(cpu.error_rounded, rel=0.02)
    assert gpu.error_rounded < 0.5 * gpu.error_nearest


def test_checked_rounding_is_never_worse_than_nearest_on_held_out_inputs():
    """Fewer tokens than inputs: GPTQ fits H's null space and comes out worse than nearest
    on other inputs of the same kind; round_checked measures each candidate on held-out
    tokens and so is never worse than nearest there (nor, here, on fresh inputs)."""
    from fp8export.numerics.gptq import round_checked

    worse = 0
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(32, 96, generator=g) * 0.05
        # channels of very different energy (as real activations have), 24 tokens < 96 inputs
        x = torch.randn(24 + 24 + 4096, 96, generator=g) * torch.exp(torch.randn(96,
                                                                                 generator=g))
        h = (x[:24].T @ x[:24]).double()
        hv = (x[24:48].T @ x[24:48]).double()  # the held-out calibration tokens
        fresh = x[48:]
        scale = torch.tensor(float(w.abs().max()) / 448)
        nearest = quantize_e4m3(w, scale).float() * scale

        def err(q):
            return float(((fresh @ (w - q).T) ** 2).sum())

        plain = gptq_round(w, h, scale).codes.float() * scale
        worse += err(plain) > err(nearest)
        r = round_checked(w, h, scale, hv, tokens=24)
        assert r.held_out_chosen <= r.held_out_nearest
        assert err(r.codes.float() * scale) <= err(nearest) * 1.02, seed
    assert worse >= 3  # plain GPTQ overfits in this regime: the check is what saves it


def test_without_held_out_tokens_too_few_tokens_round_to_nearest():
    from fp8export.numerics.gptq import round_checked

    w, _, h = _data(out=8, inp=32, tokens=16)
    scale = torch.tensor(float(w.abs().max()) / 448)
    r = round_checked(w, h, scale, None, tokens=16)
    assert r.method == "nearest" and "16 calibration tokens < 32 inputs" in r.reason
    assert torch.equal(r.codes.view(torch.uint8), quantize_e4m3(w, scale).view(torch.uint8))
    assert round_checked(w, h, scale, None, tokens=32).method == "gptq"


def test_block_scales_round_on_their_own_grid():
    """A scale per element (a block grid expanded): codes under each element's own scale."""
    from fp8export.numerics.block import expand_blocks

    w, _, h = _data(out=32, inp=64)
    grid = torch.rand(2, 4, generator=torch.Generator().manual_seed(3)) * 1e-4 + \
        float(w.abs().max()) / 448
    full = expand_blocks(grid, (32, 64), (16, 16))
    r = gptq_round(w, h, full)
    q = r.codes.float() * full
    assert torch.equal(quantize_e4m3(q / full, 1.0).view(torch.uint8),
                       r.codes.view(torch.uint8))
    assert r.error_rounded < r.error_nearest
