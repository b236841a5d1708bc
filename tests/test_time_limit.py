"""A run's time limit covers every stage: code that never checks it (the alarm, main thread),
loops that check it (any thread), and hashing for the report; reached, it says how far the run
got."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from fp8export import _progress
from fp8export._time_limit import TimeUp, check, expired, time_limit


def test_the_alarm_stops_a_stage_that_never_checks():
    t0 = time.perf_counter()
    with pytest.raises(TimeUp) as err, time_limit(0.3):
        with _progress.stage("loading a model that never ends"):
            while True:  # pure Python, no checkpoint: only the alarm can stop it
                sum(range(1000))
    assert time.perf_counter() - t0 < 5
    assert err.value.where == "loading a model that never ends"
    assert expired() is None  # disarmed: nothing left to fire later


def test_a_worker_thread_stops_at_its_next_checkpoint():
    caught = []

    def work():
        try:
            with time_limit(0.2):
                for _ in _progress.progress(range(10**6), total=10**6, desc="comparing",
                                            unit="batch"):
                    time.sleep(0.01)
                    check()
        except TimeUp as exc:
            caught.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(30)
    assert caught and caught[0].where.startswith("comparing: ")
    assert caught[0].where.endswith(" of 1000000 batch(s) done")


def test_no_limit_is_no_limit():
    with time_limit(None), time_limit(0):
        time.sleep(0.05)
        check()
    assert expired() is None


@pytest.fixture()
def huge_candidate(tmp_path) -> tuple[Path, Path]:
    """A small reference and a 64 GB sparse ONNX candidate: hashing it would take minutes."""
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text("{}")
    onnx = tmp_path / "model.onnx"
    with open(onnx, "wb") as f:
        f.truncate(64 * 10**9)
    return ref, onnx


def _header(ref: Path, onnx: Path):
    from fp8export.verify.config import VerifyConfig
    from fp8export.verify.provenance import header

    cfg = VerifyConfig(reference=ref, candidate=onnx)
    return header(cfg, reference={}, candidate={}, kind="onnx", data={}, backend="onnxruntime")


@pytest.mark.parametrize("thread", ["main", "worker"])
def test_hashing_for_the_report_stops_at_the_limit(huge_candidate, thread):
    caught: list[BaseException] = []

    def run():
        try:
            with time_limit(0.5):
                _header(*huge_candidate)
        except TimeUp as exc:
            caught.append(exc)

    t0 = time.perf_counter()
    if thread == "main":
        run()
    else:
        worker = threading.Thread(target=run)
        worker.start()
        worker.join(120)
    assert time.perf_counter() - t0 < 20  # hashing 64 GB of zeros would take minutes
    assert caught, "the time limit did not stop the hashing"
    assert caught[0].where == "hashing the reference and the candidate for the report (64.0 GB)"
