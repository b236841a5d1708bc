"""Parallel convert (--workers): identical bytes for any N, errors, interruption, read-back."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import fp8export.fp8dir.parallel_write as pw
from fp8export.convert.config import ConvertConfig
from fp8export.convert.pipeline import convert
from fp8export.errors import Fp8ExportError

REPO = Path(__file__).resolve().parents[2]


def _all_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _digests(folder: Path) -> dict[str, tuple[str, float]]:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime)
            for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def mid_llama(tmp_path_factory) -> Path:
    """A two-shard Llama-named bf16 checkpoint whose weights are larger than the read-back
    samples (so the sampled path, not the whole-tensor one, is checked), plus fp16/fp32."""
    g = torch.Generator().manual_seed(3)
    path = tmp_path_factory.mktemp("ckpt") / "mid-llama"
    path.mkdir()
    hidden, inter = 192, 320
    shards = [{}, {}]
    shards[0]["model.embed_tokens.weight"] = torch.randn(512, hidden, generator=g).bfloat16()
    for i in range(2):
        p = f"model.layers.{i}"
        dtype = (torch.bfloat16, torch.float16)[i]
        t = shards[i]
        for name, shape in (("self_attn.q_proj", (hidden, hidden)),
                            ("self_attn.k_proj", (64, hidden)), ("self_attn.v_proj", (64, hidden)),
                            ("self_attn.o_proj", (hidden, hidden)),
                            ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                            ("mlp.down_proj", (hidden, inter))):
            t[f"{p}.{name}.weight"] = (torch.randn(*shape, generator=g) * 0.02).to(dtype)
        t[f"{p}.input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
    shards[1]["model.norm.weight"] = torch.ones(hidden, dtype=torch.float32)
    shards[1]["lm_head.weight"] = torch.randn(512, hidden, generator=g)
    weight_map = {}
    for i, t in enumerate(shards):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file(t, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(t, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 2, "num_attention_heads": 3,
        "num_key_value_heads": 1, "vocab_size": 512, "tie_word_embeddings": False}))
    return path


@pytest.mark.parametrize("ckpt_name", ["mid_llama", "tiny_llama_sharded"])
def test_output_is_byte_identical_for_any_number_of_workers(ckpt_name, request, tmp_path):
    ckpt = request.getfixturevalue(ckpt_name)
    from fp8export import api

    outs = [Path(convert(ConvertConfig(checkpoint=ckpt, output=tmp_path / f"w{n}",
                                       workers=n)).output) for n in (1, 2, 3)]
    # api.convert (what the CLI calls) reads the source in threads started before torch loads
    early = api.convert(ConvertConfig(checkpoint=ckpt, output=tmp_path / "api", workers=2))
    assert early.timings["hash: sha256 of source"] > 0
    outs.append(Path(early.output))
    one = _all_files(outs[0])
    assert any(n.endswith(".safetensors") for n in one)
    for other in outs[1:]:
        assert _all_files(other) == one
    manifest = json.loads(one["fp8export.json"])
    assert "workers" not in manifest["options"]  # how fast, not what: kept out of the output


def test_parallel_path_matches_the_single_threaded_writer(mid_llama, tmp_path, monkeypatch):
    """The general reader path (one tensor at a time, full digest read-back) writes the same
    bytes as the parallel one: forcing it by hiding the safetensors files from convert."""
    import fp8export.convert.pipeline as conv

    fast = convert(ConvertConfig(checkpoint=mid_llama, output=tmp_path / "fast", workers=2))
    monkeypatch.setattr(conv, "fast_path_files", lambda ckpt: None)
    slow = convert(ConvertConfig(checkpoint=mid_llama, output=tmp_path / "slow"))
    assert _all_files(Path(fast.output)) == _all_files(Path(slow.output))
    assert {k for k in fast.timings if k.startswith("write:")} >= {
        "write: quantize + SQNR", "write: read source"}


def _manifest_sources(folder: Path) -> dict[str, str]:
    man = json.loads((folder / "fp8export.json").read_text())
    return {e["name"]: e["sha256"] for e in man["source"]["files"]}


@pytest.mark.parametrize("workers", [1, 3])
def test_source_hashes_come_from_the_writers_reads(mid_llama, tmp_path, monkeypatch, workers):
    """No separate hashing pass over the weight files: the writer's reads give each file's
    sha256, which is sha256sum's (the index, not read by the writer, is hashed whole)."""
    import fp8export.convert.source_scan as scan

    def no_second_pass(*args, **kwargs):
        raise AssertionError("a weight file was read again for its sha256")

    monkeypatch.setattr(scan, "_sha256_fd", no_second_pass)
    out = Path(convert(ConvertConfig(checkpoint=mid_llama, output=tmp_path / "o",
                                     workers=workers)).output)
    files = sorted(p for p in mid_llama.iterdir() if p.suffix == ".safetensors" or
                   p.name.endswith(".index.json"))
    assert len(files) == 3
    assert _manifest_sources(out) == {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                      for p in files}


def test_a_file_the_writer_does_not_read_in_order_is_hashed_on_its_own(mid_llama, tmp_path,
                                                                         monkeypatch):
    monkeypatch.setattr(pw, "in_byte_order", lambda plan, st: False)
    out = Path(convert(ConvertConfig(checkpoint=mid_llama, output=tmp_path / "o",
                                     workers=2)).output)
    assert _manifest_sources(out) == {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in mid_llama.iterdir()
        if p.suffix == ".safetensors" or p.name.endswith(".index.json")}


def test_an_error_in_a_worker_is_one_clear_error_naming_the_tensor(mid_llama, tmp_path,
                                                                  monkeypatch):
    import threading

    real = pw._Writer._weight
    target = "model.layers.1.mlp.up_proj.weight"
    seen = []

    def failing(self, job, fd):
        if job.entry.tensor.name == target:
            seen.append(threading.current_thread().name)
            raise RuntimeError("simulated failure inside a worker")
        return real(self, job, fd)

    monkeypatch.setattr(pw._Writer, "_weight", failing)
    with pytest.raises(Fp8ExportError) as err:
        convert(ConvertConfig(checkpoint=mid_llama, output=tmp_path / "out", workers=2))
    msg = str(err.value)
    assert f"converting tensor {target!r} failed" in msg
    assert "simulated failure inside a worker" in msg and "nothing was written" in msg
    assert seen and seen[0].startswith("fp8export-convert")  # it did happen in a worker
    assert list(tmp_path.iterdir()) == []


def test_disk_full_in_a_worker_names_the_tensor_and_leaves_nothing(mid_llama, tmp_path,
                                                                   monkeypatch):
    real = pw._pwrite_all

    def full(fd, data, offset):
        if len(memoryview(data).cast("B")) > 10_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(pw, "_pwrite_all", full)
    with pytest.raises(Fp8ExportError) as err:
        convert(ConvertConfig(checkpoint=mid_llama, output=tmp_path / "out", workers=2))
    msg = str(err.value)
    assert "No space left on device" in msg and "writing tensor 'model." in msg
    assert list(tmp_path.iterdir()) == []


def test_read_back_catches_a_wrong_byte_in_a_sample(mid_llama, tmp_path, monkeypatch):
    real = pw._Writer._write_out
    target = "model.layers.0.mlp.gate_proj.weight"

    def corrupt(self, job, fd, data):
        if job.entry.tensor.name == target:
            data = data.copy()
            data[len(data) // 2 + 7] ^= 0x01  # inside the middle sample
        return real(self, job, fd, data)

    monkeypatch.setattr(pw._Writer, "_write_out", corrupt)
    with pytest.raises(Fp8ExportError, match="read-back verification") as err:
        convert(ConvertConfig(checkpoint=mid_llama, output=tmp_path / "out", workers=2))
    assert target in str(err.value)
    assert list(tmp_path.iterdir()) == []


def _big_checkpoint(path: Path) -> Path:
    """~200 MB of bf16 Llama weights (a repeated random block: cheap to make, slow enough to
    convert that a signal lands mid-way)."""
    path.mkdir()
    block = (torch.randn(2048, 2048, generator=torch.Generator().manual_seed(0)) * 0.02)
    block = block.bfloat16()
    weight_map = {}
    for s in range(2):
        tensors = {}
        for i in range(3 * s, 3 * s + 3):
            for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"):
                tensors[f"model.layers.{i}.{m}.weight"] = block.clone()
        name = f"model-0000{s + 1}-of-00002.safetensors"
        save_file(tensors, str(path / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "num_hidden_layers": 6}))
    return path


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_a_signal_mid_convert_leaves_no_output_and_the_input_untouched(sig, tmp_path):
    ckpt = _big_checkpoint(tmp_path / "ckpt")
    before = _digests(ckpt)
    out = tmp_path / "out"
    env = dict(os.environ, CI="1", PYTHONPATH=str(REPO))
    # SIGINT's default disposition in the child even when this test runs as a background job
    # (which inherits SIGINT ignored, and a Python child keeps it ignored)
    proc = subprocess.Popen([sys.executable, "-m", "fp8export.cli", "convert", str(ckpt), "-o",
                             str(out), "--workers", "2"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    try:
        # Wait until the shards exist in the hidden temporary folder: the workers are writing.
        while time.monotonic() < deadline and proc.poll() is None:
            tmp = [p for p in tmp_path.glob(".out.tmp-*") if list(p.glob("*.safetensors"))]
            if tmp:
                break
            time.sleep(0.002)
        assert proc.poll() is None, "convert finished before it could be interrupted"
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert not out.exists()
    assert _digests(ckpt) == before  # not one byte or timestamp of the input changed
    if sig == signal.SIGINT:  # Python ran the cleanup: the temporary folder is gone too
        assert list(tmp_path.glob(".out.tmp-*")) == []
    # After SIGKILL the hidden temporary folder may remain; the next run still succeeds.
    res = convert(ConvertConfig(checkpoint=ckpt, output=out, workers=2))
    assert res.quantized == 24 and out.is_dir()


@pytest.mark.parametrize("dtype,st", [(torch.bfloat16, "BF16"), (torch.float16, "F16")])
def test_amax_from_bit_patterns_is_the_float_max_for_every_value(dtype, st):
    from fp8export.convert.source_scan import _bits_to_amax, _magnitude_bits

    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = every[torch.isfinite(every)]
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # random subsets: positives only, negatives only, mixed, subnormals
        x = finite[torch.randint(0, finite.numel(), (int(torch.randint(1, 50, (1,), generator=g)),),
                                 generator=g)]
        if torch.rand(1, generator=g) < 0.3:
            x = x.abs() * (1 if torch.rand(1, generator=g) < 0.5 else -1)
        raw = x.contiguous().view(torch.uint8).numpy()
        assert _bits_to_amax(_magnitude_bits(raw, st), st) == float(x.float().abs().max())
    raw = lambda t: t.view(torch.uint8).numpy()  # noqa: E731
    inf = torch.tensor([1.0, -float("inf")], dtype=dtype)
    assert _bits_to_amax(_magnitude_bits(raw(inf), st), st) == float("inf")
    nan = torch.tensor([1.0, float("nan"), -2.0], dtype=dtype)
    assert _bits_to_amax(_magnitude_bits(raw(nan), st), st) != _bits_to_amax(
        _magnitude_bits(raw(nan), st), st)  # NaN
    assert _bits_to_amax(_magnitude_bits(raw(torch.zeros(3, dtype=dtype)), st), st) == 0.0
    assert _bits_to_amax(_magnitude_bits(raw(-torch.zeros(3, dtype=dtype)), st), st) == 0.0


def test_f32_amax_from_bit_patterns():
    from fp8export.convert.source_scan import _bits_to_amax, _magnitude_bits

    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1)) * 1e-3
    x[17] = -0.75
    assert _bits_to_amax(_magnitude_bits(x.view(torch.uint8).numpy(), "F32"), "F32") == 0.75
