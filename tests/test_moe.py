"""MoE loading (transformers' own conversion) and per-expert execution (fp8export/moe.py)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "families"))

from model_families import save_family  # noqa: E402

from fp8export.errors import Fp8ExportError  # noqa: E402


@pytest.fixture(scope="module", params=["mixtral", "qwen3-moe"])
def moe_src(request, tmp_path_factory):
    return save_family(request.param, tmp_path_factory.mktemp(request.param) / "src")


def _ids():
    return torch.randint(3, 1900, (2, 24), generator=torch.Generator().manual_seed(0))


def test_load_matches_from_pretrained(moe_src, monkeypatch):
    """Per-expert tensors on disk load as transformers 5 loads them: bit-identical logits (with
    torch's own 16-bit kernels on both sides: transformers' fused experts are no nn.Linear, so
    fp8export/cpu_gemm.py's fp32 products would differ from them in the last bits)."""
    import transformers

    from fp8export import cpu_gemm
    from fp8export.models import load_model

    monkeypatch.setenv("FP8EXPORT_CPU_GEMM", "native")
    cpu_gemm._slow.cache_clear()
    monkeypatch.setattr(cpu_gemm, "_slow", cpu_gemm._slow.__wrapped__)

    ours, _ = load_model(moe_src)
    ref = transformers.AutoModelForCausalLM.from_pretrained(moe_src, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(_ids()).logits, ref.eval()(_ids()).logits)


def test_fused_layout_on_disk_loads(moe_src, tmp_path):
    """A checkpoint that stores experts fused (3-D ``experts.gate_up_proj``) loads too."""
    from safetensors.torch import save_file

    from fp8export.models import load_model

    model, _ = load_model(moe_src)
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(moe_src / "config.json", fused / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
             or not model.config.tie_word_embeddings}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    again, _ = load_model(fused)
    with torch.no_grad():
        assert torch.equal(again(_ids()).logits, model(_ids()).logits)


def test_missing_expert_is_refused_before_building(moe_src, tmp_path):
    from safetensors.torch import load_file, save_file

    from fp8export.models import load_model

    bad = tmp_path / "bad"
    shutil.copytree(moe_src, bad)
    state = load_file(bad / "model.safetensors")
    drop = [k for k in state if ".experts.3." in k and "layers.1." in k]
    save_file({k: v for k, v in state.items() if k not in drop}, bad / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(Fp8ExportError, match="does not match its config.json"):
        load_model(bad)


@pytest.mark.parametrize("mode", ["routed", "all", "dense"])
def test_expert_linears_compute_the_same(moe_src, mode):
    """Unfused experts give transformers' output: routed and all-experts exactly the routed
    rows; dense up to one bf16 rounding of the summed outputs."""
    from fp8export.models import load_model
    from fp8export.moe import ExpertLinears, unfuse_experts

    model, _ = load_model(moe_src)
    with torch.no_grad():
        ref = model(_ids()).logits.float()
    mods = unfuse_experts(model, mode)
    assert mods and all(isinstance(m, ExpertLinears) for m in mods.values())
    with torch.no_grad():
        out = model(_ids()).logits.float()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 5e-3, rel
    first = next(iter(mods.values()))
    assert first.gemms["bfloat16"] > 0


def test_unsupported_experts_layout_is_named(moe_src):
    from fp8export.models import load_model
    from fp8export.moe import is_fused_experts, unfuse_experts

    model, _ = load_model(moe_src)
    experts = next(m for m in model.modules() if is_fused_experts(m))
    experts.has_bias = True
    with pytest.raises(Fp8ExportError, match="has_bias"):
        unfuse_experts(model)


def test_fp8_runtime_runs_expert_gemms_in_fp8(moe_src, tmp_path, monkeypatch):
    """Every expert projection of the FP8 runtime is an Fp8Linear, and a forward calls their
    FP8 path (counted at the Fp8Linear itself, not only by the module's own counter)."""
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig
    from fp8export.moe import ExpertLinears
    from fp8export.runtime.fp8_linear import Fp8Linear
    from fp8export.runtime.fp8_model import load_fp8_model

    out = tmp_path / "fp8"
    convert(ConvertConfig(checkpoint=moe_src, output=out))
    model, _, manifest, info = load_fp8_model(out, mode="emulate")
    experts = [m for m in model.modules() if isinstance(m, ExpertLinears)]
    assert len(experts) == 2 and info["moe"]["expert_weight_dtypes"] == ["float8_e4m3fn"]
    calls = {"n": 0}
    real = Fp8Linear.forward_emulated

    def counted(self, x):
        calls["n"] += 1
        return real(self, x)

    monkeypatch.setattr(Fp8Linear, "forward_emulated", counted)
    with torch.no_grad():
        model(_ids())
    gemms = sum(m.gemms.get("float8_e4m3fn", 0) for m in experts)
    assert gemms > 0
    assert set().union(*(m.gemms for m in experts)) == {"float8_e4m3fn"}
    n_quantized = len(manifest["quantized"])
    assert calls["n"] >= gemms // 2 + 1 and n_quantized > 0  # fused gate/up: one GEMM each
    assert json.dumps(info)  # JSON-serialisable


def test_spread_loaders_take_moe_checkpoints(moe_src, tmp_path):
    """placement's spread loaders (accelerate, here a cpu budget) load MoE models and their FP8
    folders to the same logits as the one-device loaders."""
    pytest.importorskip("accelerate")
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig
    from fp8export.models import load_model, load_model_spread
    from fp8export.runtime.fp8_model import load_fp8_model

    spread, _, placed = load_model_spread(moe_src, {"cpu": 1 << 30})
    plain, _ = load_model(moe_src)
    with torch.no_grad():
        assert torch.equal(spread(_ids()).logits, plain(_ids()).logits)
    placed.close()
    out = tmp_path / "fp8"
    convert(ConvertConfig(checkpoint=moe_src, output=out))
    a, *_, info = load_fp8_model(out, budgets={"cpu": 1 << 30}, mode="emulate")
    b, *_ = load_fp8_model(out, mode="emulate")
    with torch.no_grad():
        assert torch.equal(a(_ids()).logits, b(_ids()).logits)
    assert info["moe"]["expert_weight_dtypes"] == ["float8_e4m3fn"]
    info["placement"].close()


def test_without_transformers_conversions_names_pass_through(monkeypatch):
    """Before transformers 5 there is no conversion mapping: names load as they are."""
    import fp8export.models as models

    monkeypatch.setattr(models, "weight_conversions", lambda model: ([], []))
    t = torch.zeros(2)
    assert models.hf_state(None, {"a.weight": t, "b": lambda: t}, Path(".")) == \
        {"a.weight": t, "b": t}
    assert models.model_key(None, "x.block_sparse_moe.experts.0.w1.weight") == \
        "x.block_sparse_moe.experts.0.w1.weight"


def test_each_expert_is_calibrated_on_its_own_inputs(moe_src, tmp_path):
    """calibrate: every expert's projections get the max over all calibration tokens of their
    own inputs (all experts observed on every token; that includes the tokens routed to it).
    The reference runs transformers' own fused experts and computes each expert's inputs
    here, batch by batch: the gate/up inputs are the layer's hidden states, the down input
    act(x W_gate^T) * (x W_up^T) with that expert's weights."""
    import re

    import numpy as np
    from transformers import AutoModelForCausalLM

    from fp8export.calibration.api import calibrate
    from fp8export.calibration.config import CalibrateConfig
    from fp8export.moe import is_fused_experts

    ids = torch.randint(3, 1900, (8, 24), generator=torch.Generator().manual_seed(5))
    np.savez(tmp_path / "calib.npz", input_ids=ids.numpy())  # one length: no padding
    result = calibrate(CalibrateConfig(checkpoint=moe_src, calib_data=tmp_path / "calib.npz",
                                       batch_size=4, device="cpu", calib_method="max"))

    model = AutoModelForCausalLM.from_pretrained(str(moe_src), dtype=torch.bfloat16).eval()
    seen: dict[str, list] = {}
    fused = {n: m for n, m in model.named_modules() if is_fused_experts(m)}
    for name, mod in fused.items():
        mod.register_forward_hook(
            lambda m, args, out, name=name: seen.setdefault(name, []).append(
                (args[0].detach(), args[1].detach())))
    with torch.no_grad():
        for batch in ids.split(4):
            model(input_ids=batch)
    layer = {int(re.search(r"layers\.(\d+)\.", n).group(1)): n for n in fused}
    checked = 0
    for experts, tokens in result.expert_tokens.items():
        theirs = layer[int(re.search(r"layers\.(\d+)\.", experts).group(1))]
        mod = fused[theirs]
        leaves = sorted({k.rsplit(".", 1)[1] for k in result.amax if k.startswith(experts)})
        down = next(leaf for leaf in leaves if leaf in ("w2", "down_proj"))
        inter = mod.gate_up_proj.shape[1] // 2
        routed = [0] * mod.num_experts
        for e in range(mod.num_experts):
            gate, up = mod.gate_up_proj[e, :inter], mod.gate_up_proj[e, inter:]
            x_all = h_all = x_routed = h_routed = 0.0
            for x, top_k in seen[theirs]:
                with torch.no_grad():
                    h = mod.act_fn(torch.nn.functional.linear(x, gate)) * \
                        torch.nn.functional.linear(x, up)
                rows = (top_k == e).any(dim=-1)
                routed[e] += int(rows.sum())
                x_all = max(x_all, x.float().abs().max().item())
                h_all = max(h_all, h.float().abs().max().item())
                if rows.any():
                    x_routed = max(x_routed, x[rows].float().abs().max().item())
                    h_routed = max(h_routed, h[rows].float().abs().max().item())
            for leaf in leaves:
                got = result.amax[f"{experts}.{e}.{leaf}"]
                want, own = (h_all, h_routed) if leaf == down else (x_all, x_routed)
                # within one bf16 step: the reference model is transformers' own, whose
                # hidden states may round differently from the calibration model's
                assert got == pytest.approx(want, rel=8e-3), (experts, e, leaf)
                assert got >= own  # its routed tokens are among them
                checked += 1
        assert routed == tokens  # and the routed counts are transformers' own routing
    assert checked == 2 * 4 * 3
