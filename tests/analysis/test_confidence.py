"""Bootstrap confidence intervals of the gated metrics (fp8export/analysis/confidence.py)."""

import math

import numpy as np
import pytest

from fp8export.analysis.confidence import (
    MIN_SAMPLES,
    STATISTICS,
    SampleStats,
    assess,
    draws,
    intervals,
    tokens_to_decide,
)
from fp8export.verify.embeddings import EmbeddingComparison
from fp8export.verify.metrics import Comparison
from fp8export.verify.pooling import Pooling


def _comparison(samples=12, tokens=9, vocab=17, noise=0.3, seed=0, labels=False):
    rng = np.random.default_rng(seed)
    ref = rng.normal(size=(samples, tokens, vocab)).astype(np.float32)
    cand = ref + noise * rng.normal(size=ref.shape).astype(np.float32)
    mask = np.ones((samples, tokens), dtype=np.int64)
    mask[1, 6:] = 0  # ragged samples: token-weighted and sample-weighted metrics differ
    mask[4, 3:] = 0
    ids = rng.integers(0, vocab, size=(samples, tokens))
    c = Comparison(causal=True)
    lab = rng.integers(0, vocab, size=samples) if labels else None
    for start in range(0, samples, 5):  # several batches
        sl = slice(start, start + 5)
        c.add(ref[sl], cand[sl], attention_mask=mask[sl], input_ids=ids[sl],
              labels=None if lab is None else lab[sl])
    return c


def test_sample_stats_reproduce_every_metric_with_each_sample_drawn_once():
    c = _comparison(labels=True)
    m = c.result()["metrics"]
    stats = c.sample_stats()
    once = np.ones((1, stats.samples))
    cols = stats.columns
    for name, (needs, fn) in STATISTICS.items():
        if name not in m:
            continue
        assert all(k in cols for k in needs), name
        assert fn(once, cols)[0] == pytest.approx(m[name], rel=1e-9, abs=1e-12), name


def test_embedding_stats_reproduce_cosine_and_rel_l2():
    rng = np.random.default_rng(3)
    ref = rng.normal(size=(6, 5, 8)).astype(np.float32)
    cand = ref + 0.1 * rng.normal(size=ref.shape).astype(np.float32)
    c = EmbeddingComparison(Pooling())
    c.add(ref, cand, attention_mask=np.ones((6, 5), dtype=np.int64))
    m = c.result()["metrics"]
    stats = c.sample_stats()
    once = np.ones((1, 6))
    for name in ("cosine_mean", "cosine_min", "rel_l2", "max_abs"):
        assert STATISTICS[name][1](once, stats.columns)[0] == pytest.approx(m[name], rel=1e-5)
    assert "neighbor_agreement" not in intervals(stats, ["neighbor_agreement", "cosine_mean"])


def test_intervals_are_deterministic_and_hold_the_point_estimate():
    c = _comparison(samples=30)
    m = c.result()["metrics"]
    stats = c.sample_stats()
    names = ["kl_mean", "top1_agreement", "kl_p99", "ppl_ratio", "cosine_mean", "rel_l2"]
    a, b = intervals(stats, names), intervals(stats, names)
    assert a == b
    assert set(a) == set(names)
    for name in names:
        low, high = a[name]
        assert low < high, name
        assert low <= m[name] <= high, name
    assert intervals(stats, ["kl_mean"], seed=1) != a["kl_mean"]


def test_weighted_p99_is_the_inverted_cdf_percentile_with_each_sample_once():
    rng = np.random.default_rng(5)
    token_kl = [rng.exponential(0.02, size=n) for n in (7, 40, 13, 90)]
    stats = SampleStats({"tokens": np.array([7.0, 40, 13, 90])}, token_kl=token_kl)
    from fp8export.analysis import confidence

    got = confidence._weighted_p99(token_kl, np.ones((1, 4)))[0]
    assert got == np.percentile(np.concatenate(token_kl), 99, method="inverted_cdf")
    assert "kl_p99" in intervals(stats, ["kl_p99"])


def test_interval_width_shrinks_as_one_over_root_n():
    rng = np.random.default_rng(7)

    def width(n):
        tokens = rng.integers(60, 128, size=n).astype(float)
        kl = np.array([rng.exponential(0.02, size=int(t)).sum() for t in tokens])
        iv = intervals(SampleStats({"tokens": tokens, "kl_sum": kl}), ["kl_mean"])["kl_mean"]
        return iv[1] - iv[0]

    ratio = width(64) / width(1024)
    assert 2.5 < ratio < 6.0  # sqrt(16) = 4


def test_coverage_of_the_true_mean_is_near_the_level():
    """Samples of known per-sample means: the 95% interval should hold the true mean about 95%
    of the time (checked over 200 independent data sets, binomial spread ~1.5%)."""
    rng = np.random.default_rng(11)
    hits = 0
    trials = 200
    for t in range(trials):
        tokens = np.full(40, 100.0)
        # per-sample KL means spread around 0.02 (samples differ more than tokens)
        means = rng.gamma(4.0, 0.005, size=40)
        kl = means * tokens
        low, high = intervals(SampleStats({"tokens": tokens, "kl_sum": kl}), ["kl_mean"],
                              resamples=400, seed=t)["kl_mean"]
        hits += low <= 0.02 <= high
    assert 0.88 <= hits / trials <= 0.99


def test_assess_marks_a_check_whose_interval_holds_the_threshold():
    c = _comparison(samples=40, noise=0.3)
    result = c.result()
    m = result["metrics"]
    checks = [
        {"metric": "kl_mean", "op": "max", "threshold": m["kl_mean"] * 1.01,
         "value": m["kl_mean"], "status": "passed"},
        {"metric": "kl_mean", "op": "max", "threshold": m["kl_mean"] * 10,
         "value": m["kl_mean"], "status": "passed"},
        {"metric": "top1_agreement", "op": "min", "threshold": 0.0,
         "value": m["top1_agreement"], "status": "passed"},
        {"metric": "ppl_ratio", "op": "max", "threshold": None, "value": None,
         "status": "skipped"},
    ]
    conf = assess(checks, c.sample_stats(), tokens=m["tokens"])
    assert checks[0]["decided"] is False and checks[1]["decided"] is True
    assert checks[2]["decided"] is True
    assert "interval" not in checks[3]
    assert conf["verdict"] == "uncertain" and conf["undecided"] == ["kl_mean"]
    assert conf["tokens_needed"] > m["tokens"]
    assert any("kl_mean" in w and "tokens would decide it" in w for w in conf["warnings"])
    # far from every threshold: certain, no warnings
    certain = assess(checks[1:3], c.sample_stats(), tokens=m["tokens"])
    assert certain["verdict"] == "certain" and certain["warnings"] == []
    assert certain["tokens_needed"] is None


def test_too_few_samples_are_said():
    c = _comparison(samples=MIN_SAMPLES - 2)
    m = c.result()["metrics"]
    checks = [{"metric": "kl_mean", "op": "max", "threshold": 100.0, "value": m["kl_mean"],
               "status": "passed"}]
    conf = assess(checks, c.sample_stats(), tokens=m["tokens"])
    assert conf["verdict"] == "uncertain"
    assert "understate the spread" in conf["warnings"][0]


def test_tokens_to_decide_scales_with_the_squared_ratio():
    # value 0.018, bound 0.02, half-width 0.004 on the bound's side: (0.004/0.002)^2 = 4x
    assert tokens_to_decide(0.018, 0.02, "max", [0.015, 0.022], 1000) == pytest.approx(4000)
    assert tokens_to_decide(0.018, 0.02, "max", [0.015, 0.019], 1000) is None
    assert tokens_to_decide(0.02, 0.02, "max", [0.015, 0.025], 1000) == math.inf


def test_draws_are_counts_that_sum_to_the_sample_count():
    w = draws(17, resamples=50, seed=0)
    assert w.shape == (50, 17)
    assert np.all(w.sum(1) == 17)
