"""Axis scales: data → px mapping, round tick values, and their labels."""

from __future__ import annotations

import math
from dataclasses import dataclass

_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def fmt_number(v: float, step: float | None = None) -> str:
    """A short label: as many decimals as ``step`` needs, a true minus sign, no ``-0``."""
    if step is not None and step > 0:
        decimals = max(0, -math.floor(math.log10(step) + 1e-9))
        s = f"{v:.{decimals}f}"
    elif v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        s = f"{v:.2g}"
    else:
        s = f"{v:.4g}"
    if s.lstrip("-").strip("0.") == "":
        s = s.lstrip("-")
    return s.replace("-", "−")


def fmt_power(exponent: int) -> str:
    """``10^k`` as a label: plain for 0.01 … 1000, else ``10⁻⁴`` style."""
    if -2 <= exponent <= 3:
        return fmt_number(10.0 ** exponent, 10.0 ** min(exponent, 0))
    return "10" + str(exponent).translate(_SUPERSCRIPT)


def nice_step(span: float, target: int) -> float:
    """A step of 1, 2 or 5 × 10^k giving about ``target`` intervals over ``span``."""
    raw = span / max(target, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if raw <= m * power * (1 + 1e-9):
            return m * power
    return 10.0 * power


@dataclass(frozen=True)
class Scale:
    """Maps data values in ``[lo, hi]`` (linear or log10) onto pixels ``[p0, p1]``."""

    lo: float
    hi: float
    p0: float
    p1: float
    log: bool = False

    def __call__(self, v: float) -> float:
        a, b, x = self.lo, self.hi, v
        if self.log:
            a, b, x = math.log10(a), math.log10(b), math.log10(max(v, 1e-300))
        t = (x - a) / (b - a) if b != a else 0.5
        return self.p0 + t * (self.p1 - self.p0)


def linear_domain(lo: float, hi: float, target: int = 5, include: tuple[float, ...] = ()
                  ) -> tuple[float, float, list[float], float]:
    """Round ``[lo, hi]`` (widened to ``include``) out to tick steps: (lo, hi, ticks, step)."""
    values = [v for v in (lo, hi, *include) if v is not None and math.isfinite(v)]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if hi - lo < 1e-12 * max(1.0, abs(hi)):
        pad = abs(hi) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    step = nice_step(hi - lo, target)
    start, stop = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    ticks = [k * step for k in range(start, stop + 1)]
    return ticks[0], ticks[-1], ticks, step


def log_domain(lo: float, hi: float) -> tuple[float, float, list[tuple[float, str]]]:
    """Decades around ``[lo, hi]`` (both > 0): (lo, hi, [(tick, label)]); 1-2-5 in short spans."""
    e0 = math.floor(math.log10(lo) + 1e-9)
    e1 = math.ceil(math.log10(hi) - 1e-9)
    if e1 == e0:
        e1 += 1
    ticks = [(10.0 ** e, fmt_power(e)) for e in range(e0, e1 + 1)]
    if e1 - e0 <= 2:
        for e in range(e0, e1):
            for m in (2, 5):
                v = m * 10.0 ** e
                ticks.append((v, fmt_number(v, 10.0 ** min(e, 0)) if -2 <= e <= 3
                              else f"{m}×{fmt_power(e)}"))
        ticks.sort()
    return 10.0 ** e0, 10.0 ** e1, ticks
