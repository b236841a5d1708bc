"""Calibrators: observed activation statistics -> one amax per input, behind one interface.

Every calibrator collects the same streaming statistics (:class:`ActivationStats`: running
absmax, plus a bf16 bit-pattern histogram when it needs one) and differs only in
:meth:`Calibrator.amax_from`. So one pass over the data can serve all four methods (the
calibrator comparison does that), and ``compute_amax`` is a pure function of the statistics:
the same data gives the same amax bit for bit.

Registry: ``@register_calibrator("name")``; :func:`get_calibrator` normalises names
(case, ``_``/``-``) and lists the valid ones for an unknown name.

Methods (TensorRT's pytorch-quantization ``calib/histogram.py`` and ModelOpt's
``HistogramCalibrator`` implement the INT8 versions of percentile / mse / entropy over a linear
2048-bin histogram; what changes for FP8 is said at each class):

- ``max``: the running absmax. The peers' default (vLLM, ModelOpt FP8 "max" calibration).
- ``percentile``: the smallest observed value with at least ``p`` % of ``|x|`` at or below it.
- ``mse``: the candidate amax minimising the FP8 round-trip squared error of the observed
  values, quantizing each histogram value with :func:`quantize_e4m3` (the deployed cast).
- ``entropy``: the candidate amax minimising KL(observed || FP8-quantised) histograms.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from fp8export.calibration.observers import ActivationStats, FinalStats
from fp8export.errors import Fp8ExportError, UsageError
from fp8export.numerics.fp8 import E4M3_MAX, quantize_e4m3

DEFAULT_PERCENTILE = 99.99
# Candidate amaxes for mse / entropy: amax * 2**(-j / STEPS_PER_OCTAVE), j = 0..OCTAVES*STEPS.
# TensorRT searches bins 128..2048 of a linear histogram, i.e. [max/16, max]. FP8 outliers in
# LLMs reach 100-1000x the bulk, so we search 12 octaves down, logarithmically (FP8 error is
# scale-invariant inside the normal range, so log spacing matches its error curve).
STEPS_PER_OCTAVE = 32
OCTAVES = 12


@dataclass(frozen=True)
class AmaxResult:
    """An amax with JSON-serialisable facts about how it was chosen."""

    amax: float
    details: dict[str, Any] = field(default_factory=dict)


class Calibrator(ABC):
    """collect(x) per batch, compute_amax() at the end, reset() to reuse.

    Subclasses set ``name`` / ``needs_histogram`` and implement :meth:`amax_from`.
    """

    name: ClassVar[str] = ""
    needs_histogram: ClassVar[bool] = True

    def __init__(self, **options: Any):
        if options:
            raise Fp8ExportError(
                f"calibrator {self.name!r} takes no options, got {sorted(options)}.")
        self.stats = ActivationStats(histogram=self.needs_histogram)

    def collect(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Add observed values: all of ``x``, or only the token ``rows`` of ``x`` as [-1, H]."""
        self.stats.update(x, rows=rows)

    def reset(self) -> None:
        self.stats.reset()

    def compute_amax(self) -> float:
        """The amax for everything collected so far (raises if nothing was collected)."""
        final = self.stats.finalize()
        if final is None:
            raise Fp8ExportError(f"calibrator {self.name!r}: no values were collected.")
        return self.amax_from(final).amax

    def options(self) -> dict[str, Any]:
        return {}

    @abstractmethod
    def amax_from(self, stats: FinalStats) -> AmaxResult:
        """Compute the amax from host-side statistics (pure: same stats, same result)."""


_REGISTRY: dict[str, type[Calibrator]] = {}


def _normalise(name: str) -> str:
    return str(name).strip().lower().replace("_", "-")


def register_calibrator(name: str) -> Callable[[type[Calibrator]], type[Calibrator]]:
    """Class decorator adding a calibrator under ``name`` (normalised)."""
    key = _normalise(name)

    def deco(cls: type[Calibrator]) -> type[Calibrator]:
        if key in _REGISTRY and _REGISTRY[key] is not cls:
            raise ValueError(f"calibrator {key!r} is already registered")
        cls.name = key
        _REGISTRY[key] = cls
        return cls

    return deco


def available_calibrators() -> list[str]:
    return sorted(_REGISTRY)


def calibrator_class(name: str) -> type[Calibrator]:
    key = _normalise(name)
    if key not in _REGISTRY:
        raise UsageError(f"--calib-method: unknown calibrator {name!r}; valid calibrators "
                             f"are: {', '.join(available_calibrators())}.")
    return _REGISTRY[key]


def get_calibrator(name: str, **options: Any) -> Calibrator:
    """A fresh calibrator by (normalised) name; ``None``-valued options are dropped."""
    cls = calibrator_class(name)
    return cls(**{k: v for k, v in options.items() if v is not None})


def check_finite(stats: FinalStats, method: str) -> None:
    if not math.isfinite(stats.amax) or stats.nonfinite:
        raise Fp8ExportError(
            f"observed activations hold NaN/Inf (max |x| = {stats.amax}); the bf16 model "
            "overflows on the calibration data, so no {method} scale can be derived. Check the "
            "checkpoint's weights, or exclude the layer with --exclude.".replace(
                "{method}", method))


# --------------------------------------------------------------------------------------------


@register_calibrator("max")
class MaxCalibrator(Calibrator):
    """The largest ``|x|`` seen: nothing is clipped, resolution is given away to outliers."""

    needs_histogram = False

    def amax_from(self, stats: FinalStats) -> AmaxResult:
        check_finite(stats, self.name)
        return AmaxResult(stats.amax, {"observed_max": stats.amax})


def percentile_amax(values: np.ndarray, counts: np.ndarray, percentile: float) -> float:
    """Smallest observed value with ``cumsum(counts) >= percentile/100 * total``.

    Exact for the histogram (each bin is one bf16 value), unlike a linear histogram's bin
    edge. TensorRT's ``_compute_amax_percentile`` does the same search over bin edges.
    """
    cum = np.cumsum(counts)
    target = percentile / 100.0 * cum[-1]
    k = int(np.searchsorted(cum, target, side="left"))
    return float(values[min(k, len(values) - 1)])


@register_calibrator("percentile")
class PercentileCalibrator(Calibrator):
    """Clip the top ``100 - p`` % of ``|x|`` (default p = 99.99, as TensorRT and ModelOpt)."""

    def __init__(self, percentile: float = DEFAULT_PERCENTILE):
        super().__init__()
        p = float(percentile)
        if not (0.0 < p <= 100.0) or not math.isfinite(p):
            raise UsageError(f"--percentile must be in (0, 100], got {percentile}.")
        self.percentile = p

    def options(self) -> dict[str, Any]:
        return {"percentile": self.percentile}

    def amax_from(self, stats: FinalStats) -> AmaxResult:
        check_finite(stats, self.name)
        values, counts = stats.nonzero()
        amax = min(percentile_amax(values, counts, self.percentile), stats.amax)
        details = {"observed_max": stats.amax, "percentile": self.percentile}
        if amax <= 0.0 < stats.amax:
            # More than p % of the values are exactly zero: a zero amax can never be a scale
            # (DESIGN.md), so fall back to the max and say so.
            details["fallback"] = "percentile was 0 (mostly zeros); used the max"
            amax = stats.amax
        return AmaxResult(amax, details)


def candidate_amaxes(amax: float, extra: tuple[float, ...] = ()) -> np.ndarray:
    """Descending candidates ``amax * 2**(-j/STEPS)``, plus ``extra`` values <= amax."""
    j = np.arange(OCTAVES * STEPS_PER_OCTAVE + 1, dtype=np.float64)
    cands = amax * np.exp2(-j / STEPS_PER_OCTAVE)
    if extra:
        cands = np.concatenate([cands, [e for e in extra if 0.0 < e <= amax]])
    # Round to float32 (what a stored amax/scale is), dedupe, largest first so argmin's first
    # hit prefers the least clipping on exact ties (TensorRT's entropy takes the last argmin
    # over ascending thresholds, i.e. also the largest).
    return np.unique(cands.astype(np.float32).astype(np.float64))[::-1]


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run the amax search on one intra-op thread.

    Its tensors are small ([32..64, <=32K]); on a busy 2-core machine OpenMP hand-offs made
    them 100x slower than single-threaded, and a fixed thread count also keeps float64
    reductions in one order, so the amax is bit-for-bit the same on every machine.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _scales(cands: np.ndarray) -> torch.Tensor:
    """float32 dequantization scales ``amax / 448`` exactly as ``amax_to_scale`` rounds them."""
    return torch.from_numpy((cands / E4M3_MAX).astype(np.float32))


def _quantized_codes(values32: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of ``values`` under each scale, ``[C, N]`` uint8 magnitude codes (0..126)."""
    q = quantize_e4m3(values32.unsqueeze(0), scales.unsqueeze(1))
    return q.view(torch.uint8) & 0x7F


@register_calibrator("mse")
class MseCalibrator(Calibrator):
    """Minimise ``sum_i n_i * (fq(v_i) - v_i)**2`` over candidate amaxes, on the E4M3 grid.

    Like TensorRT's ``_compute_amax_mse`` (fake-quantize the bin centres, weight by counts),
    but the centres are exact bf16 values, the quantizer is the deployed E4M3 cast
    (clamp + RNE, subnormals, underflow to 0) with the float32 scale convert would store, and
    the candidates include the max and the 99.99th percentile, so mse's error is never worse
    than theirs. Because E4M3's relative error is the same everywhere in its normal range,
    shrinking the amax only helps values that would fall into subnormals/zero, and clipping
    costs ``(x - amax)**2``: for most data the answer stays close to the max.
    """

    chunk = 64  # candidates per vectorised step: [64, N] float32 stays small

    def amax_from(self, stats: FinalStats) -> AmaxResult:
        with _one_thread():
            return self._amax_from(stats)

    def _amax_from(self, stats: FinalStats) -> AmaxResult:
        check_finite(stats, self.name)
        values, counts = stats.nonzero()
        if stats.amax <= 0.0 or values.size == 0:
            return AmaxResult(stats.amax, {"observed_max": stats.amax})
        p = percentile_amax(values, counts, DEFAULT_PERCENTILE)
        cands = candidate_amaxes(stats.amax, (p,))
        v32 = torch.from_numpy(values.astype(np.float32))
        v64 = torch.from_numpy(values)
        w = torch.from_numpy(counts)
        errs = np.empty(len(cands), dtype=np.float64)
        for s in range(0, len(cands), self.chunk):
            sc = _scales(cands[s:s + self.chunk])
            q = quantize_e4m3(v32.unsqueeze(0), sc.unsqueeze(1)).to(torch.float64)
            deq = q * sc.to(torch.float64).unsqueeze(1)
            errs[s:s + len(sc)] = (((deq - v64) ** 2) * w).sum(dim=1).numpy()
        best = int(np.argmin(errs))
        total = float(counts.sum())
        return AmaxResult(float(cands[best]), {
            "observed_max": stats.amax, "mse": errs[best] / total,
            "mse_at_max": errs[0] / total, "candidates": len(cands)})


@register_calibrator("entropy")
class EntropyCalibrator(Calibrator):
    """Minimise KL(P || Q) between the observed and the FP8-quantised histograms.

    TensorRT's entropy calibrator (pytorch-quantization ``_compute_amax_entropy``, the idea
    of ``IInt8EntropyCalibrator2``), for a threshold ``i`` over a linear histogram: P = the
    bins below ``i`` with all outlier mass folded into the last bin; Q = those bins merged into
    128 *uniform* INT8 levels, each level's mass spread evenly over its non-empty bins; pick
    the threshold with the least KL. Adapted to FP8:

    - the threshold is a candidate amax ``c`` and the levels are the **E4M3 grid** under the
      float32 scale ``c/448``: each histogram value is assigned to the code ``quantize_e4m3``
      rounds it to (RNE; level widths double every binade, subnormal levels have a fixed
      width, and values below half the smallest subnormal share level 0: underflow);
    - mass above ``c`` is folded into the last bf16 value ``<= c`` (TensorRT's last bin),
      which lies in the top level (448);
    - Q spreads each level's mass evenly over **all** bf16 values the level covers, not only
      the observed ones. With exact-value bins (:mod:`observers`), spreading over observed bins
      only makes Q == P whenever each bin holds one sample, so sparse data would show no loss
      at all; spreading over the covered values makes KL = E[log K_level] - H(value | level):
      the information the FP8 code throws away. A level that swallows many binades (underflow
      to 0, subnormals) costs a lot, clipping costs the folded spike in the top level;
    - exact zeros form their own level (zero round-trips exactly), instead of TensorRT's
      ``bins[0] = bins[1]`` ReLU workaround.

    KL weights values by count, not magnitude (unlike mse), so rare large outliers are cheap to
    clip when the bulk would otherwise lose resolution to subnormals and underflow.
    """

    def amax_from(self, stats: FinalStats) -> AmaxResult:
        with _one_thread():
            return self._amax_from(stats)

    def _amax_from(self, stats: FinalStats) -> AmaxResult:
        check_finite(stats, self.name)
        values, counts = stats.nonzero()
        if stats.amax <= 0.0 or values.size == 0:
            return AmaxResult(stats.amax, {"observed_max": stats.amax})
        cands = candidate_amaxes(stats.amax)
        p_all = counts / float(counts.sum())
        kls = np.empty(len(cands), dtype=np.float64)
        for s in range(0, len(cands), 32):
            c = cands[s:s + 32]
            kls[s:s + len(c)] = _kl_for_thresholds(values, p_all, c)
        best = int(np.argmin(kls))
        return AmaxResult(float(cands[best]), {
            "observed_max": stats.amax, "kl": float(kls[best]), "kl_at_max": float(kls[0]),
            "candidates": len(cands)})


_ZERO_LEVEL = 0x7F  # E4M3 magnitude code 0x7F is NaN, never produced: reuse it for exact zeros


def _levels(values: np.ndarray, scales: torch.Tensor) -> np.ndarray:
    """``[C, N]`` level per value: its E4M3 magnitude code, or _ZERO_LEVEL for exact zeros."""
    codes = _quantized_codes(torch.from_numpy(values.astype(np.float32)), scales)
    lv = codes.to(torch.int64).numpy()
    lv[:, values == 0.0] = _ZERO_LEVEL
    return lv


def _kl_for_thresholds(values: np.ndarray, p_all: np.ndarray, cands: np.ndarray) -> np.ndarray:
    """KL(P || Q) for each candidate amax in ``cands`` (see :class:`EntropyCalibrator`)."""
    from fp8export.calibration.observers import bin_values

    rows, n = len(cands), values.size
    scales = _scales(cands)
    # K: how many bf16 values each level covers, counting only values <= c (above c is clipped).
    # Values below c * 2**-20 round to code 0 for every candidate (448 * 2**-20 is under half
    # the smallest subnormal, 2**-10): count them per row instead of quantizing them all.
    allv = bin_values()
    lo = cands * 2.0**-20
    win = allv[(allv >= lo.min()) & (allv <= cands.max())]
    lv_win = _levels(win, scales)
    covered = (win[None, :] <= cands[:, None]) & (win[None, :] >= lo[:, None])
    off = (128 * np.arange(rows))[:, None]
    k = np.bincount((lv_win + off)[covered], minlength=128 * rows).astype(np.float64)
    below = np.searchsorted(allv, lo, side="left") - 1  # nonzero bf16 values under c * 2**-20
    k[128 * np.arange(rows)] += below

    # P: observed mass <= c, with the mass above c folded into the last bf16 value <= c.
    inside = values[None, :] <= cands[:, None]
    p = np.where(inside, p_all[None, :], 0.0)
    clip = p_all.sum() - p.sum(axis=1)
    c_bits = torch.from_numpy(cands.astype(np.float32)).view(torch.int32) >> 16
    fold_val = c_bits.to(torch.int16).view(torch.bfloat16).to(torch.float64).numpy()
    lv = _levels(values, scales)
    j = np.searchsorted(values, fold_val, side="right") - 1
    hit = (j >= 0) & (values[np.maximum(j, 0)] == fold_val)
    p[np.arange(rows)[hit], j[hit]] += clip[hit]
    extra_p = np.where(hit, 0.0, clip)
    extra_lv = _levels(fold_val, scales).diagonal()  # level of each row's fold value
    p = np.concatenate([p, extra_p[:, None]], axis=1)
    lv = np.concatenate([lv, extra_lv[:, None]], axis=1)

    flat = (lv + off).ravel()
    pf = p.ravel()
    mass = np.bincount(flat, weights=pf, minlength=128 * rows)
    occ = pf > 0.0
    # Q_i = level mass / values covered by the level, so KL term = P_i log(P_i K / mass).
    terms = np.zeros_like(pf)
    terms[occ] = pf[occ] * np.log(pf[occ] * np.maximum(k[flat[occ]], 1.0) / mass[flat[occ]])
    return terms.reshape(rows, n + 1).sum(axis=1)
