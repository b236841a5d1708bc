"""Accuracy metrics shared by convert (weight round trip), calibration and verify."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by the functions that take tensors, not by this module:
    import torch  # sqnr_from_sums serves the torch-free convert path


def sqnr_db(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10·log10(Σref² / Σ(ref−test)²)``.

    Computed in float64. Returns ``inf`` when the two are identical, and ``-inf`` when the
    reference is all zeros but the test is not.
    """
    import torch

    ref = reference.detach().to(torch.float64).flatten()
    err = ref - test.detach().to(torch.float64).flatten()
    noise = float(torch.dot(err, err))
    return sqnr_from_sums(float(torch.dot(ref, ref)), noise)


def sqnr_from_sums(signal: float, noise: float) -> float:
    """SQNR in dB from ``Σref²`` and ``Σ(ref−test)²`` (accumulated by the caller, e.g. in chunks):
    ``inf`` for no noise, ``-inf`` for noise on an all-zero signal."""
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def cosine(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors, in float64 (1.0 for two zero tensors)."""
    import torch

    a = reference.detach().to(torch.float64).flatten()
    b = test.detach().to(torch.float64).flatten()
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(torch.dot(a, b)) / (na * nb)


def rel_l2(reference: torch.Tensor, test: torch.Tensor) -> float:
    """``‖ref − test‖₂ / ‖ref‖₂`` in float64 (inf if ref is zero and test is not)."""
    import torch

    a = reference.detach().to(torch.float64).flatten()
    b = test.detach().to(torch.float64).flatten()
    num, den = float((a - b).norm()), float(a.norm())
    if num == 0.0:
        return 0.0
    return num / den if den else math.inf


def rounding_sqnr_db(mantissa_bits: int) -> float:
    """SQNR of round-to-nearest into a float format with ``mantissa_bits`` explicit bits.

    For values spread evenly within each binade [2^e, 2^(e+1)): the step is 2^(e-m), the noise
    power step²/12 and the mean square (7/3)·4^e, so SQNR = 10·log10(28·4^m): 32.5 dB for
    E4M3 (m = 3), 56.6 dB for bf16 (m = 7). Smooth distributions land lower: see
    :data:`E4M3_ROUND_TRIP_SQNR_DB`.
    """
    return 10.0 * math.log10(28.0 * 4.0 ** mantissa_bits)


# The SQNR a per-tensor E4M3 round trip of well-scaled data gives: from rounding_sqnr_db(3)
# (values even within binades) down to what smooth distributions give, measured: Gaussian
# 31.51, Laplace 31.51, Student-t(3) 31.52, uniform 31.86 dB; the sample LM's 42 weights
# 31.47-31.64 dB. Where both operands of a product are rounded the noises add (3 dB less).
E4M3_ROUND_TRIP_SQNR_DB = (31.4, rounding_sqnr_db(3))
