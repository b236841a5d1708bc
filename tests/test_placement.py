"""fp8export.placement: ``--max-memory`` parsing, and a model spread over devices computing
exactly what it computes on one (CPU here: part of the model offloaded to disk, streamed back
each forward through accelerate's hooks; tests/calibration/test_gpu.py splits over 2 GPUs)."""

from __future__ import annotations

import importlib.util

import pytest

from fp8export.errors import Fp8ExportError, UsageError
from fp8export.placement import parse_max_memory

needs_accelerate = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                      reason="optional dependency accelerate not installed")


def test_parse_max_memory_units_and_devices():
    got = parse_max_memory("0=70GiB, 1=1.5GB,cpu=100MiB,disk=2TB")
    assert got == {0: 70 << 30, 1: 1_500_000_000, "cpu": 100 << 20, "disk": 2 * 10**12}
    assert parse_max_memory(None) == {} and parse_max_memory(" ") == {}
    assert parse_max_memory("CPU=512") == {"cpu": 512}


@pytest.mark.parametrize("text, says", [
    ("0:70GiB", "DEVICE=SIZE"), ("0=70 parsecs", "DEVICE=SIZE"), ("gpu0=1GiB", "unknown"),
    ("0=1GiB,0=2GiB", "twice"), ("0=0GiB", "above 0"), ("=1GiB", "DEVICE=SIZE"),
])
def test_parse_max_memory_refuses_with_the_part_named(text, says):
    with pytest.raises(UsageError, match=says):
        parse_max_memory(text)


def test_config_refuses_bad_max_memory_before_any_work(tmp_path):
    from fp8export.calibration.config import CalibrateConfig
    from fp8export.verify.config import VerifyConfig

    with pytest.raises(UsageError, match="--max-memory"):
        CalibrateConfig(checkpoint=tmp_path, calib_data=tmp_path / "x.txt", max_memory="0=lots")
    with pytest.raises(UsageError, match="--max-memory"):
        VerifyConfig(reference=tmp_path, candidate=tmp_path, max_memory="cuda=1GiB")


def test_gpu_budget_with_device_cpu_is_an_error():
    from fp8export.placement import budgets

    with pytest.raises(Fp8ExportError, match="--device is cpu"):
        budgets("cpu", 0, {0: 1 << 30})
    assert budgets("cpu", 10 << 30, None) is None  # no budgets, no GPU: one device


def test_remaining_budget_for_a_second_model():
    from fp8export.placement import Placement

    p = Placement(device_map={"a": 0, "b": 1}, main_device="cuda:0",
                  bytes_per_device={"cuda:0": 3 << 30, "cuda:1": 5 << 30})
    assert p.remaining({0: 4 << 30, 1: 5 << 30, "cpu": 8 << 30}) == {0: 1 << 30, 1: 0,
                                                                      "cpu": 8 << 30}


@needs_accelerate
def test_calibrate_spread_to_disk_gives_bit_identical_amax(repo_root):
    """A 6-layer Llama with a 6 MiB host budget: some decoder layers on 'disk' (streamed from
    a temporary folder each forward). Every amax and histogram-based result is identical."""
    from fp8export.calibration.api import calibrate
    from fp8export.calibration.config import CalibrateConfig

    model = repo_root / "samples" / "tiny-llama" / "model"
    data = repo_root / "samples" / "tiny-llama" / "data" / "calib.txt"
    common = dict(checkpoint=model, calib_data=data, device="cpu", calib_samples=12, seq_len=48,
                  batch_size=4, calib_method="percentile")
    one = calibrate(CalibrateConfig(**common))
    spread = calibrate(CalibrateConfig(**common, max_memory="cpu=6MiB", offload="none"))
    assert one.device == "cpu" and spread.device == "cpu,disk"
    assert any("spread over 2 devices" in n for n in spread.notes)
    assert len(one.amax) == 42 and spread.amax == one.amax
    assert spread.observed_amax == one.observed_amax and spread.details == one.details


@needs_accelerate
def test_spread_model_loads_every_layer_on_its_planned_device(repo_root):
    import torch

    from fp8export.models import load_model_spread

    model, config, placed = load_model_spread(repo_root / "samples" / "tiny-llama" / "model",
                                              {"cpu": 6 << 20}, dtype=torch.bfloat16)
    try:
        devices = set(placed.device_map.values())
        assert devices == {"cpu", "disk"} and placed.main_device == "cpu"
        on_disk = [m for m, d in placed.device_map.items() if d == "disk"]
        tail = ("model.layers.", "model.norm", "model.rotary", "lm_head")
        assert all(m.startswith(tail) for m in on_disk)
        assert on_disk and placed.describe()["devices"].keys() == {"cpu", "disk"}
        assert config["num_hidden_layers"] == 6
    finally:
        placed.close()
    assert placed.offload_dir is None


@needs_accelerate
@pytest.mark.gpu
def test_two_gpu_split_matches_one_gpu(repo_root, tmp_path):
    """The sample Llama calibrated and verified on GPU 0, then split over GPUs 0 and 1: amax
    bit for bit, verify metrics within float noise (bench/multi_gpu.py does this at 1.1 B)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from fp8export import api
    from fp8export.calibration.config import CalibrateConfig
    from fp8export.convert.config import ConvertConfig
    from fp8export.verify.config import VerifyConfig

    model = repo_root / "samples" / "tiny-llama" / "model"
    data = repo_root / "samples" / "tiny-llama" / "data"
    common = dict(checkpoint=model, calib_data=data / "calib.txt", device="cuda",
                  calib_samples=32, seq_len=128, calib_method="percentile")
    one = api.calibrate(CalibrateConfig(**common))
    split = api.calibrate(CalibrateConfig(**common, max_memory="0=4MiB,1=1GiB"))
    assert one.device == "cuda" and split.device == "cuda:0,cuda:1"
    assert split.amax == one.amax and split.details == one.details
    api.convert(ConvertConfig(checkpoint=model, output=tmp_path / "fp8", calib_samples=32,
                              calib_data=data / "calib.txt", device="cuda"))
    runs = []
    for mm in (None, "0=8MiB,1=1GiB"):
        runs.append(api.verify(VerifyConfig(
            reference=model, candidate=tmp_path / "fp8", data=data / "eval.txt", device="cuda",
            samples=32, seq_len=128, per_layer=True, max_memory=mm, write_reports=False)))
    a, b = runs
    assert b.reference["device"] == "cuda:0,cuda:1" and b.candidate["device"] == "cuda:0,cuda:1"
    for key in ("cosine_mean", "cosine_min", "kl_mean", "top1_agreement", "ppl_candidate"):
        assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-5, abs=1e-7), key
    assert [r["module"] for r in b.per_layer] == [r["module"] for r in a.per_layer]


@pytest.mark.parametrize("command", ["calibrate", "verify"])
def test_cli_bad_max_memory_is_a_usage_error(run_cli, repo_root, command):
    model = repo_root / "samples" / "tiny-llama" / "model"
    data = repo_root / "samples" / "tiny-llama" / "data" / "calib.txt"
    args = [model, "--calib-data", data] if command == "calibrate" else [model, model]
    result = run_cli(command, *args, "--max-memory", "0:70GiB")
    assert result.exit_code == 2, result.output
    assert "--max-memory" in result.output and "DEVICE=SIZE" in result.output


def test_resolve_device():
    import torch

    from fp8export.placement import resolve_device

    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UsageError, match="--device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(Fp8ExportError, match="no CUDA GPU"):
            resolve_device("cuda")


@needs_accelerate
def test_load_model_placed_picks_one_device_or_the_spread(repo_root):
    import torch

    from fp8export.models import load_model_placed

    path = repo_root / "samples" / "tiny-llama" / "model"
    model, config, placed = load_model_placed(path, "cpu", dtype=torch.bfloat16)
    assert placed is None and {p.device.type for p in model.parameters()} == {"cpu"}
    _, _, placed = load_model_placed(path, "cpu", {"cpu": 6 << 20}, dtype=torch.bfloat16)
    try:
        assert set(placed.device_map.values()) == {"cpu", "disk"}
    finally:
        placed.close()
