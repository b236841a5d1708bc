"""Error-compensating rounding of a weight to the E4M3 grid (GPTQ, on FP8's grid).

Rounding each weight to its nearest E4M3 value minimises the weight's own error, not the
layer's: what a user sees is the output ``W x`` on the inputs the model gets. With ``H = Σ x xᵀ``
over calibration inputs, the output error of a rounded weight ``Q`` is
``tr((W − Q) H (W − Q)ᵀ)``. GPTQ (Frantar et al., 2022) lowers it greedily: the columns
(input channels) are rounded one at a time, and the error each one makes is compensated by
updating the columns not yet rounded along ``H⁻¹`` — the optimal least-squares correction
(Optimal Brain Surgeon). The grid here is E4M3 with the layer's own scale (per tensor, the
fused group's shared max, or one per output row), so the result is exactly the format convert
writes: the same ``weight_scale``, other E4M3 codes.

Details as in the reference implementation: columns in order of decreasing ``H`` diagonal
(the most active inputs first), a damping of ``damp`` times the mean diagonal added to ``H``
(it keeps the inverse well conditioned and bounds the updates), lazy batched updates in blocks
of ``block`` columns, and the upper Cholesky factor of ``H⁻¹``. Input channels the data never
reached (zero diagonal) are rounded to nearest and left out of the compensation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8export.numerics.fp8 import E4M3_DTYPE, E4M3_MAX

DAMP = 0.01
BLOCK = 128


@dataclass
class RoundedWeight:
    """``codes`` (E4M3, the weight's shape) and the output error on the calibration inputs,
    ``tr(ΔW H ΔWᵀ)``, of nearest rounding and of these codes, with ``tr(W H Wᵀ)`` (the
    output's energy) to turn them into SQNRs."""

    codes: torch.Tensor
    output_energy: float
    error_nearest: float
    error_rounded: float


def _round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x on the E4M3 grid of ``scale`` (float32 arithmetic of ``quantize_e4m3``)."""
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3_DTYPE).to(torch.float32) * scale


def output_error(w: torch.Tensor, q: torch.Tensor, hessian: torch.Tensor) -> float:
    """``tr((w − q) H (w − q)ᵀ)``: the summed squared output error over the inputs of ``H``."""
    d = (w - q).to(torch.float64)
    return float(((d @ hessian.to(torch.float64)) * d).sum())


def gptq_round(w: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor | float, *,
               damp: float = DAMP, block: int = BLOCK) -> RoundedWeight:
    """E4M3 codes of ``w`` ``[out, in]`` with dequantization ``scale`` (a scalar, or one per
    output row ``[out]``) chosen to minimise the output error on inputs whose second moment is
    ``hessian`` ``[in, in]`` (``Σ x xᵀ``)."""
    if w.dim() != 2 or hessian.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"weight {tuple(w.shape)} and hessian {tuple(hessian.shape)} disagree")
    dev = w.device
    w = w.to(torch.float32)
    s = torch.as_tensor(scale, dtype=torch.float32, device=dev)
    s_col = s.reshape(-1, 1) if s.dim() else s  # broadcast over a column [out, 1]
    h = hessian.to(device=dev, dtype=torch.float64).clone()
    n = w.shape[1]
    nearest = _round(w, s_col)
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1.0  # no data reached them: no correlations, rounded to nearest
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    h = h[order][:, order]
    h.diagonal().add_(damp * float(torch.diagonal(h).mean()))
    try:
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)),
                                     upper=True).to(torch.float32)
    except RuntimeError:  # not positive definite even damped: nearest is the safe answer
        return RoundedWeight(_codes(nearest, s_col), *_errors(w, nearest, nearest, hessian))
    work = w[:, order].clone()
    out = torch.empty_like(work)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        cols = work[:, i1:i2]  # a view: updates land in ``work``
        err = torch.empty_like(cols)
        hb = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            q = _round(cols[:, i:i + 1], s_col)
            out[:, i1 + i:i1 + i + 1] = q
            e = (cols[:, i:i + 1] - q) / hb[i, i]
            cols[:, i:] -= e * hb[i:i + 1, i:]
            err[:, i:i + 1] = e
        work[:, i2:] -= err @ hinv[i1:i2, i2:]
    rounded = torch.empty_like(out)
    rounded[:, order] = out
    return RoundedWeight(_codes(rounded, s_col), *_errors(w, nearest, rounded, hessian))


def _codes(q: torch.Tensor, s_col: torch.Tensor) -> torch.Tensor:
    # q is on the grid: q / scale is the code up to float32 rounding, far from any tie
    return (q / s_col).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3_DTYPE)


def _errors(w, nearest, rounded, hessian) -> tuple[float, float, float]:
    zero = torch.zeros_like(w)
    return (output_error(w, zero, hessian), output_error(w, nearest, hessian),
            output_error(w, rounded, hessian))
