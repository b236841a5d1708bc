"""Sensitivity ranking and the --accuracy-budget selection (emulated FP8, fp32 reference)."""

import json

import pytest

from fp8export.errors import Fp8ExportError
from fp8export.verify.sensitivity import sensitivity


def _modules(fp8_dir):
    return list(json.loads((fp8_dir / "fp8export.json").read_text())["quantized"])


def test_ranking_and_greedy_budget(tiny_llama, tiny_fp8, eval_npz):
    mods = _modules(tiny_fp8)
    free = sensitivity(tiny_llama, mods, budget_kl=10.0, data=eval_npz, samples=8)
    assert free["keep"] == [] and free["kl_after"] == free["kl_all"]
    kls = [r["kl"] for r in free["ranking"]]
    assert len(kls) == len(mods) and kls == sorted(kls, reverse=True) and min(kls) >= 0
    assert 0 < free["kl_all"] < 0.05
    budget = free["kl_all"] / 3
    tight = sensitivity(tiny_llama, mods, budget_kl=budget, data=eval_npz, samples=8)
    assert tight["keep"] and tight["kl_after"] <= budget < tight["kl_all"]
    assert tight["keep"][0] == tight["ranking"][0]["module"]  # most sensitive goes first
    assert [s["kept"] for s in tight["steps"]] == tight["keep"]


def test_convert_accuracy_budget_keeps_layers(tiny_llama, eval_npz, tmp_path):
    from fp8export import api
    from fp8export.config import ConvertConfig

    out = tmp_path / "budget"
    api.convert(ConvertConfig(checkpoint=tiny_llama, output=out, calib_data=eval_npz,
                              accuracy_budget=1e-5))
    excluded = json.loads((out / "fp8export.json").read_text())["excluded"]
    kept = [k for k, why in excluded.items() if "accuracy-budget" in why]
    assert kept, excluded


def test_bad_budget(tiny_llama, tiny_fp8):
    with pytest.raises(Fp8ExportError, match="KL > 0"):
        sensitivity(tiny_llama, _modules(tiny_fp8), budget_kl=0.0)


def _folder_kl(reference, fp8_dir, data) -> float:
    """KL(reference‖FP8 folder) per token, the folder run by the torch FP8 runner (emulation),
    on the batches sensitivity measures on."""
    import torch

    from fp8export.inputs.samples import iter_batches
    from fp8export.models import load_model
    from fp8export.runners.fp8_model import load_fp8_model
    from fp8export.verify.data import load_verify_samples
    from fp8export.verify.sensitivity import DEFAULT_SEQ_LEN

    ref, config = load_model(reference, dtype=torch.float32)
    fp8, *_ = load_fp8_model(fp8_dir, dtype=torch.float32, mode="emulate", fuse=False)
    samples, _ = load_verify_samples(data, reference, config, samples=8, seq_len=DEFAULT_SEQ_LEN)
    total, count = 0.0, 0
    with torch.inference_mode():
        for b in iter_batches(samples, 8):
            keep = b.attention_mask > 0
            lp, lq = (torch.log_softmax(m(input_ids=b.input_ids, attention_mask=b.attention_mask)
                                        .logits[keep].double(), -1) for m in (ref, fp8))
            kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0)
            total, count = total + float(kl.sum()), count + kl.numel()
    return total / count


def test_fused_groups_share_the_scales_convert_writes(tiny_llama, eval_npz, tmp_path):
    """With convert's fused groups, sensitivity's all-FP8 model is the folder convert writes."""
    from fp8export import api
    from fp8export.config import ConvertConfig

    out = tmp_path / "weights-only"
    api.convert(ConvertConfig(checkpoint=tiny_llama, output=out, scales="weights"))
    quantized = json.loads((out / "fp8export.json").read_text())["quantized"]
    groups: dict[str, list[str]] = {}
    for module, entry in quantized.items():
        if entry.get("fused_group"):
            groups.setdefault(entry["fused_group"], []).append(module)
    assert groups
    shared = sensitivity(tiny_llama, list(quantized), data=eval_npz, samples=8,
                         static_inputs=False, groups=groups)
    alone = sensitivity(tiny_llama, list(quantized), data=eval_npz, samples=8,
                        static_inputs=False)
    folder = _folder_kl(tiny_llama, out, eval_npz)
    assert shared["kl_all"] == pytest.approx(folder, rel=1e-6)
    assert alone["kl_all"] != pytest.approx(folder, rel=1e-3)  # per-layer scales differ
