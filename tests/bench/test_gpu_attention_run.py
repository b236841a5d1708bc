"""bench/gpu_attention_run.sh and what it drives, as far as they run without a GPU: the
argument parsing and result merging of bench/gpu_fp8.py, the report rendered from result JSONs
(committed H200/H100 runs as the fixture), and the runner's hard time limits."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
RUNNER = REPO / "bench" / "gpu_attention_run.sh"


def _bench(name: str):
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def test_arguments():
    gpu = _bench("gpu_fp8")
    args = gpu.parse_args(["--parts", "decode", "--decode-eager", "", "--warm-only"])
    assert args.decode_eager == "" and args.decode_compiled == "1,8,32" and args.warm_only
    assert args.p_bf16 and args.compile_mask and args.logits_check  # what the runtime ships
    assert gpu.parse_args(["--decode-batches", "4"]).decode_eager == "4"  # the old spelling
    assert not gpu.parse_args(["--p-e4m3"]).p_bf16
    with pytest.raises(SystemExit):
        gpu.parse_args(["--parts", "decode,prefil"])


def test_merge_unites_the_per_section_dicts(tmp_path):
    gpu = _bench("gpu_fp8_report")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"device": "X", "section_s": {"decode": 1}, "decode": [
        {"batch": 1, "ms": 1}, {"batch": 8, "ms": 1}], "errors": {"decode": "boom"},
        "prefill_cudagraphs": [{"batch": 8, "seq": 2048, "ms": 3}]}))
    b.write_text(json.dumps({"device": "Y", "section_s": {"compiled": 2}, "decode": [
        {"batch": 8, "ms": 2}], "sections": {"eager": {"rc": 0}},
        "prefill_cudagraphs": [{"batch": 1, "seq": 128, "ms": 4}]}))
    m = gpu.merge_results([a, b])
    assert m["device"] == "Y"
    # one process per shape: the rows are united, a later row of a shape replaces the earlier
    assert m["decode"] == [{"batch": 1, "ms": 1}, {"batch": 8, "ms": 2}]
    assert [(x["batch"], x["seq"]) for x in m["prefill_cudagraphs"]] == [(8, 2048), (1, 128)]
    assert m["section_s"] == {"decode": 1, "compiled": 2} and m["errors"] == {"decode": "boom"}


def _fixture() -> dict:
    """Measured rows of earlier runs, as one run of the runner would merge them: decode from
    the H200 run whose FP8 step skipped its CUDA graph, eager prefill and the memory section
    from the second H200 run, compiled prefill from the H100 run; the targets of now."""
    report = _bench("gpu_fp8_report")
    run1 = _json("gpu_fp8_h200_attention_run1.json")
    run2 = _json("gpu_fp8_h200_attention_run2.json")
    h100 = _json("gpu_fp8_h100_prefill.json")
    return {**run2, "targets": report.TARGETS, "decode": run1["decode"],
            "kv_memory": run2["memory"], "prefill_cudagraphs": h100["prefill_cudagraphs"],
            "versions": {"triton": "3.6.0", "transformers": "5.x"},
            "sections": {"decode": {"seconds": 80, "limit_s": 100, "rc": 0, "timed_out": False},
                         "eager": {"seconds": 30, "limit_s": 50, "rc": 0, "timed_out": False},
                         "memory": {"seconds": 30, "limit_s": 45, "rc": 0, "timed_out": False}},
            "gpu_tests": "12 passed in 40.1s"}


def _targets(md: str) -> dict[str, list[str]]:
    rows = md.split("## Targets")[1].split("\n## ")[0].strip().splitlines()[2:]
    return {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in rows}


def test_report_is_rendered_from_the_json(tmp_path):
    report = _bench("gpu_fp8_report")
    r = _fixture()
    md = tmp_path / "report.md"
    report.write_report(r, md, None)
    text = md.read_text()
    rows = _targets(text)
    t = report.TARGETS
    assert len(rows) == len(t["compiled_prefill"]) + len(t["decode_graphs"]) + \
        len(t["eager_prefill"]) + 1
    # decode: the measured ratio, baseline and FP8 from the same row, and the measured cause
    d1 = next(x for x in r["decode"] if x["batch"] == 1)
    got, met, cause = rows["decode b1, compiled + CUDA graphs ≥ 1.5×"]
    assert got == (f"{d1['speedup_graphs_ms']}× ({d1['bf16_graphs_ms']:.3f} → "
                   f"{d1['fp8_graphs_ms']:.3f} ms per step)")
    assert met == "no" and "skipped its CUDA graph" in cause
    # eager 1x512: missed, host-bound by its own device times
    e = next(x for x in r["prefill_eager"] if (x["batch"], x["seq"]) == (1, 512))
    got, met, cause = rows["eager prefill 1x512 ≥ 0.95×"]
    assert got.startswith(f"{e['speedup_fp8']}×") and met == "no" and "host-bound" in cause
    got, met, _ = rows["max decode batch at a fixed budget ≥ 1.8×"]
    assert got.startswith(f"{r['kv_memory']['max_batch_ratio']}× (38 → 109") and met == "yes"
    # compiled prefill: rows of the H100 run, each met or with its profile's cause
    for shape, want in t["compiled_prefill"].items():
        x = next(x for x in r["prefill_cudagraphs"] if f"{x['batch']}x{x['seq']}" == shape)
        got, met, cause = rows[f"compiled prefill {shape} ≥ {want}×"]
        assert got.startswith(f"{x['speedup_fp8g']}×")
        assert met == ("yes" if x["speedup_fp8g"] >= want else "no")
        assert (cause == "") == (met == "yes") and (met == "yes" or "device time" in cause)
    assert "12 passed in 40.1s" in text and "## Sections of this run" in text


def test_report_says_why_a_target_was_not_measured(tmp_path):
    report = _bench("gpu_fp8_report")
    r = _fixture()
    del r["prefill_cudagraphs"], r["decode"], r["kv_memory"], r["memory"]
    r["sections"]["compiled_8x2048"] = {"seconds": 115, "limit_s": 110, "rc": 124,
                                        "timed_out": True}
    r["sections"]["compiled_1x128"] = {"seconds": 0, "limit_s": 2, "rc": "skipped",
                                       "timed_out": False}
    r["sections"]["decode"] = {"seconds": 0, "limit_s": -3, "rc": "skipped", "timed_out": False}
    r["errors"] = {"kv_memory": "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory"}
    md = tmp_path / "report.md"
    report.write_report(r, md, None)
    rows = _targets(md.read_text())
    assert rows["compiled prefill 8x2048 ≥ 1.6×"][2] == \
        "not measured: the section stopped at its limit of 110 s"
    assert rows["compiled prefill 1x128 ≥ 1.2×"][2] == \
        "not measured: no time was left for it in the call"
    assert rows["compiled prefill 32x512 ≥ 1.6×"][2] == "not measured in this run"
    assert rows["decode b32, compiled + CUDA graphs ≥ 1.35×"][2] == \
        "not measured: no time was left for it in the call"
    assert rows["max decode batch at a fixed budget ≥ 1.8×"][2] == \
        "not measured: torch.OutOfMemoryError: CUDA out of memory"


def _run(tmp_path, env: dict, timeout: float) -> tuple[dict, float]:
    out = tmp_path / "out"
    t0 = time.monotonic()
    subprocess.run(["bash", str(RUNNER)], env={**os.environ, "OUT": str(out), **env},
                   capture_output=True, text=True, timeout=timeout, check=True)
    return json.loads((out / "sections.json").read_text()), time.monotonic() - t0


def test_runner_stops_a_stuck_step_at_the_budget(tmp_path):
    """A step that never ends is killed at its limit, the steps after it get what is left of
    the budget or are skipped, and the call ends within the budget."""
    stuck = tmp_path / "python"
    stuck.write_text("#!/bin/sh\nsleep 60\n")
    stuck.chmod(0o755)
    status, seconds = _run(tmp_path, {"PYTHON": str(stuck), "BUDGET_S": "8",
                                      "REPORT_RESERVE_S": "2"}, timeout=60)
    assert seconds < 8 + 6  # the budget, and timeout's grace before SIGKILL
    s = status["sections"]
    assert s["install"]["timed_out"] and s["install"]["rc"] in (124, 137)
    assert s["install"]["limit_s"] <= 6
    for name in ("gpu_tests", "memory", "decode", "eager", "attention", "compiled_8x2048",
                 "compiled_32x512", "compiled_1x128"):
        assert s[name]["rc"] == "skipped", (name, s[name])


def test_runner_runs_the_steps_asked_for(tmp_path):
    """STEPS picks the steps (no status for the others), COMPILE_SHAPES one process per
    shape, LIMIT_COMPILED the limit of each, GPU_TESTS and BENCH_ARGS what they run."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\n')
    fake.chmod(0o755)
    status, _ = _run(tmp_path, {"PYTHON": str(fake), "BUDGET_S": "60",
                                "STEPS": "gpu_tests,compiled", "COMPILE_SHAPES": "1x128,8x2048",
                                "LIMIT_COMPILED": "7", "LIMIT_COMPILED_8X2048": "9",
                                "GPU_TESTS": "tests/a_gpu.py tests/b_gpu.py",
                                "BENCH_ARGS": "--host-profile"}, timeout=60)
    s = status["sections"]
    assert list(s) == ["gpu_tests", "compiled_1x128", "compiled_8x2048"]
    assert s["compiled_1x128"]["limit_s"] == 7 and s["compiled_8x2048"]["limit_s"] == 9
    assert status["gpu_test_files"] == "tests/a_gpu.py tests/b_gpu.py"
    calls = (tmp_path / "calls").read_text().splitlines()
    assert "tests/a_gpu.py tests/b_gpu.py --junitxml" in calls[0]
    assert calls[1].startswith("bench/gpu_fp8.py --no-logits-check --host-profile --parts "
                               "compiled --compile-shapes 1x128 ")


@pytest.mark.slow  # imports torch twice (~20-60 s on a loaded 2-core machine)
def test_runner_without_a_gpu_writes_the_report(tmp_path):
    env = {"PYTHON": sys.executable, "LIMIT_INSTALL": "0", "LIMIT_GPU_TESTS": "0",
           "LIMIT_MEMORY": "0", "LIMIT_WARM": "0", "LIMIT_COMPILED": "0", "LIMIT_EAGER": "0",
           "LIMIT_ATTENTION": "0"}
    status, _ = _run(tmp_path, env, timeout=300)
    assert status["sections"]["decode"]["rc"] == 1  # gpu_fp8.py: "needs a CUDA GPU"
    text = (tmp_path / "out" / "gpu_fp8_attention.md").read_text()
    rows = _targets(text)
    assert rows["decode b1, compiled + CUDA graphs ≥ 1.5×"][2] == \
        "not measured: the section exited 1 (see its log)"
    assert "needs a CUDA GPU" in (tmp_path / "out" / "decode.log").read_text()


def test_report_names_where_the_host_time_goes(tmp_path):
    """With cProfile tables in a row (--host-profile), the eager target's cause names the
    packages whose own host time grew, and the report carries both tables."""
    report = _bench("gpu_fp8_report")
    r = _fixture()
    e = next(x for x in r["prefill_eager"] if (x["batch"], x["seq"]) == (1, 512))
    e["bf16_host_profile"] = {"host_us_per_call_profiled": 20000.0, "top_own": [],
                              "by_package_us": {"C: torch": 9000.0, "torch/nn": 3000.0}}
    e["fp8_host_profile"] = {"host_us_per_call_profiled": 26000.0, "by_package_us": {
        "C: torch": 11000.0, "torch/nn": 3100.0, "fp8export/runtime": 3900.0}, "top_own": [
            {"function": "fp8_gemm.py:40(fp8_matmul)", "package": "fp8export/runtime",
             "calls": 96.0, "own_us": 900.0, "cum_us": 5000.0}]}
    md = tmp_path / "report.md"
    report.write_report(r, md, None)
    text = md.read_text()
    cause = _targets(text)["eager prefill 1x512 ≥ 0.95×"][2]
    assert "host time under cProfile 20.00 → 26.00 ms per call" in cause
    assert "fp8export/runtime +3.90 ms, C: torch +2.00 ms, torch/nn +0.10 ms" in cause
    assert "| fp8export/runtime | 0 | 3900.0 | +3900.0 |" in text
    assert "`fp8_gemm.py:40(fp8_matmul)`" in text


def test_the_2026_11_29b_report_is_rendered_from_its_json(tmp_path):
    """The issue's target table of the three H200 calls of 2026-11-29 is what the report
    renders from the committed JSON (the merge order its notes give), the notes after it."""
    report = _bench("gpu_fp8_report")
    run = RESULTS / "gpu_attention_h200_2026-11-29b"
    earlier = RESULTS / "gpu_attention_h200_2026-11-29"
    md = tmp_path / "gpu_fp8_attention.md"
    report.main([str(earlier / "memory.json"), str(earlier / "decode.json"),
                 *(str(run / f) for f in ("decode.json", "eager.json", "attention.json",
                                          "compiled_8x2048.json", "compiled_32x512.json",
                                          "compiled_1x128.json", "sections.json")),
                 "--md", str(md), "--notes", str(run / "notes.md")])
    assert md.read_text() == (run / "gpu_fp8_attention.md").read_text()
