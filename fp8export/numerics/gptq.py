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

**Never worse than nearest** (:func:`round_checked`). GPTQ fits ``H`` of the calibration
tokens; with fewer tokens than input channels ``H`` is singular and the compensation fits
directions no other input takes, so the layer can come out *worse* than nearest rounding on
other text. So the codes are chosen on held-out calibration tokens: nearest rounding and GPTQ
at a few dampings (:data:`DAMPS`; more damping pulls the updates toward nearest) are each
measured on the held-out tokens' ``H``, and the lowest output error wins (nearest on a tie;
with :data:`ENOUGH_TOKENS` tokens per input channel the first damping that beats nearest is
kept without trying the others).
Without held-out tokens a layer with fewer calibration tokens than input channels is rounded
to nearest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8export.numerics import gptq_kernel
from fp8export.numerics.fp8 import E4M3_DTYPE, E4M3_MAX

DAMP = 0.01
DAMPS = (0.01, 0.1, 1.0)  # the dampings round_checked tries
ENOUGH_TOKENS = 4  # tokens per input channel above which the first damping that wins is kept
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


def _full_scale(scale: torch.Tensor | float, shape: torch.Size, dev) -> torch.Tensor:
    """The dequantization scale of every element ``[out, in]`` (a broadcast view) from a
    scalar, one per output row ``[out]`` / ``[out, 1]``, or one per element ``[out, in]`` (a
    block grid expanded by the caller)."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=dev)
    if s.dim() == 1:
        s = s.reshape(-1, 1)
    return torch.broadcast_to(s, shape)


def gptq_round(w: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor | float, *,
               damp: float = DAMP, block: int = BLOCK) -> RoundedWeight:
    """E4M3 codes of ``w`` ``[out, in]`` with dequantization ``scale`` (a scalar, one per
    output row ``[out]``, or one per element ``[out, in]``) chosen to minimise the output error
    on inputs whose second moment is ``hessian`` ``[in, in]`` (``Σ x xᵀ``)."""
    if w.dim() != 2 or hessian.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"weight {tuple(w.shape)} and hessian {tuple(hessian.shape)} disagree")
    dev = w.device
    w = w.to(torch.float32)
    s_full = _full_scale(scale, w.shape, dev)
    h = hessian.to(device=dev, dtype=torch.float64).clone()
    n = w.shape[1]
    nearest = _round(w, s_full)
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1.0  # no data reached them: no correlations, rounded to nearest
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    h = h[order][:, order]
    h.diagonal().add_(damp * float(torch.diagonal(h).mean()))
    try:
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)),
                                     upper=True).to(torch.float32)
    except RuntimeError:  # not positive definite even damped: nearest is the safe answer
        return RoundedWeight(_codes(nearest, s_full), *_errors(w, nearest, nearest, hessian))
    work = w[:, order].contiguous()
    s_ord = s_full[:, order].contiguous()
    out = torch.empty_like(work)
    fused = gptq_kernel.enabled(work)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        cols = work[:, i1:i2]  # a view: updates land in ``work``
        err = torch.empty((w.shape[0], i2 - i1), dtype=torch.float32, device=dev)
        hb = hinv[i1:i2, i1:i2]
        if fused:  # the same arithmetic in one launch (launch-bound otherwise on a GPU)
            gptq_kernel.round_block(cols, s_ord[:, i1:i2], hb, out[:, i1:i2], err)
        else:
            for i in range(i2 - i1):
                q = _round(cols[:, i:i + 1], s_ord[:, i1 + i:i1 + i + 1])
                out[:, i1 + i:i1 + i + 1] = q
                e = (cols[:, i:i + 1] - q) / hb[i, i]
                cols[:, i:] -= e * hb[i:i + 1, i:]
                err[:, i:i + 1] = e
        work[:, i2:] -= err @ hinv[i1:i2, i2:]
    rounded = torch.empty_like(out)
    rounded[:, order] = out
    return RoundedWeight(_codes(rounded, s_full), *_errors(w, nearest, rounded, hessian))


@dataclass
class CheckedRounding:
    """The codes :func:`round_checked` chose and why: ``method`` ("gptq" or "nearest"),
    ``damp`` (GPTQ's), the output error of nearest rounding and of the chosen codes on the
    held-out tokens (``None`` without them) and on the fitted ones, and the outputs' energy on
    each (``tr(W H Wᵀ)``) for SQNRs."""

    codes: torch.Tensor
    method: str
    damp: float | None
    reason: str
    held_out_energy: float | None
    held_out_nearest: float | None
    held_out_chosen: float | None
    fit_energy: float
    fit_nearest: float
    fit_chosen: float


def round_checked(w: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor | float,
                  held_out: torch.Tensor | None, *, tokens: int = 0,
                  damps: tuple[float, ...] = DAMPS) -> CheckedRounding:
    """The E4M3 codes of ``w`` whose output error on the held-out tokens (second moment
    ``held_out``) is lowest among nearest rounding and GPTQ fitted to ``hessian`` at each of
    ``damps``: never worse than nearest there. Without held-out tokens, GPTQ at :data:`DAMP`
    when ``tokens`` (the fitted ones) reach the input width, else nearest."""
    w = w.to(torch.float32)
    s_full = _full_scale(scale, w.shape, w.device)
    nearest = _round(w, s_full)
    energy = output_error(w, torch.zeros_like(w), hessian)
    e_near = output_error(w, nearest, hessian)
    if held_out is None:
        if tokens < w.shape[1]:
            return CheckedRounding(_codes(nearest, s_full), "nearest", None,
                                   f"{tokens} calibration tokens < {w.shape[1]} inputs and no "
                                   "held-out tokens to check GPTQ on", None, None, None,
                                   energy, e_near, e_near)
        r = gptq_round(w, hessian, scale, damp=DAMP)
        return CheckedRounding(r.codes, "gptq", DAMP, "no held-out tokens", None, None, None,
                               r.output_energy, r.error_nearest, r.error_rounded)
    v_energy = output_error(w, torch.zeros_like(w), held_out)
    v_near = output_error(w, nearest, held_out)
    best = (v_near, "nearest", None, _codes(nearest, s_full), e_near)
    for i, d in enumerate(damps):
        r = gptq_round(w, hessian, scale, damp=d)
        q = r.codes.to(torch.float32) * s_full
        v = output_error(w, q, held_out)
        if v < best[0]:
            best = (v, "gptq", d, r.codes, r.error_rounded)
        if i == 0 and best[1] == "gptq" and tokens >= ENOUGH_TOKENS * w.shape[1]:
            break  # plenty of tokens and the usual damping already wins: the others cost time
    v_best, method, damp, codes, e_best = best
    reason = ("lowest output error on held-out calibration tokens" if method == "gptq" else
              "GPTQ was not better than nearest on held-out calibration tokens")
    return CheckedRounding(codes, method, damp, reason, v_energy, v_near, v_best, energy,
                           e_near, e_best)


def _codes(q: torch.Tensor, s_full: torch.Tensor) -> torch.Tensor:
    # q is on the grid: q / scale is the code up to float32 rounding, far from any tie
    return (q / s_full).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3_DTYPE)


def _errors(w, nearest, rounded, hessian) -> tuple[float, float, float]:
    zero = torch.zeros_like(w)
    return (output_error(w, zero, hessian), output_error(w, nearest, hessian),
            output_error(w, rounded, hessian))
