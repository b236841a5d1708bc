"""Runners stop at their deadline: onnxruntime mid-graph, every runner before a batch."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fp8export.runners.base import TimeLimitExceeded
from fp8export.runners.ort_runner import OrtRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corrupt"))
from corpus_untrusted import loop_model  # noqa: E402

FEED = {"input_ids": np.zeros((1, 2), np.int64), "attention_mask": np.ones((1, 2), np.int64)}


def test_onnxruntime_stops_a_graph_that_never_ends(tmp_path, monkeypatch):
    # the op allowlist refuses Loop before anything runs; bypass it to test the deadline itself
    import fp8export.onnx.check as check

    monkeypatch.setattr(check, "check_ops", lambda model: [])
    runner = OrtRunner(loop_model(tmp_path / "loop.onnx"), providers=["CPUExecutionProvider"])
    with runner:
        runner.deadline = time.monotonic() + 1.0
        start = time.monotonic()
        with pytest.raises(TimeLimitExceeded):
            runner.infer(FEED)
        assert time.monotonic() - start < 30


def test_a_short_graph_finishes_under_its_deadline(tmp_path, monkeypatch):
    import fp8export.onnx.check as check

    monkeypatch.setattr(check, "check_ops", lambda model: [])
    with OrtRunner(loop_model(tmp_path / "loop.onnx", trips=3),
                   providers=["CPUExecutionProvider"]) as runner:
        runner.deadline = time.monotonic() + 60
        assert runner.infer(FEED)["logits"].max() == 3.0
        runner.deadline = time.monotonic() - 1  # already past: refused before running
        with pytest.raises(TimeLimitExceeded):
            runner.infer(FEED)


def test_the_allowlist_refuses_loop_before_running(tmp_path):
    from fp8export.errors import Fp8ExportError

    with pytest.raises(Fp8ExportError, match="Loop.*not an op export-onnx emits"):
        OrtRunner(loop_model(tmp_path / "loop.onnx")).activate()
