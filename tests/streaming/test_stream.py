"""Layer streaming computes what the whole model computes (fp8export/streaming/): every batch's
logits bit-identical, for dense, MoE, sliding-window and GPT-2 models, the hidden states on the
device, in host memory or in a spill file, one layer or several per block."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "families"))

from model_families import save_family  # noqa: E402

# every tier on one family, every family on one tier (the tiers do not touch the numbers)
CASES = [("llama", "device", 2), ("llama", "host", 1), ("llama", "spill", 1),
         ("llama-tied", "spill", 1), ("mixtral", "host", 1), ("qwen3-moe", "device", 1),
         ("gemma3", "spill", 1), ("gpt2", "device", 1)]
_SAVED: dict[str, Path] = {}


def _family(name: str, tmp_path_factory) -> Path:
    if name not in _SAVED:
        _SAVED[name] = save_family(name, tmp_path_factory.mktemp(name) / "src")
    return _SAVED[name]


def _batches():
    from fp8export.inputs.samples import Samples, iter_batches

    g = torch.Generator().manual_seed(0)
    ids = [tuple(torch.randint(3, 1900, (n,), generator=g).tolist()) for n in (9, 17, 5, 12, 3)]
    return list(iter_batches(Samples(source=Path("x"), input_ids=tuple(ids), pad_id=0), 2))


def _streamed(parts, batches, tier, per_block, tmp_path, device="cpu"):
    from fp8export.streaming.stream import Blocks, Stream, each_block

    stream = Stream(parts, batches, torch.device(device), tier=tier, spill_dir=tmp_path)
    try:
        stream.capture()
        with Blocks(parts, per_block, torch.device(device)) as blocks:
            for _k, block in each_block(blocks, "test"):
                stream.run(block)
        with stream.tail() as logits:
            return [logits(b).logits for b in range(len(batches))]
    finally:
        stream.close()


@pytest.mark.parametrize("name,tier,per_block", CASES)
def test_streamed_logits_equal_the_whole_model(name, tier, per_block, tmp_path,
                                               tmp_path_factory):
    from fp8export.models import load_model
    from fp8export.moe import unfuse_experts
    from fp8export.streaming.parts import CheckpointParts

    family = _family(name, tmp_path_factory)
    batches = _batches()
    model, _ = load_model(family)
    unfuse_experts(model)
    with torch.inference_mode():
        want = [model(input_ids=b.input_ids, attention_mask=b.attention_mask,
                      use_cache=False).logits for b in batches]
    with CheckpointParts(family, experts="routed") as parts:
        got = _streamed(parts, batches, tier, per_block, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert not list(tmp_path.iterdir())  # the spill file is gone


@pytest.mark.gpu
@pytest.mark.parametrize("name,tier", [("llama", "device"), ("llama", "host"),
                                       ("llama", "spill"), ("mixtral", "host")])
def test_streamed_logits_equal_the_whole_model_on_the_gpu(name, tier, tmp_path,
                                                          tmp_path_factory):
    """On a GPU the layers' weights and the host tier's hidden states move with copies the
    host does not wait for (page-locked memory, a side stream): the logits stay the whole
    model's, bit for bit."""
    from fp8export.models import load_model
    from fp8export.moe import unfuse_experts
    from fp8export.streaming.parts import CheckpointParts

    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    family = _family(name, tmp_path_factory)
    batches = _batches()
    model, _ = load_model(family, device="cuda")
    unfuse_experts(model)
    with torch.inference_mode():
        want = [model(input_ids=b.input_ids.cuda(), attention_mask=b.attention_mask.cuda(),
                      use_cache=False).logits for b in batches]
    del model
    with CheckpointParts(family, experts="routed") as parts:
        got = _streamed(parts, batches, tier, 1, tmp_path, "cuda")
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_fp8_folder_streams_as_the_fp8_runtime_runs_it(tmp_path):
    """An FP8 folder (fused q/k/v and gate/up, static inputs) streamed through its layers
    gives the FP8 runtime's whole-model logits."""
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig
    from fp8export.runtime.fp8_model import load_fp8_model
    from fp8export.streaming.parts import Fp8FolderParts

    src = save_family("llama", tmp_path / "src")
    data = Path(__file__).resolve().parents[2] / "samples" / "tiny-llama" / "data" / "calib.txt"
    convert(ConvertConfig(checkpoint=src, output=tmp_path / "fp8", calib_data=data,
                          calib_samples=8, device="cpu", kv_cache="fp8"))
    batches = _batches()
    model = load_fp8_model(tmp_path / "fp8", mode="emulate")[0]
    with torch.inference_mode():
        want = [model(input_ids=b.input_ids, attention_mask=b.attention_mask,
                      use_cache=False).logits for b in batches]
    with Fp8FolderParts(tmp_path / "fp8", torch.bfloat16, "emulate") as parts:
        assert parts.kv and len(parts.groups) == 4
        got = _streamed(parts, batches, "device", 1, tmp_path / "fp8")
        assert not parts.unfused
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_a_layer_is_freed_with_its_last_reference(tmp_path):
    """A built layer holds no reference cycle (the CPU GEMM's forward included): its weights
    leave the device when the block's list lets it go, not when the collector next runs."""
    import gc
    import weakref

    from fp8export.streaming.parts import CheckpointParts

    with CheckpointParts(save_family("llama", tmp_path / "src")) as parts:
        gc.collect()
        gc.disable()
        try:
            layer = parts.build_layer(0, torch.device("cpu"))
            refs = [weakref.ref(m) for m in layer.modules()]
            del layer
            assert not [r() for r in refs if r() is not None]
        finally:
            gc.enable()


def test_one_block_at_a_time_on_the_device(tmp_path, monkeypatch):
    """calibrate, GPTQ and verify drop a block's modules before the next is built (a module kept
    by a loop variable or a hook would double the layers on the device)."""
    from fp8export.api import calibrate, convert, verify
    from fp8export.calibration.config import CalibrateConfig
    from fp8export.convert.config import ConvertConfig
    from fp8export.streaming.stream import Blocks
    from fp8export.verify.config import VerifyConfig

    alive_at_build = []
    build = Blocks.build

    def checked(self, k):
        alive_at_build.append(self.alive())
        return build(self, k)

    monkeypatch.setattr(Blocks, "build", checked)
    src = save_family("llama", tmp_path / "src")
    data = Path(__file__).resolve().parents[2] / "samples" / "tiny-llama" / "data" / "calib.txt"
    common = dict(calib_data=data, calib_samples=8, batch_size=4, device="cpu", offload="layers")
    calibrate(CalibrateConfig(checkpoint=src, output=tmp_path / "amax.json", **common))
    convert(ConvertConfig(checkpoint=src, output=tmp_path / "fp8", weight_rounding="gptq",
                          **common))
    verify(VerifyConfig(reference=src, candidate=tmp_path / "fp8", data=data, samples=4,
                        seq_len=16, device="cpu", offload="layers", write_reports=False,
                        thresholds="loose"))
    # two layers: calibrate; convert calibrates and rounds; verify streams three models
    assert len(alive_at_build) == 2 + 2 * 2 + 3 * 2
    assert set(alive_at_build) == {0}
