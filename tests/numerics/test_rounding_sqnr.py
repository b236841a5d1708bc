"""``rounding_sqnr_db``, the level report plots mark as "what E4M3 rounding itself gives",
against measured round trips."""

import math

import pytest
import torch

from fp8export.numerics.fp8 import fake_quantize_e4m3
from fp8export.numerics.metrics import E4M3_ROUND_TRIP_SQNR_DB, rounding_sqnr_db, sqnr_db


def test_formula_values():
    assert rounding_sqnr_db(3) == pytest.approx(32.53, abs=0.01)
    assert rounding_sqnr_db(7) == pytest.approx(56.62, abs=0.01)


def test_matches_rounding_of_values_spread_evenly_over_binades():
    g = torch.Generator().manual_seed(0)
    x = (1 + torch.rand(1 << 20, generator=g, dtype=torch.float64)) * 2.0 ** torch.randint(
        -4, 4, (1 << 20,), generator=g)
    bf16 = x.to(torch.bfloat16).to(torch.float64)
    assert sqnr_db(x, bf16) == pytest.approx(rounding_sqnr_db(7), abs=0.2)
    # E4M3 with a power-of-two scale keeps the binades aligned: the formula holds too
    assert sqnr_db(x, fake_quantize_e4m3(x.float(), 2.0 ** -4)) == pytest.approx(
        rounding_sqnr_db(3), abs=0.2)


@pytest.mark.parametrize("dist", ["normal", "laplace", "uniform"])
def test_smooth_distributions_land_in_the_round_trip_band(dist):
    g = torch.Generator().manual_seed(1)
    x = {"normal": lambda: torch.randn(1 << 18, generator=g),
         "laplace": lambda: torch.distributions.Laplace(0.0, 1.0).sample((1 << 18,)),
         "uniform": lambda: torch.rand(1 << 18, generator=g) * 2 - 1}[dist]()
    got = sqnr_db(x, fake_quantize_e4m3(x, float(x.abs().max()) / 448))
    lo, hi = E4M3_ROUND_TRIP_SQNR_DB
    assert lo <= got <= hi and math.isfinite(got)
