"""The convert pipeline end to end on tiny real checkpoints."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp8export.checkpoint.source import open_checkpoint
from fp8export.convert.config import ConvertConfig
from fp8export.convert.pipeline import convert
from fp8export.errors import Fp8ExportError
from fp8export.numerics.metrics import cosine, rel_l2


def _all_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_llama_weights_only(tiny_llama, tmp_path):
    out = tmp_path / "out"
    res = convert(ConvertConfig(checkpoint=tiny_llama, output=out))
    assert res.quantized == 14 and res.activation_scheme == "dynamic"
    assert sorted(res.files) == ["config.json", "fp8export.json", "generation_config.json",
                                 "model.safetensors", "tokenizer_config.json"]
    src = load_file(str(tiny_llama / "model.safetensors"))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        s = f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale")
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (1,)
        assert not any(k.endswith("input_scale") for k in keys)
        assert torch.equal(f.get_tensor("lm_head.weight"), src["lm_head.weight"])
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    w = src["model.layers.0.self_attn.q_proj.weight"].float()
    assert cosine(w, q.float() * s) > 0.999
    assert keys == set(src) | {f"{t.rsplit('.', 1)[0]}.weight_scale" for t in src
                               if t.endswith("_proj.weight")}

    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    assert qc["config_groups"]["group_0"]["input_activations"]["dynamic"] is True
    assert qc["ignore"] == ["lm_head", "model.embed_tokens"]
    assert config["model_type"] == "llama"

    raw = (out / "fp8export.json").read_text()
    assert str(tmp_path) not in raw and str(tiny_llama.parent) not in raw  # no absolute paths
    man = json.loads(raw)
    assert man["format_version"] == 1 and man["output_format"] == "compressed-tensors"
    assert set(man["quantized"]) | {k.rsplit(".", 1)[0] for k in man["excluded"]} >= {
        k.rsplit(".", 1)[0] for k in src}
    assert {v["weight"] for v in man["quantized"].values()} | set(man["excluded"]) == set(src)
    entry = man["quantized"]["model.layers.0.self_attn.k_proj"]
    assert entry["fused_group"] == "model.layers.0.self_attn.qkv"
    assert entry["weight_scale_source"] == "weights" and entry["input_scale"] is None
    assert 25 < entry["weight_sqnr_db"] < 40
    qkv = [man["quantized"][f"model.layers.0.self_attn.{m}"] for m in ("q_proj", "k_proj",
                                                                        "v_proj")]
    assert len({e["weight_scale"] for e in qkv}) == 1  # fused group shares the scale
    # amax/448 rounded to the model's BF16, the dtype transformers holds the scale in
    assert qkv[0]["weight_scale"] == pytest.approx(max(e["weight_amax"] for e in qkv) / 448,
                                                   rel=2 ** -8)
    assert qkv[0]["weight_scale"] == float(ml_dtypes.bfloat16(qkv[0]["weight_scale"]))
    src_file = man["source"]["files"][0]
    assert src_file["name"] == "model.safetensors"
    assert src_file["sha256"] == hashlib.sha256(
        (tiny_llama / "model.safetensors").read_bytes()).hexdigest()


def test_reruns_are_byte_identical(tiny_llama, tmp_path):
    a = convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "a"))
    b = convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "b"))
    assert _all_files(Path(a.output)) == _all_files(Path(b.output))


def test_no_fuse_scales_gives_own_scales(tiny_llama, tmp_path):
    convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "o", fuse_scales=False))
    man = json.loads((tmp_path / "o" / "fp8export.json").read_text())
    qkv = [man["quantized"][f"model.layers.0.self_attn.{m}"] for m in ("q_proj", "k_proj",
                                                                        "v_proj")]
    for e in qkv:
        assert e["weight_scale"] == pytest.approx(e["weight_amax"] / 448, rel=2 ** -8)
    assert len({e["weight_scale"] for e in qkv}) == 3


def test_existing_output_needs_force_and_force_swaps(tiny_llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(Fp8ExportError, match="already exists. Pass --force"):
        convert(ConvertConfig(checkpoint=tiny_llama, output=out))
    assert _all_files(out) == {"mine.txt": b"keep me"}
    with pytest.raises(Fp8ExportError, match="did not write"):  # not ours: never replaced
        convert(ConvertConfig(checkpoint=tiny_llama, output=out, force=True))
    assert _all_files(out) == {"mine.txt": b"keep me"}
    (out / "mine.txt").unlink()
    convert(ConvertConfig(checkpoint=tiny_llama, output=out, force=True))  # empty: replaced
    (out / "fp8export.json").write_bytes(b"{}")  # an earlier output (its manifest marks it)
    convert(ConvertConfig(checkpoint=tiny_llama, output=out, force=True))
    assert (out / "model.safetensors").exists() and len((out / "fp8export.json").read_bytes()) > 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or old folders


def test_failure_mid_way_leaves_nothing_and_keeps_the_old_output(tiny_llama, tmp_path,
                                                                monkeypatch):
    import fp8export.convert.pipeline as conv

    def boom(*a, **k):
        raise Fp8ExportError("simulated read-back failure")

    monkeypatch.setattr(conv, "verify_output", boom)
    monkeypatch.setattr(conv, "verify_parallel_output", boom)
    with pytest.raises(Fp8ExportError, match="simulated"):
        convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "new"))
    assert list(tmp_path.iterdir()) == []
    old = tmp_path / "old"
    old.mkdir()
    (old / "fp8export.json").write_text("previous")  # an earlier output: --force may replace it
    with pytest.raises(Fp8ExportError, match="simulated"):
        convert(ConvertConfig(checkpoint=tiny_llama, output=old, force=True))
    assert _all_files(old) == {"fp8export.json": b"previous"}
    assert [p.name for p in tmp_path.iterdir()] == ["old"]


def test_output_may_not_contain_the_checkpoint(tiny_llama, tmp_path):
    with pytest.raises(Fp8ExportError, match="contains the input"):
        convert(ConvertConfig(checkpoint=tiny_llama, output=tiny_llama.parent, force=True))
    assert (tiny_llama / "model.safetensors").exists()


def _llama_like_file(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


def test_nan_weights_fail_naming_every_offender(tmp_path):
    bad = torch.ones(4, 4, dtype=torch.bfloat16)
    bad[1, 1] = float("nan")
    inf = torch.ones(4, 4, dtype=torch.bfloat16)
    inf[0, 0] = float("inf")
    src = _llama_like_file(tmp_path / "src", {
        "l.0.q_proj.weight": bad, "l.0.o_proj.weight": inf,
        "l.0.down_proj.weight": torch.ones(4, 4, dtype=torch.bfloat16)})
    with pytest.raises(Fp8ExportError) as err:
        convert(ConvertConfig(checkpoint=src, output=tmp_path / "out"))
    msg = str(err.value)
    assert "2 weight(s) hold NaN or Inf" in msg and "l.0.q_proj.weight" in msg
    assert "l.0.o_proj.weight" in msg and "--exclude" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_all_zero_weight_stays_high_precision(tmp_path):
    torch.manual_seed(0)
    src = _llama_like_file(tmp_path / "src", {
        "l.0.o_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
        "l.0.down_proj.weight": torch.randn(4, 4).to(torch.bfloat16)})
    res = convert(ConvertConfig(checkpoint=src, output=tmp_path / "out"))
    assert res.excluded["l.0.o_proj.weight"] == "all-zero weight (amax 0)"
    assert res.quantized == 1
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert "l.0.o_proj" in qc["ignore"]
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("l.0.o_proj.weight").dtype == torch.bfloat16


def test_sharded_source_gives_sharded_output(tiny_llama_sharded, tmp_path):
    src_shards = sorted(tiny_llama_sharded.glob("model-*.safetensors"))
    assert len(src_shards) > 1
    out = tmp_path / "out"
    convert(ConvertConfig(checkpoint=tiny_llama_sharded, output=out))
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) == len(src_shards)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == shard.name
    with open_checkpoint(out) as ck:  # our own reader accepts the output
        names = {t.name for t in ck.tensors()}
    assert "model.layers.1.mlp.down_proj.weight_scale" in names


def test_gpt2_keeps_conv1d_layout(tiny_gpt2, tmp_path):
    res = convert(ConvertConfig(checkpoint=tiny_gpt2, output=tmp_path / "out"))
    assert res.quantized == 8
    man = json.loads((tmp_path / "out" / "fp8export.json").read_text())
    e = man["quantized"]["transformer.h.0.attn.c_attn"]
    assert e["layout"] == "in_out" and e["shape"] == [64, 192]
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("transformer.h.0.attn.c_attn.weight").shape == (64, 192)


def test_vllm_format(tiny_llama, tmp_path):
    convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "o", format="vllm"))
    qc = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    assert qc == {"activation_scheme": "dynamic", "ignored_layers": ["lm_head",
                                                                      "model.embed_tokens"],
                  "quant_method": "fp8"}


def test_modelopt_without_activation_ranges_is_refused(tiny_llama, tmp_path):
    with pytest.raises(Fp8ExportError, match="static-only"):
        convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "o", format="modelopt"))
    assert list(tmp_path.iterdir()) == []


def test_transformers_loads_the_output_with_compressed_tensors(tiny_llama, tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    convert(ConvertConfig(checkpoint=tiny_llama, output=out))
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    fp8 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(ids).logits, fp8(ids).logits
    assert cosine(a, b) >= 1 - 2 * (1 - 0.9991)  # README: cosine 0.9991 to bf16
    assert rel_l2(a, b) < 0.1  # values too: cosine alone would not see a wrong scale
    # transformers dequantizes with our scale: the weight it runs is q * weight_scale
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        q = f.get_tensor("model.layers.1.mlp.up_proj.weight").float()
        s = f.get_tensor("model.layers.1.mlp.up_proj.weight_scale")
    fp8(ids)  # decompression happens on the first forward
    got = fp8.model.layers[1].mlp.up_proj.weight.float()
    assert rel_l2(q * s, got) < 1e-3  # not cosine: that would not see a wrong scale


def test_disk_full_is_one_clear_error_and_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    import errno

    import fp8export.convert.pipeline as conv

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(conv, "write_shards", full)
    monkeypatch.setattr(conv, "write_shards_parallel", full)
    with pytest.raises(Fp8ExportError) as err:
        convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "model-fp8"))
    assert "model-fp8: writing the output failed: No space left on device" in str(err.value)
    assert list(tmp_path.iterdir()) == []


def _group_of(module: str) -> str:
    """q/k/v of one attention and gate/up of one MLP share a scale (vLLM's fused layers)."""
    import re

    m = re.match(r"(.*)\.(self_attn\.[qkv]|mlp\.(?:gate|up))_proj$", module)
    return f"{m.group(1)}.{'qkv' if 'attn' in m.group(2) else 'gate_up'}" if m else module


@pytest.mark.parametrize("fmt", ["vllm", "compressed-tensors"])
def test_every_weight_scale_is_its_groups_amax_over_448(fmt, tmp_path):
    """Every FP8 layer of the trained sample: weight_scale == amax / 448, amax the max |w| of
    the source weight (over q/k/v and over gate/up, whose members share one scale), computed
    here from the source file; float32 in the vllm dialect, rounded to the model's BF16 in
    compressed-tensors (the dtype transformers holds it in). The manifest records the same."""
    model = Path(__file__).resolve().parents[2] / "samples" / "tiny-llama" / "model"
    out = tmp_path / "out"
    convert(ConvertConfig(checkpoint=model, output=out, format=fmt))
    group_amax: dict[str, float] = {}
    for name, w in load_file(str(model / "model.safetensors")).items():
        if name.endswith("_proj.weight"):
            group = _group_of(name.removesuffix(".weight"))
            group_amax[group] = max(group_amax.get(group, 0.0), float(w.float().abs().max()))
    manifest = json.loads((out / "fp8export.json").read_text())["quantized"]
    seen = 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if not name.endswith(".weight_scale"):
                continue
            module = name.removesuffix(".weight_scale")
            want = np.float32(group_amax[_group_of(module)] / 448)
            if fmt == "compressed-tensors":  # the model's dtype
                want = np.float32(want.astype(ml_dtypes.bfloat16))
            assert f.get_tensor(name).item() == want, name
            assert manifest[module]["weight_scale"] == want, module
            assert manifest[module]["weight_amax"] <= group_amax[_group_of(module)]
            seen += 1
    assert seen == len(manifest) == 42
