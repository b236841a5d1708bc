"""The newer families (``next_families.py``) through the pipeline, as transformers saves them.

Each tiny model: ``convert --scales calibrate`` on text (the language tower), then ``verify``
of the folder with the FP8 runtime, whose quantized linears must all be ``Fp8Linear`` with E4M3
weights and must run (hooks count their calls); the default selection keeps what the peers keep
(vision towers, projectors, routers, recurrent mixers). LLaVA and Whisper also run with image
and audio data through their own processors. Llama 4 is refused by name (transformers 5.2x
cannot run its forward), Whisper on text-only data too (its encoder reads audio).
``export-onnx`` of every family is measured by ``bench/families.py`` (minutes for the hybrids,
which it refuses after the trace); here it runs for LLaVA, DeepSeek-V3 and gpt-oss (3-D
experts), and Whisper's is refused before any trace. Every model is converted once per session
(``next_fp8`` in conftest.py).
"""

from __future__ import annotations

import json
import re

import pytest
from next_families import NEXT_FAMILIES, VLM_FAMILIES
from test_family_matrix import THRESHOLDS

from tests.conftest import REPO

DATA = REPO / "samples" / "tiny-llama" / "data"
RUNS = [f for f in NEXT_FAMILIES if f not in ("llama4", "whisper")]
# what each family keeps in high precision by default, by a name of the module's path
KEPT = {"qwen2.5-vl": r"\bvisual\.", "qwen3-vl": r"\bvisual\.", "qwen3-vl-moe": r"\bvisual\.",
        "gemma3-vl": r"\bvision_tower\.", "mllama": r"\bmulti_modal_projector$",
        "llava": r"\bvision_tower\.", "idefics3": r"\bconnector\.", "deepseek-v3": r"\.mlp\.gate$",
        "gpt-oss": r"\.mlp\.router$", "qwen3-next": r"\.linear_attn\.",
        "jamba": r"\.mamba\.dt_proj$"}


def _convert(src, out, data=DATA / "calib.txt", samples=16, **kw):
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig

    return convert(ConvertConfig(checkpoint=src, output=out, scales="calibrate",
                                 calib_data=data, calib_samples=samples, seq_len=64, **kw))


def _verify(src, cand, tmp_path, data=DATA / "eval.txt", samples=8):
    from fp8export.api import verify
    from fp8export.verify.config import VerifyConfig

    tmp_path.mkdir(parents=True, exist_ok=True)
    thresholds = tmp_path / "thresholds.json"
    thresholds.write_text(json.dumps(THRESHOLDS))
    return verify(VerifyConfig(reference=src, candidate=cand, data=data, samples=samples,
                               seq_len=64, report_dir=tmp_path / "report", noise_floor=False,
                               device="cpu", thresholds=str(thresholds)))


def _fp8_calls(folder, ids):
    """Every quantized linear of the folder as the runtime builds it, and how often each ran on
    ``ids``; checks each holds E4M3 weights."""
    import torch

    from fp8export.runtime.fp8_model import fp8_modules, load_fp8_model

    model, _config, manifest, _info = load_fp8_model(folder, mode="emulate")
    mods = fp8_modules(model)
    assert len(mods) == len(manifest["quantized"])
    calls = dict.fromkeys(mods, 0)
    for name, mod in mods.items():
        assert mod.weight.dtype == torch.float8_e4m3fn, name
        mod.register_forward_hook(lambda m, a, o, n=name: calls.__setitem__(n, calls[n] + 1))
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), use_cache=False)
    return calls


@pytest.mark.parametrize("family", RUNS)
def test_next_family_pipeline(family, next_dir, next_fp8, tmp_path):
    src, fp8 = next_dir(family), next_fp8(family)
    manifest = json.loads((fp8 / "fp8export.json").read_text())
    quantized = manifest["quantized"]
    # text alone never reaches Mllama's cross-attention layer: dynamic there, said in a note
    assert quantized and manifest["activation_scheme"] == ("mixed" if family == "mllama"
                                                           else "static")
    ignore = json.loads((fp8 / "config.json").read_text())["quantization_config"]["ignore"]
    assert any(re.search(KEPT[family], m) for m in ignore), (family, ignore)
    assert not any(re.search(KEPT[family], m) for m in quantized)
    calibrated = {m for m, e in quantized.items() if e["input_scale_source"] == "calibration"}
    if family == "mllama":
        assert calibrated == {m for m in quantized if ".layers.1." not in m}
    else:
        assert calibrated == set(quantized)
    res = _verify(src, fp8, tmp_path)
    assert res.passed, (family, res.failures)
    calls = _fp8_calls(fp8, list(range(3, 40)))
    ran = {n for n, c in calls.items() if c}
    # Mllama's cross-attention decoder layer (layer 1) is skipped whole on text alone
    expected = {n for n in calls if family != "mllama" or ".layers.1." not in n}
    assert ran == expected, sorted(set(calls) - ran)


def test_mla_and_cross_attention_groups(next_dir):
    """vLLM's fused-scale groups: MLA's q_a_proj + kv_a_proj_with_mqa (its fused_qkv_a_proj),
    cross-attention k/v without q (its QKVCrossParallelLinear), Whisper's encoder_attn alike."""
    from fp8export.checkpoint.source import open_checkpoint
    from fp8export.scales.select import select_targets

    def groups(family):
        with open_checkpoint(next_dir(family)) as ckpt:
            return select_targets(ckpt.tensors(), ckpt.config).groups

    ds = groups("deepseek-v3")
    assert ds["model.layers.0.self_attn.qkv_a"] == ["model.layers.0.self_attn.kv_a_proj_with_mqa",
                                                    "model.layers.0.self_attn.q_a_proj"]
    ml = groups("mllama")
    cross = "language_model.model.layers.1.cross_attn"
    assert ml[f"{cross}.kv"] == [f"{cross}.k_proj", f"{cross}.v_proj"]
    assert not any(f"{cross}.q_proj" in m for g in ml.values() for m in g)
    wh = groups("whisper")
    assert wh["model.decoder.layers.0.encoder_attn.kv"] == [
        "model.decoder.layers.0.encoder_attn.k_proj", "model.decoder.layers.0.encoder_attn.v_proj"]
    assert len(wh["model.encoder.layers.0.self_attn.qkv"]) == 3


def test_include_puts_the_vision_tower_in_fp8(next_dir, tmp_path):
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig

    out = tmp_path / "fp8"
    convert(ConvertConfig(checkpoint=next_dir("qwen2.5-vl"), output=out, scales="weights",
                          include=("visual.*",)))
    quantized = json.loads((out / "fp8export.json").read_text())["quantized"]
    assert "visual.blocks.0.attn.qkv" in quantized and "visual.merger.mlp.0" in quantized
    calls = _fp8_calls(out, [5, 6, 7])  # text only: the tower is built in FP8, not run
    assert "model.visual.blocks.0.attn.qkv" in calls or "visual.blocks.0.attn.qkv" in calls


def test_llava_with_images(next_dir, media_data, tmp_path):
    """Calibration and verify read images through LLaVA's own processor; the report says so."""
    src = next_dir("llava")
    fp8 = tmp_path / "fp8"
    result = _convert(src, fp8, data=media_data / "images.jsonl", samples=8)
    assert any("image" in n for n in result.notes), result.notes
    res = _verify(src, fp8, tmp_path, data=media_data / "images.jsonl", samples=4)
    assert res.passed, res.failures
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["data"]["media"] == {"processor": "LlavaProcessor", "images": 4, "audio": 0,
                                       "text_only": 0}


def test_whisper_with_audio(next_dir, next_fp8, media_data, tmp_path):
    """Whisper's encoder and decoder linears in FP8, calibrated on audio + transcripts."""
    src, fp8 = next_dir("whisper"), next_fp8("whisper")
    quantized = json.loads((fp8 / "fp8export.json").read_text())["quantized"]
    assert "model.encoder.layers.0.fc1" in quantized
    assert "model.decoder.layers.0.encoder_attn.k_proj" in quantized
    assert all(e["input_scale_source"] == "calibration" for e in quantized.values())
    res = _verify(src, fp8, tmp_path, data=media_data / "audio.jsonl", samples=4)
    assert res.passed, res.failures


def test_whisper_text_only_is_refused(next_dir, tmp_path):
    from fp8export.errors import Fp8ExportError

    with pytest.raises(Fp8ExportError, match="encoder reads audio.*'audio' path"):
        _convert(next_dir("whisper"), tmp_path / "fp8")


def test_llama4_is_refused_by_name(next_dir, tmp_path):
    """Weights-only convert works; anything that runs the model says why it cannot."""
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig
    from fp8export.errors import Fp8ExportError

    src = next_dir("llama4")
    convert(ConvertConfig(checkpoint=src, output=tmp_path / "w", scales="weights"))
    with pytest.raises(Fp8ExportError, match="cannot run Llama4ForConditionalGeneration"):
        _convert(src, tmp_path / "fp8")


# gpt-oss: its 3-D experts stay bf16 in the graph, traced as transformers' batched_mm
@pytest.mark.slow  # a trace each (30-110 s on 2 shared cores); CI runs the slow tier
@pytest.mark.parametrize("family", ["deepseek-v3", "llava", "gpt-oss"])
def test_next_family_onnx(family, next_dir, next_fp8, media_data, run_cli, tmp_path):
    from fp8export.api import export_onnx
    from fp8export.onnx.export import ExportOnnxConfig

    src, fp8 = next_dir(family), next_fp8(family)
    exported = export_onnx(ExportOnnxConfig(fp8_dir=fp8, output=tmp_path / "m.onnx",
                                             dtype="fp32"))
    quantized = json.loads((fp8 / "fp8export.json").read_text())["quantized"]
    assert len(exported.fp8_gemms) == len(quantized)
    assert _verify(src, tmp_path / "m.onnx", tmp_path / "v").passed
    if family == "llava":  # the graph takes token ids only: image data is refused, not dropped
        r = run_cli("verify", src, tmp_path / "m.onnx", "--data", media_data / "images.jsonl",
                    "--report-dir", tmp_path / "r")
        errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
        assert r.exit_code == 1 and len(errors) == 1, r.output
        assert "names image files" in errors[0] and "token ids only" in errors[0]
        assert not (tmp_path / "r").exists()


def test_whisper_export_onnx_is_refused(next_fp8, tmp_path):
    """The graph would read token ids; Whisper's encoder reads audio features."""
    from fp8export.api import export_onnx
    from fp8export.errors import Fp8ExportError
    from fp8export.onnx.export import ExportOnnxConfig

    with pytest.raises(Fp8ExportError, match="encoder reads input_features"):
        export_onnx(ExportOnnxConfig(fp8_dir=next_fp8("whisper"), output=tmp_path / "m.onnx"))
    assert not (tmp_path / "m.onnx").exists()


def test_vlm_families_listed():
    assert set(VLM_FAMILIES) <= set(NEXT_FAMILIES)


def test_processor_loads_from_a_private_copy(next_dir, tmp_path):
    """The processor's files are read through the guarded opener, as the tokenizer's: a link
    out of the model folder is refused, and an auto_map naming code in the folder is dropped
    (the class transformers ships loads; the code never runs)."""
    import shutil

    from fp8export.errors import Fp8ExportError
    from fp8export.inputs.media import open_processor

    model = tmp_path / "model"
    shutil.copytree(next_dir("llava"), model, ignore=shutil.ignore_patterns("*.safetensors"))
    marker = tmp_path / "ran"
    (model / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                   "from transformers import LlavaProcessor as EvilProcessor\n")
    config = json.loads((model / "processor_config.json").read_text())
    config["auto_map"] = {"AutoProcessor": "evil.EvilProcessor"}
    (model / "processor_config.json").write_text(json.dumps(config))
    assert type(open_processor(model)).__name__ == "LlavaProcessor"
    assert not marker.exists()
    outside = tmp_path / "outside.json"
    (model / "processor_config.json").rename(outside)
    (model / "processor_config.json").symlink_to(outside)
    with pytest.raises(Fp8ExportError, match="processor_config.json"):
        open_processor(model)
