"""convert --kv-cache fp8: calibrated k_scale/v_scale per attention layer, written under the
names each dialect's loader reads, read back, and emulated by the FP8 runtime."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from fp8export.convert.config import ConvertConfig
from fp8export.convert.pipeline import convert
from fp8export.errors import Fp8ExportError, UsageError
from fp8export.numerics.fp8 import amax_to_scale
from fp8export.numerics.metrics import cosine

ATTN = [f"model.layers.{i}.self_attn" for i in range(2)]


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv") / "calib.npz"
    ids = np.random.RandomState(1).randint(0, 256, (8, 24)).astype(np.int64)
    np.savez(path, input_ids=ids)
    return path


def _observed(src, calib_path) -> dict[str, tuple[float, float]]:
    """max|K after RoPE| and max|V| recomputed by hand from the projections."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from fp8export.models import load_model

    model, _ = load_model(src, dtype=torch.bfloat16)
    ids = torch.from_numpy(np.load(calib_path)["input_ids"])
    seen = {}
    for i, name in enumerate(ATTN):
        attn = model.get_submodule(name)
        hooks = {}
        attn.register_forward_pre_hook(lambda _m, _a, kw, hooks=hooks: hooks.update(kw),
                                       with_kwargs=True)
        with torch.no_grad():
            model(input_ids=ids)
        x = hooks["hidden_states"]
        shape = (*x.shape[:-1], -1, attn.head_dim)
        with torch.no_grad():
            q = attn.q_proj(x).view(shape).transpose(1, 2)
            k = attn.k_proj(x).view(shape).transpose(1, 2)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            _, k = apply_rotary_pos_emb(q, k, *hooks["position_embeddings"])
        seen[name] = (float(k.abs().max()), float(v.abs().max()))
    return seen


@pytest.mark.parametrize(("fmt", "k_tail", "shape"), [
    ("compressed-tensors", "k_scale", (1,)), ("vllm", "k_scale", (1,)),
    ("modelopt", "k_proj.k_scale", ())])
def test_scales_written_where_loaders_read_them(tiny_llama, calib, tmp_path, fmt, k_tail, shape):
    out = tmp_path / fmt
    convert(ConvertConfig(checkpoint=tiny_llama, output=out, scales="calibrate",
                          calib_data=calib, format=fmt, kv_cache="fp8"))
    man = json.loads((out / "fp8export.json").read_text())["kv_cache"]
    want = _observed(tiny_llama, calib)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for attn in ATTN:
            v_tail = k_tail.replace("k", "v")
            k, v = f.get_tensor(f"{attn}.{k_tail}"), f.get_tensor(f"{attn}.{v_tail}")
            assert k.dtype == torch.float32 and tuple(k.shape) == shape == tuple(v.shape)
            entry = man["layers"][attn]
            assert float(k.reshape(-1)[0]) == amax_to_scale(entry["k_amax"])
            assert float(v.reshape(-1)[0]) == amax_to_scale(entry["v_amax"])
            # the calibrated ranges are those of the keys after RoPE and of the values
            assert entry["k_amax"] == pytest.approx(want[attn][0], rel=0.02)
            assert entry["v_amax"] == pytest.approx(want[attn][1], rel=0.02)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    if fmt == "compressed-tensors":
        assert qc["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "strategy": "tensor",
                                         "symmetric": True, "dynamic": False}
    elif fmt == "modelopt":
        hq = json.loads((out / "hf_quant_config.json").read_text())
        assert hq["quantization"]["kv_cache_quant_algo"] == "FP8"
        assert qc["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    else:
        assert qc["kv_cache_scheme"] == "static"


def test_runtime_emulates_the_fp8_kv_cache(tiny_llama, calib, tmp_path):
    from transformers import AutoModelForCausalLM

    from fp8export.runtime.fp8_model import load_fp8_model

    plain, kv = tmp_path / "plain", tmp_path / "kv"
    for out, cache in ((plain, "none"), (kv, "fp8")):
        convert(ConvertConfig(checkpoint=tiny_llama, output=out, scales="calibrate",
                              calib_data=calib, kv_cache=cache))
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(4))
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    got = {}
    for out in (plain, kv):
        model, _, _, info = load_fp8_model(out, dtype=torch.float32, mode="emulate")
        with torch.no_grad():
            got[out.name] = model(input_ids=ids).logits
        assert (info["kv_cache"] is not None) == (out is kv)
    with torch.no_grad():
        base = ref(input_ids=ids).logits
    diff = (got["kv"] - got["plain"]).abs().max()
    assert diff > 0  # FP8 keys and values change the logits ...
    assert cosine(got["kv"], base) > 0.999  # ... a little


def test_needs_data_and_k_v_projections(tiny_llama, tiny_gpt2, calib, tmp_path):
    with pytest.raises(UsageError, match="--calib-data"):
        ConvertConfig(checkpoint=tiny_llama, kv_cache="fp8")
    with pytest.raises(Fp8ExportError, match="separate k_proj and v_proj"):
        convert(ConvertConfig(checkpoint=tiny_gpt2, output=tmp_path / "g", calib_data=calib,
                              kv_cache="fp8"))
    assert not (tmp_path / "g").exists()


def test_the_fp8_kv_cache_is_said_by_convert_inspect_and_export(tiny_llama, calib, tmp_path,
                                                                 run_cli):
    said = "FP8 E4M3 keys and values, k_scale/v_scale for 2 attention layer(s)"
    kv, plain = tmp_path / "kv", tmp_path / "plain"
    r = run_cli("convert", tiny_llama, "-o", kv, "--calib-data", calib, "--kv-cache", "fp8")
    assert r.exit_code == 0, r.output
    assert f"kv cache: {said}, calibrated on 8 samples of calib.npz" in r.stdout
    r = run_cli("convert", tiny_llama, "-o", plain, "--calib-data", calib)
    assert r.exit_code == 0 and "kv cache" not in r.stdout
    shown = run_cli("inspect", kv)
    assert f"  kv cache      {said}" in shown.stdout
    assert json.loads(run_cli("inspect", kv, "--json").stdout)["summary"]["kv_cache"] \
        .startswith(said)
    assert json.loads(run_cli("inspect", plain, "--json").stdout)["summary"]["kv_cache"] is None
    r = run_cli("export-onnx", kv, "-o", tmp_path / "kv.onnx", "--dtype", "fp32")
    assert r.exit_code == 0, r.output
    notes = [line for line in r.stderr.splitlines() if line.startswith("note: KV cache: ")]
    assert len(notes) == 1 and said in notes[0] and "not in it" in notes[0]
