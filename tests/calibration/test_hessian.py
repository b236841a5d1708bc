"""Second moments of linear inputs for --weight-rounding gptq (calibration/hessian.py)."""

from pathlib import Path

import torch

from fp8export.calibration.hessian import input_hessians

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "tiny-llama"
MODEL, CALIB = SAMPLE / "model", SAMPLE / "data" / "calib.txt"
QKV = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
DOWN = "model.layers.1.mlp.down_proj"


def test_hessian_is_the_sum_of_outer_products_of_real_tokens():
    from fp8export.inputs.samples import iter_batches, load_samples
    from fp8export.models import load_model

    mods = QKV + [DOWN]
    got = input_hessians(MODEL, CALIB, mods, {"model.layers.0.self_attn.qkv": QKV}, samples=6,
                         seq_len=64, batch_size=4, device="cpu")
    # fused members share one stream
    assert got.stream[QKV[1]] == got.stream[QKV[2]] == QKV[0]
    assert set(got.hessian) == {QKV[0], DOWN} and got.samples == 6 and got.passes == 1
    # by hand: the same bf16 model, inputs of the real (unpadded) tokens only
    model, _ = load_model(MODEL, dtype=torch.bfloat16, device="cpu")
    xs = {QKV[0]: [], DOWN: []}
    rows = {}
    hooks = [model.get_submodule(m).register_forward_pre_hook(
        lambda _m, a, m=m: xs[m].append(a[0].reshape(-1, a[0].shape[-1])[rows["r"]].float()))
        for m in xs]
    samples = load_samples(CALIB, MODEL, max_samples=6, seq_len=64)
    tokens = 0
    with torch.no_grad():
        for b in iter_batches(samples, 4):
            rows["r"] = b.attention_mask.reshape(-1) > 0
            tokens += int(rows["r"].sum())
            model(input_ids=b.input_ids, attention_mask=b.attention_mask)
    for h in hooks:
        h.remove()
    assert 0 < tokens <= 6 * 64
    for m, parts in xs.items():
        x = torch.cat(parts)
        h, n = got.of(m)
        assert n == tokens == x.shape[0]
        want = x.T @ x
        assert torch.allclose(h, want, rtol=1e-4, atol=1e-3 * float(want.abs().max()))


def test_a_small_budget_takes_more_passes_and_gives_the_same_matrices():
    mods = [f"model.layers.{i}.mlp.down_proj" for i in range(3)]
    one = input_hessians(MODEL, CALIB, mods, {}, samples=4, seq_len=32, batch_size=4,
                         device="cpu")
    dim = one.hessian[mods[0]].shape[0]
    split = input_hessians(MODEL, CALIB, mods, {}, samples=4, seq_len=32, batch_size=4,
                           device="cpu", budget=4 * dim * dim)
    assert one.passes == 1 and split.passes == 3
    for m in mods:
        assert torch.equal(one.hessian[m], split.hessian[m])
