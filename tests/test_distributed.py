"""Data parallel over torch.distributed (fp8export/distributed.py): shares, exact reductions,
and real torchrun jobs with gloo on CPU: 1, 2 (as two hosts) and 4 ranks give the same bytes and
metrics; a rank that fails or hangs stops every rank with one Error line naming it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8export.distributed import SLOTS, Comm, SlotSums, slot_ranges

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "distributed_worker.py"
sys.path.insert(0, str(TESTS / "calibration"))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 5, 8, 13, 64])
def test_shares_are_contiguous_whole_slots_covering_every_batch(world, n):
    shares = [Comm(rank=r, world=world).share(n) for r in range(world)]
    assert [b for s in shares for b in s] == list(range(n))
    starts = {r.start for r in slot_ranges(n, SLOTS)} | {n}
    assert all(s.start in starts and s.stop in starts for s in shares if len(s))


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("on_device", [False, True])
def test_slot_sums_fold_the_slots_in_one_fixed_tree(on_device, where):
    """One process: batch partials per slot, then ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)), on the
    host or (``on_device``) where the partials were summed: the same bits."""
    g = torch.Generator().manual_seed(0)
    n = 11
    xs = [(torch.randn(5, 3, generator=g) * 10 ** torch.randint(-3, 4, (1,), generator=g))
          .to(where) for _ in range(n)]
    sums = SlotSums(Comm(), n, on_device=on_device)
    for b, x in enumerate(xs):
        sums.begin_batch(b)
        sums.accumulator("k", torch.empty(3, 3, device=where)).addmm_(x.t(), x)
    got = sums.total(["k"], {"k": (3, 3)})["k"]
    assert got.device.type == (where if on_device else "cpu")
    slots = []
    for r in slot_ranges(n, SLOTS):
        acc = None
        for b in r:
            acc = torch.zeros(3, 3, device=where) if acc is None else acc
            acc.addmm_(xs[b].t(), xs[b])
        slots.append(acc.cpu() if acc is not None else None)

    def fold(lo, hi):
        if hi - lo == 1:
            return slots[lo]
        a, b = fold(lo, (lo + hi) // 2), fold((lo + hi) // 2, hi)
        return a if b is None else b if a is None else a + b

    assert torch.equal(got.cpu(), fold(0, SLOTS))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**more) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "FP8EXPORT_NO_PROGRESS": "1",
            "PYTHONPATH": str(TESTS.parent), **more}


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


@pytest.fixture(scope="module")
def job_inputs(tmp_path_factory):
    import random

    from calib_fixtures import WORDS, build_tiny_llama

    root = tmp_path_factory.mktemp("dp")
    src = build_tiny_llama(root / "tiny-llama")
    rng = random.Random(0)
    data = root / "calib.txt"
    data.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))
                              for _ in range(24)) + "\n", encoding="utf-8")
    return src, data


def _files(out: Path) -> dict[str, object]:
    """What a job wrote, as compared: amax.json and the shards byte for byte, the manifest
    without its timings, the report's numbers."""
    def untimed(x):
        if isinstance(x, dict):
            return {k: untimed(v) for k, v in x.items() if k not in ("seconds", "offload")}
        return [untimed(v) for v in x] if isinstance(x, list) else x

    report = json.loads((out / "report" / "report.json").read_text())
    return {"amax": (out / "amax.json").read_bytes(),
            "shards": {p.name: p.read_bytes() for p in sorted((out / "fp8").glob("*.safetensors"))},
            "manifest": untimed(json.loads((out / "fp8" / "fp8export.json").read_text())),
            "report": {k: report[k] for k in ("passed", "metrics", "noise_floor", "confidence",
                                               "per_sample", "worst_samples", "checks")}}


def _without_layer_check(files: dict) -> dict:
    report = dict(files["report"])
    report["metrics"] = {k: v for k, v in report["metrics"].items() if k != "layer_sqnr_min"}
    report["checks"] = [c for c in report["checks"] if c.get("metric") != "layer_sqnr_min"]
    return {**files, "report": report}


@pytest.mark.slow
def test_one_two_and_four_ranks_give_the_same_bytes_and_metrics(job_inputs, tmp_path):
    """calibrate + convert (GPTQ, FP8 KV cache) + verify: alone, as two hosts of one rank each
    (two torchrun node groups over TCP rendezvous, layer streaming) and as four ranks on one
    host (whole model): the same bytes and report (the streamed run's layer check aside)."""
    src, data = job_inputs
    alone = tmp_path / "one"
    subprocess.run([sys.executable, str(WORKER), "run", str(alone), str(src), str(data),
                    "auto"], env=_env(), check=True, timeout=900)
    two = tmp_path / "two"
    port = _free_port()
    nodes = [subprocess.Popen(_torchrun("--nnodes=2", "--nproc-per-node=1",
                                        f"--node-rank={i}", "--rdzv-backend=c10d",
                                        f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=fp8dp",
                                        str(WORKER), "run", str(two), str(src), str(data),
                                        "layers"),
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    for p in nodes:
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0, out[-3000:]
    four = tmp_path / "four"
    ran = subprocess.run(_torchrun("--standalone", "--nproc-per-node=4", str(WORKER), "run",
                                   str(four), str(src), str(data), "auto"),
                         env=_env(), capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    want = _files(alone)
    assert _files(four) == want
    # layer streaming under torchrun: rank 0 runs the layer check on its own share (the run's
    # first batches; here fewer than the check's 2,048 tokens), so its worst layer may differ
    # a little from one process's; everything else is identical
    got = _files(two)
    assert _without_layer_check(got) == _without_layer_check(want)
    assert got["report"]["metrics"]["layer_sqnr_min"] == pytest.approx(
        want["report"]["metrics"]["layer_sqnr_min"], abs=1.0)
    assert want["report"]["passed"] and want["manifest"]["weight_rounding"]["layers"] == 14


def _failing(tmp_path, src, data, **env):
    return subprocess.run(_torchrun("--standalone", "--nproc-per-node=2", str(WORKER), "cli",
                                    "calibrate", str(src), "--calib-data", str(data), "-o",
                                    str(tmp_path / "amax.json"), "--device", "cpu",
                                    "--batch-size", "3", "--offload", "layers"),
                          env=_env(FP8EXPORT_TEST_FAULT_RANK="1", **env), capture_output=True,
                          text=True, timeout=600)


def _errors(ran) -> list[str]:
    return [line for line in (ran.stdout + ran.stderr).splitlines()
            if line.startswith("Error:")]


@pytest.mark.slow
def test_a_failing_rank_stops_every_rank_with_one_error_line_naming_it(job_inputs, tmp_path):
    src, data = job_inputs
    ran = _failing(tmp_path, src, data)
    assert ran.returncode != 0
    errors = _errors(ran)
    assert errors == ["Error: rank 1 of 2 failed: injected failure building layer 1"], \
        ran.stdout[-2000:] + ran.stderr[-3000:]
    assert not (tmp_path / "amax.json").exists()


@pytest.mark.slow
def test_a_rank_that_stops_answering_is_reported_within_the_timeout(job_inputs, tmp_path):
    src, data = job_inputs
    ran = _failing(tmp_path, src, data, FP8EXPORT_TEST_FAULT="hang", FP8EXPORT_DIST_TIMEOUT="10")
    assert ran.returncode != 0
    errors = _errors(ran)
    assert len(errors) == 1 and "rank 0 of 2: the other ranks stopped answering" in errors[0] \
        and "10 s" in errors[0], ran.stdout[-2000:] + ran.stderr[-3000:]
