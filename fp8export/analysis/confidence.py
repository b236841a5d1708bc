"""How certain a verdict is: bootstrap confidence intervals of the gated metrics, over samples.

The data verify scores is a sample of the text a model will see; another sample of the same
kind would give other metrics. The bootstrap estimates by how much: the samples (not the
tokens: tokens of one sample are correlated) are drawn with replacement ``resamples`` times
and every gated metric is recomputed on each draw from per-sample statistics (sums, counts,
extremes), so a draw costs a few matrix products, not a model run. The percentile interval of
the draws at ``level`` (95 %) is reported for each metric.

A check whose interval holds its threshold is *undecided*: another sample of the same size
could flip it. For such a check the number of tokens that would decide it is estimated from
the interval's half-width ``h`` on the threshold's side and the margin ``m`` between the value
and the threshold: the half-width shrinks as one over the square root of the data, so
``tokens * (h / m) ** 2`` tokens bring the interval to the threshold. Below
:data:`MIN_SAMPLES` samples the bootstrap itself understates the spread, and verify says so.

Deterministic: a fixed seed, and the same draws for every metric.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LEVEL = 0.95
RESAMPLES = 1000
SEED = 0
MIN_SAMPLES = 10  # fewer samples: the bootstrap's spread is itself unreliable
# Beyond this many times the run's tokens, an estimate of the data that would decide a check is
# no advice (a value on the threshold but for float rounding asks for 10^32 tokens): said so.
DECIDE_CAP = 100
_CHUNK = 100  # draws per block of the token-level percentile (bounds its memory)


@dataclass
class SampleStats:
    """Per-sample statistics of one comparison, each column an array over samples.

    Columns (any may be absent): ``tokens``, ``kl_sum``, ``top1_sum``, ``top5_sum`` (token
    sums), ``cosine``, ``cosine_token_min``, ``err_sq``, ``ref_sq``, ``max_abs``, ``kl_max``,
    ``prob_max``, ``nll_reference``, ``nll_candidate``, ``nll_tokens``, ``labelled``,
    ``correct_reference``, ``correct_candidate``. ``token_kl`` holds each sample's per-token KL
    (for ``kl_p99``).
    """

    columns: dict[str, np.ndarray]
    token_kl: list[np.ndarray] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0


def _ratio(num: str, den: str):
    def f(w: np.ndarray, c: dict[str, np.ndarray]) -> np.ndarray:
        return (w @ c[num]) / np.maximum(w @ c[den], 1e-300)
    return f


def _extreme(col: str, how: str):
    def f(w: np.ndarray, c: dict[str, np.ndarray]) -> np.ndarray:
        fill = np.inf if how == "min" else -np.inf
        v = np.where(w > 0, c[col][None, :], fill)
        return v.min(1) if how == "min" else v.max(1)
    return f


def _rel_l2(w, c):
    return np.sqrt((w @ c["err_sq"]) / np.maximum(w @ c["ref_sq"], 1e-300))


def _ppl_ratio(w, c):
    n = np.maximum(w @ c["nll_tokens"], 1e-300)
    return np.exp((w @ c["nll_candidate"] - w @ c["nll_reference"]) / n)


def _accuracy_drop(w, c):
    n = np.maximum(w @ c["labelled"], 1e-300)
    return (w @ c["correct_reference"] - w @ c["correct_candidate"]) / n


def _cosine_mean(w, c):
    return (w @ c["cosine"]) / w.sum(1)


# metric -> (columns it needs, statistic of a weight matrix [draws, samples])
STATISTICS = {
    "kl_mean": (("kl_sum", "tokens"), _ratio("kl_sum", "tokens")),
    "top1_agreement": (("top1_sum", "tokens"), _ratio("top1_sum", "tokens")),
    "top5_overlap": (("top5_sum", "tokens"), _ratio("top5_sum", "tokens")),
    "cosine_mean": (("cosine",), _cosine_mean),
    "cosine_min": (("cosine",), _extreme("cosine", "min")),
    "cosine_token_min": (("cosine_token_min",), _extreme("cosine_token_min", "min")),
    "rel_l2": (("err_sq", "ref_sq"), _rel_l2),
    "max_abs": (("max_abs",), _extreme("max_abs", "max")),
    "kl_max": (("kl_max",), _extreme("kl_max", "max")),
    "prob_max_abs": (("prob_max",), _extreme("prob_max", "max")),
    "ppl_ratio": (("nll_reference", "nll_candidate", "nll_tokens"), _ppl_ratio),
    "accuracy_drop": (("labelled", "correct_reference", "correct_candidate"), _accuracy_drop),
}
# Not resampled: neighbor_agreement compares samples with each other (a draw with repeats
# makes a sample its own nearest neighbour).


def draws(samples: int, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """How often each sample is drawn in each resample: ``[resamples, samples]`` counts."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(samples, np.full(samples, 1.0 / samples), size=resamples
                           ).astype(np.float64)


def _weighted_p99(token_kl: list[np.ndarray], w: np.ndarray, q: float = 99.0) -> np.ndarray:
    """The ``q``-th percentile of the token KLs of each draw (a token counts as often as its
    sample was drawn): the inverted-CDF percentile, vectorised over draws."""
    values = np.concatenate(token_kl)
    owner = np.concatenate([np.full(len(a), i) for i, a in enumerate(token_kl)])
    order = np.argsort(values, kind="stable")
    values, owner = values[order], owner[order]
    out = np.empty(len(w))
    for start in range(0, len(w), _CHUNK):
        cum = np.cumsum(w[start:start + _CHUNK][:, owner], axis=1)
        target = cum[:, -1:] * (q / 100.0)
        idx = (cum < target).sum(1)
        out[start:start + _CHUNK] = values[np.minimum(idx, len(values) - 1)]
    return out


def intervals(stats: SampleStats, metrics: list[str], *, level: float = LEVEL,
              resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, list[float]]:
    """``{metric: [low, high]}``: the bootstrap percentile interval of each metric that per-sample
    statistics can recompute (others are left out)."""
    n = stats.samples
    if n == 0:
        return {}
    w = draws(n, resamples, seed)
    cols = {k: np.asarray(v, dtype=np.float64) for k, v in stats.columns.items()}
    lo_q, hi_q = 100 * (1 - level) / 2, 100 * (1 + level) / 2
    out: dict[str, list[float]] = {}
    for name in metrics:
        if name == "kl_p99" and stats.token_kl:
            values = _weighted_p99(stats.token_kl, w)
        elif name in STATISTICS and all(c in cols for c in STATISTICS[name][0]):
            with np.errstate(all="ignore"):
                values = STATISTICS[name][1](w, cols)
        else:
            continue
        values = values[np.isfinite(values)]
        if values.size:
            out[name] = [float(np.percentile(values, lo_q)), float(np.percentile(values, hi_q))]
    return out


def tokens_to_decide(value: float, bound: float, op: str, interval: list[float],
                     tokens: int) -> float | None:
    """Tokens of the same kind that would bring the interval off ``bound``: None when it is
    already decided, ``inf`` when the value sits on the bound."""
    low, high = interval
    if not low <= bound <= high:
        return None
    margin = abs(value - bound)
    # the half-width on the side that faces the bound
    half = (value - low) if (bound <= value) else (high - value)
    if margin == 0 or not math.isfinite(half):
        return math.inf
    return tokens * max(1.0, (half / margin) ** 2)


def assess(checks: list[dict[str, Any]], stats: SampleStats, *, tokens: int,
           level: float = LEVEL, resamples: int = RESAMPLES, seed: int = SEED
           ) -> dict[str, Any]:
    """Intervals for the checked metrics, each check marked decided or not (in place: keys
    ``interval`` and ``decided``), and the verdict's confidence with its warnings."""
    checked = [c for c in checks if c.get("status") in ("passed", "failed")]
    found = intervals(stats, sorted({c["metric"] for c in checked}), level=level,
                      resamples=resamples, seed=seed)
    undecided, needed, warnings = [], [], []
    for c in checked:
        iv = found.get(c["metric"])
        if iv is None or c.get("threshold") is None or c.get("value") is None:
            continue
        c["interval"] = iv
        more = tokens_to_decide(float(c["value"]), float(c["threshold"]), c["op"], iv, tokens)
        c["decided"] = more is None
        if more is not None:
            if more > DECIDE_CAP * max(tokens, 1):
                more = math.inf
            undecided.append(c["metric"])
            needed.append(more)
            sym = ">=" if c["op"] == "min" else "<="
            warnings.append(
                f"{c['metric']} = {c['value']:.4g}: its {level:.0%} interval "
                f"[{iv[0]:.4g}, {iv[1]:.4g}] holds the threshold ({sym} {c['threshold']:g}), so "
                f"the check could go either way on other data of this kind"
                + (f"; about {_round_up(more):,} tokens would decide it" if math.isfinite(more)
                   else f"; the value sits on the threshold, so not even {DECIDE_CAP} times "
                        f"this data ({DECIDE_CAP * tokens:,} tokens) would decide it"))
    samples = stats.samples
    if samples < MIN_SAMPLES:
        warnings.insert(0, f"only {samples} sample(s) scored: below {MIN_SAMPLES} the intervals "
                           "understate the spread; score more samples for a stable verdict")
    finite = [x for x in needed if math.isfinite(x)]
    return {
        "level": level, "method": "bootstrap over samples (percentile interval)",
        "resamples": resamples, "seed": seed, "samples": samples, "tokens": tokens,
        "intervals": found,
        "verdict": "uncertain" if undecided or samples < MIN_SAMPLES else "certain",
        "undecided": undecided,
        "tokens_needed": _round_up(max(finite)) if finite else (None if not needed else "inf"),
        "warnings": warnings,
    }


def _round_up(x: float) -> int:
    """Two significant digits, rounded up (an estimate, not a count)."""
    if x <= 0:
        return 0
    step = 10 ** max(0, int(math.floor(math.log10(x))) - 1)
    return int(math.ceil(x / step) * step)
