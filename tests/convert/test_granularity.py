"""convert --weight-granularity channel and --dynamic-activations token, end to end on tiny
real checkpoints: what is written, what is refused, and what the FP8 runtime computes."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fp8export.convert.config import ConvertConfig
from fp8export.convert.pipeline import convert
from fp8export.errors import Fp8ExportError
from fp8export.numerics.fp8 import amax_to_scale
from fp8export.numerics.metrics import cosine


def test_llama_channel_scales_written_and_declared(tiny_llama, tmp_path):
    out = tmp_path / "ch"
    res = convert(ConvertConfig(checkpoint=tiny_llama, output=out, weight_granularity="channel",
                                dynamic_activations="token"))
    tensor = convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "t"))
    src = load_file(str(tiny_llama / "model.safetensors"))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
            w = src[f"{name}.weight"].float()
            q, s = f.get_tensor(f"{name}.weight"), f.get_tensor(f"{name}.weight_scale")
            assert s.dtype == torch.float32 and tuple(s.shape) == (w.shape[0], 1)
            want = [amax_to_scale(float(a)) for a in w.abs().amax(dim=1)]
            want = np.array(want, dtype=np.float32).astype(ml_dtypes.bfloat16)  # the model's
            assert np.array_equal(s.reshape(-1).numpy(), want.astype(np.float32))
            for o in range(w.shape[0]):  # every row is close to its source row
                assert cosine(w[o], q[o].float() * s[o]) > 0.999
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["weights"]["dynamic"] is False
    assert group["input_activations"] == {"dynamic": True, "num_bits": 8, "strategy": "token",
                                          "symmetric": True, "type": "float"}
    man = json.loads((out / "fp8export.json").read_text())
    assert man["weight_granularity"] == "channel" and man["dynamic_activations"] == "token"
    entry = man["quantized"]["model.layers.0.self_attn.k_proj"]
    assert 0 < entry["weight_scale_min"] <= entry["weight_scale"]
    # fused members keep their own rows' scales: per channel there is no group max to share
    k = man["quantized"]["model.layers.0.self_attn.k_proj"]["weight_scale"]
    v = man["quantized"]["model.layers.0.self_attn.v_proj"]["weight_scale"]
    assert k != v
    sqnr = {r["module"]: r["weight_sqnr_db"] for r in res.layers}
    sqnr_t = {r["module"]: r["weight_sqnr_db"] for r in tensor.layers}
    assert all(sqnr[m] >= sqnr_t[m] - 0.1 for m in sqnr)  # never meaningfully worse


def test_gpt2_in_out_channels_are_columns(tiny_gpt2, tmp_path):
    out = tmp_path / "g"
    convert(ConvertConfig(checkpoint=tiny_gpt2, output=out, weight_granularity="channel"))
    src = load_file(str(tiny_gpt2 / "model.safetensors"))
    name = next(k for k in src if k.endswith("mlp.c_fc.weight"))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        s = f.get_tensor(name.replace(".weight", ".weight_scale"))
    w = src[name].float()  # Conv1D: [in, out]
    assert tuple(s.shape) == (w.shape[1], 1)
    want = np.array([amax_to_scale(float(a)) for a in w.abs().amax(dim=0)], dtype=np.float32)
    want = want.astype(ml_dtypes.bfloat16).astype(np.float32)  # the model's dtype
    assert np.array_equal(s.reshape(-1).numpy(), want)


@pytest.mark.parametrize("fmt", ["vllm", "modelopt"])
def test_dialects_without_channel_scales_refuse(tiny_llama, tmp_path, fmt):
    with pytest.raises(Fp8ExportError, match=f"--format {fmt} cannot hold per-channel"):
        convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "o", format=fmt,
                              weight_granularity="channel"))
    assert not (tmp_path / "o").exists()


def test_history_weight_scales_need_tensor_granularity(tiny_llama, tmp_path):
    with pytest.raises(Fp8ExportError, match="--weight-granularity tensor"):
        convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "o",
                              weight_granularity="channel", weight_scales_from_history=True))


@pytest.mark.parametrize(("granularity", "dynamic"), [("channel", "tensor"), ("tensor", "token"),
                                                       ("channel", "token")])
def test_runtime_runs_what_was_written(tiny_llama, tmp_path, granularity, dynamic):
    """The FP8 model computes the emulation of exactly these scales: each layer equals a
    hand-written per-row / per-token fake-quant, and the logits stay close to bf16."""
    from transformers import AutoModelForCausalLM

    from fp8export.runtime.fp8_model import fp8_modules, load_fp8_model

    out = tmp_path / "o"
    convert(ConvertConfig(checkpoint=tiny_llama, output=out, weight_granularity=granularity,
                          dynamic_activations=dynamic))
    model, _, _, info = load_fp8_model(out, dtype=torch.float32, mode="emulate")
    assert info["weight_granularity"] == granularity and info["dynamic_activations"] == dynamic
    layer = fp8_modules(model)["model.layers.0.mlp.down_proj"]
    x = torch.randn(3, 5, layer.in_features) * torch.logspace(-2, 1, 5)[None, :, None]
    amax = x.abs().amax(dim=-1, keepdim=True) if dynamic == "token" else x.abs().amax()
    s_in = amax / 448
    xq = (x / s_in).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s_in
    ws = layer.weight_scale.reshape(-1, 1) if granularity == "channel" else layer.weight_scale
    assert (layer.weight_scale.numel() > 1) == (granularity == "channel")
    want = xq @ (layer.weight.float() * ws).t()
    assert torch.allclose(layer(x), want, rtol=1e-5, atol=1e-6)
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, base = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert cosine(got, base) > 0.999


def test_default_dynamic_folder_declares_and_runs_per_token(tiny_llama, tmp_path):
    """A default convert without activation ranges declares per-token dynamic inputs (what
    vLLM runs) and the FP8 runtime runs them per token; --dynamic-activations tensor declares
    and runs per tensor, with a note that vLLM would still go per token."""
    from fp8export.runtime.fp8_model import fp8_modules, load_fp8_model

    out = tmp_path / "d"
    res = convert(ConvertConfig(checkpoint=tiny_llama, output=out))
    group = json.loads((out / "config.json").read_text())["quantization_config"][
        "config_groups"]["group_0"]
    assert group["input_activations"]["strategy"] == "token"
    assert group["input_activations"]["dynamic"] is True
    assert json.loads((out / "fp8export.json").read_text())["dynamic_activations"] == "token"
    assert not any("per tensor" in n for n in res.notes)
    model, _, _, info = load_fp8_model(out, dtype=torch.float32, mode="emulate")
    assert info["dynamic_activations"] == "token"
    assert {m.dynamic for m in fp8_modules(model).values()} == {"token"}

    per_tensor = tmp_path / "t"
    res = convert(ConvertConfig(checkpoint=tiny_llama, output=per_tensor,
                                dynamic_activations="tensor"))
    args = json.loads((per_tensor / "config.json").read_text())["quantization_config"][
        "config_groups"]["group_0"]["input_activations"]
    assert args["strategy"] == "tensor" and args["dynamic"] is True
    assert any("vLLM quantizes dynamic inputs per token" in n for n in res.notes)
    assert load_fp8_model(per_tensor, dtype=torch.float32, mode="emulate")[3][
        "dynamic_activations"] == "tensor"


def test_the_config_declaration_wins_over_the_manifest(tiny_llama, tmp_path):
    """verify runs what config.json declares, which engines read: a manifest saying "tensor"
    (or nothing, as folders of other tools) does not make a per-token folder run per tensor."""
    from fp8export.runtime.fp8_model import load_fp8_model

    out = tmp_path / "d"
    convert(ConvertConfig(checkpoint=tiny_llama, output=out))
    man_path = out / "fp8export.json"
    man = json.loads(man_path.read_text())
    man["dynamic_activations"] = "tensor"
    man_path.write_text(json.dumps(man))
    assert load_fp8_model(out, dtype=torch.float32, mode="emulate")[3][
        "dynamic_activations"] == "token"
    del man["dynamic_activations"]
    man_path.write_text(json.dumps(man))
    assert load_fp8_model(out, dtype=torch.float32, mode="emulate")[3][
        "dynamic_activations"] == "token"
