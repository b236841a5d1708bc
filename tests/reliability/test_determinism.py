"""Determinism: two conversions of the same input with the same options are byte-identical.

Each pair runs as two real processes (started together, one CPU thread each) with different
``PYTHONHASHSEED`` values and different output folders; every file of the two outputs is
compared by sha256. Modes: weights only (a sharded source: shards, index, manifest, config),
``--scales history`` on a Transformer Engine fixture, ``--scales calibrate`` with calibration
data (``max`` by default; the other calibrators under ``--run-slow``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from reliability_helpers import (
    CLI,
    REPO,
    cli_env,
    make_corpus,
    mid_checkpoint,
    tiny_checkpoint,
    tree,
)


def _pair(tmp_path: Path, args: list, *, threads=(1, 1), hashseeds=("1", "2")):
    outs = [tmp_path / f"run-{i}" / "fp8" for i in range(2)]
    procs = []
    for out, t, seed in zip(outs, threads, hashseeds):
        env = {**cli_env(), "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": str(t),
               "MKL_NUM_THREADS": str(t)}
        procs.append(subprocess.Popen([*CLI, *map(str, args), "-o", str(out)], cwd=REPO,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    return [tree(o) for o in outs]


def _same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    differ = [name for name in a if a[name] != b[name]]
    assert not differ, f"files differ between two identical conversions: {differ}"
    assert a, "no files written"


def test_weights_only(tmp_path):
    ckpt = mid_checkpoint(tmp_path, hidden=128, layers=2, shards=2)
    a, b = _pair(tmp_path, ["convert", ckpt, "--scales", "weights"])
    assert "model.safetensors.index.json" in a and "fp8export.json" in a
    _same(a, b)


def test_history_transformer_engine(tmp_path):
    fixtures = make_corpus.te_fixtures().write_fixtures(tmp_path / "te")
    a, b = _pair(tmp_path, ["convert", fixtures["te2_layer"], "--scales", "history"])
    _same(a, b)


def _calib_data(tmp_path: Path) -> Path:
    path = tmp_path / "calib.npz"
    ids = np.random.default_rng(0).integers(0, make_corpus.V, (8, 16))
    np.savez(path, input_ids=ids)
    return path


@pytest.mark.parametrize("method", [
    "max", pytest.param("percentile", marks=pytest.mark.slow),
    pytest.param("mse", marks=pytest.mark.slow), pytest.param("entropy", marks=pytest.mark.slow)])
def test_calibrate(tmp_path, method):
    ckpt = tiny_checkpoint(tmp_path)
    a, b = _pair(tmp_path, ["convert", ckpt, "--scales", "calibrate", "--calib-data",
                            _calib_data(tmp_path), "--calib-method", method])
    _same(a, b)


def test_thread_count_does_not_change_the_bytes(tmp_path):
    """Same input and options on a machine with another core count: same bytes (CI vs desk)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPUs")
    ckpt = mid_checkpoint(tmp_path, hidden=512, layers=1, shards=1)
    a, b = _pair(tmp_path, ["convert", ckpt, "--scales", "weights"], threads=(1, 2))
    _same(a, b)
