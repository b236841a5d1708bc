"""bench/calibrators.py (FP8 fake-quant comparison of the calibrators) runs on a tiny Llama."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "calibration"))
from calib_fixtures import WORDS, build_tiny_llama  # noqa: E402


def test_calibrator_comparison_runs_and_is_consistent(tmp_path, repo_root):
    ckpt = build_tiny_llama(tmp_path / "tiny-llama")
    rng = random.Random(0)
    text = tmp_path / "calib.txt"
    text.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))
                              for _ in range(24)) + "\n", encoding="utf-8")
    results = tmp_path / "results"
    r = subprocess.run(
        [sys.executable, str(repo_root / "bench" / "calibrators.py"), str(ckpt), "--calib-data",
         str(text), "--eval-data", str(text), "--results", str(results)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    res = json.loads((results / "calibrators.json").read_text())
    rows = res["results"]
    assert list(rows) == ["reference", "weights-only", "max", "percentile", "mse", "entropy"]
    assert rows["reference"]["kl_mean"] == 0.0 and rows["reference"]["top1_agreement"] == 1.0
    for name in ("weights-only", "max", "percentile", "mse", "entropy"):
        assert rows[name]["kl_mean"] > 0.0  # FP8 really perturbs the logits
        assert rows[name]["ppl"] == pytest.approx(rows["reference"]["ppl"], rel=0.05)
    for m in ("max", "percentile", "mse", "entropy"):
        assert 0.0 < rows[m]["amax_over_max_min"] <= rows[m]["amax_over_max_mean"] <= 1.0
    assert rows["max"]["amax_over_max_mean"] == 1.0
    # Per-module amaxes: every calibrator's is <= max's; fused members are equal.
    for m in ("percentile", "mse", "entropy"):
        assert all(a <= res["amax"]["max"][k] for k, a in res["amax"][m].items())
    a = res["amax"]["entropy"]
    assert a["model.layers.0.self_attn.q_proj"] == a["model.layers.0.self_attn.v_proj"]
    md = (results / "calibrators.md").read_text()
    assert "`entropy`" in md and "perplexity" in md and "`entropy`" in r.stdout
