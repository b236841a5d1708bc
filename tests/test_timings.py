"""Timings: seconds per step summed over threads, and MB/s where a step counts its bytes."""

from __future__ import annotations

from fp8export._timings import RATE, Timings


def test_rates_are_bytes_per_second_of_the_steps_that_count_bytes():
    t = Timings()
    t.add("read", 0.5, 100_000_000)
    t.add("read", 0.5, 100_000_000)
    t.add("plan", 0.25)
    other = Timings()
    other.add("read", 1.0, 200_000_000)
    t.merge(other)
    d = t.as_dict()
    assert d["read"] == 2.0 and d["plan"] == 0.25
    assert d[RATE + "read"] == 200.0  # 400 MB in 2 s
    assert RATE + "plan" not in d


def test_convert_reports_mb_per_second_per_stage(tiny_llama, tmp_path):
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig

    r = convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "o", workers=2))
    for step in ("wall: scan (amax)", "hash: sha256 of source", "write: quantize + SQNR",
                 "write: sha256 output", "wall: write shards", "wall: read-back"):
        assert r.timings[RATE + step] > 0, step
