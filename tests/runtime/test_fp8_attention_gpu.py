"""The FP8 attention kernel and the FP8 KV-cache write on the GPU against their one definition:
the torch emulation (``attention_math``) run on the CPU, as ``verify`` runs it. The emulation
must predict the GPU result within a bound that the arithmetic explains, or verify on a CPU
says nothing about the GPU.

The bound (:data:`BOUND`, rel-L2 of the kernel's bf16 output against the emulation's fp32
output) is a budget of named differences, not a measured value:

* the operands are the same bits: queries, keys and values are divided correctly rounded
  (``div_rn``) and cast round-to-nearest-even with saturation on both, so Q8, K8 and V8 agree
  (the cache write is checked bit for bit below);
* the kernel rounds its output to bf16: at most 2⁻⁹ of each value, so at most 2⁻⁹ = 1.95e-3 in
  rel-L2;
* the GPU's arithmetic: its FP8 tensor cores accumulate the products in less than fp32 inside a
  32-product step (about 14 bits retained: DeepSeek-V3 report §3.3.2; the kernel promotes to
  fp32 after every 32) and in another order than the CPU, and ``tl.exp2`` is ex2.approx (2
  ulp). :func:`test_bound_covers_the_gpus_arithmetic` (CPU) perturbs every product sum of the
  emulation by a relative 2⁻¹³ and every exp2 by 2⁻²² and measures how far the output moves:
  ≤ 2.8e-3 with P in E4M3 (P's E4M3 rounding turns small differences into whole E4M3 steps),
  ≤ 1.0e-3 with P in bf16 (over the cases below, two draws each).

1.95e-3 + 2.8e-3 < 5e-3 = BOUND. A case above it has a difference this budget does not name.
"""

import math

import pytest
import torch

from fp8export.runtime.attention_math import (
    MaskInfo,
    fp8_attention_reference,
    head_scales,
    quantize_heads,
)

BOUND = 5e-3
BF16_OUTPUT = 2.0 ** -9  # the kernel's output rounding, relative to each value
ACCUMULATION = 2.0 ** -13  # relative error of a product sum on FP8 tensor cores (see above)
EXP2 = 2.0 ** -22  # ex2.approx.f32

CASES = [  # b, hq, hkv, tq, tk, d, q_start, window, key padding
    (2, 8, 2, 300, 300, 64, 0, 0, False),      # prefill, GQA 4
    (1, 4, 4, 129, 129, 128, 0, 0, True),      # prefill, MHA, padded keys
    (2, 8, 2, 200, 200, 64, 0, 64, False),     # sliding window
    (3, 32, 8, 1, 384, 64, 299, 0, False),     # decode from a static cache position
    (2, 9, 3, 7, 90, 64, 83, 0, True),         # a chunk after a cached prefix
]


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def _inputs(b, hq, hkv, tq, tk, d, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, hq, tq, d, device=device, generator=g).bfloat16()
    k = (torch.randn(b, hkv, tk, d, device=device, generator=g) * 2).bfloat16()
    v = torch.randn(b, hkv, tk, d, device=device, generator=g).bfloat16()
    ks = head_scales(k.float().abs().amax(dim=(0, 2, 3)) / 448, hkv, device)
    vs = head_scales(float(v.float().abs().max()) / 448, hkv, device)
    return q, k, v, ks, vs


def _case(case, device):
    b, hq, hkv, tq, tk, d, q_start, window, padded = case
    q, k, v, ks, vs = _inputs(b, hq, hkv, tq, tk, d, tq + tk, device)
    key_mask = None
    if padded:
        key_mask = torch.ones(b, tk, dtype=torch.bool, device=device)
        key_mask[0, : tk // 5] = False  # left padding of the first sequence
    return (q, k, v, ks, vs), MaskInfo(q_start, True, window, key_mask)


def _emulation(q, k, v, ks, vs, info, p_fp8):
    """The CPU emulation in fp32 (what verify computes), on CPU copies of the inputs."""
    cpu = [t.cpu() for t in (q, k, v, ks, vs)]
    km = None if info.key_mask is None else info.key_mask.cpu()
    q, k, v, ks, vs = cpu
    return fp8_attention_reference(q, quantize_heads(k, ks), quantize_heads(v, vs), ks, vs,
                                   sm_scale=q.shape[-1] ** -0.5,
                                   info=MaskInfo(int(info.q_start), True, info.window, km),
                                   p_fp8=p_fp8, out_dtype=torch.float32)


def _exact(q, k, v, info):
    """16-bit inputs, fp32 attention: what FP8 attention approximates."""
    from fp8export.runtime.attention_math import allowed

    g = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(g, 1)
    vv = v.float().repeat_interleave(g, 1)
    s = (q.float() @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    ok = allowed(info, q.shape[0], q.shape[2], k.shape[2], q.device)
    p = torch.softmax(s.masked_fill(~ok, -math.inf), dim=-1).nan_to_num(0.0)
    return (p @ vv).transpose(1, 2)


def _rows(case, device):
    """Query rows with a key to read (left-padded rows read none: zeros in both)."""
    b, _, _, tq, tk, _, q_start, _, padded = case
    rows = torch.ones(b, tq, dtype=torch.bool, device=device)
    if padded:
        rows[0, : max(0, tk // 5 - q_start)] = False
    return rows


@pytest.mark.parametrize("p_fp8", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_bound_covers_the_gpus_arithmetic(monkeypatch, case, p_fp8):
    """On the CPU: the emulation with every product sum off by a relative ACCUMULATION and
    every exp2 by EXP2 (random signs) stays within BOUND - BF16_OUTPUT of itself. This is the
    budget the GPU test spends; a change to the emulation that makes it more sensitive (or a
    case that is) shows here, on every machine."""
    args, info = _case(case, "cpu")
    base = _emulation(*args, info, p_fp8)
    rows = _rows(case, "cpu")
    exp2, matmul = torch.exp2, torch.Tensor.__matmul__
    worst = 0.0
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)

        def noisy(y, rel, g=g):
            return y * (1 + rel * (2 * torch.rand(y.shape, generator=g) - 1))

        monkeypatch.setattr(torch, "exp2", lambda x: noisy(exp2(x), EXP2))
        monkeypatch.setattr(torch.Tensor, "__matmul__",
                            lambda a, b: noisy(matmul(a, b), ACCUMULATION))
        moved = _emulation(*args, info, p_fp8)
        monkeypatch.undo()
        worst = max(worst, _rel(moved[rows], base[rows]))
    assert 0 < worst <= BOUND - BF16_OUTPUT, worst


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("p_fp8", [True, False])
def test_kernel_matches_emulation(case, p_fp8):
    from fp8export.runtime.fp8_attention import fp8_attention, kernel_available

    if not torch.cuda.is_available() or not kernel_available(torch.device("cuda")):
        pytest.skip("needs Triton and a GPU with FP8 tensor cores")
    (q, k, v, ks, vs), info = _case(case, "cuda")
    if case[3] == 1:  # decode: the position as a device tensor, as a static cache gives it
        info = info._replace(q_start=torch.tensor(info.q_start, device="cuda"))
    got = fp8_attention(q, k, v, ks, vs, sm_scale=q.shape[-1] ** -0.5, info=info, p_fp8=p_fp8)
    assert got.is_cuda and torch.isfinite(got).all()
    emu = _emulation(q, k, v, ks, vs, info, p_fp8)
    rows = _rows(case, "cpu")
    agree = _rel(got.cpu()[rows], emu[rows])
    cost = _rel(got.cpu()[rows], _exact(q, k, v, info._replace(q_start=case[6])).cpu()[rows])
    assert agree <= BOUND, (agree, cost)


@pytest.mark.gpu
def test_kv_write_is_bit_identical_to_the_cpu_quantizer():
    from fp8export.runtime.fp8_attention import kernel_available, launch_kv_write

    if not torch.cuda.is_available() or not kernel_available(torch.device("cuda")):
        pytest.skip("needs Triton and a GPU with FP8 tensor cores")
    q, k, v, ks, vs = _inputs(2, 8, 4, 5, 37, 64, 1, "cuda")
    kc = torch.zeros(2, 4, 64, 64, dtype=torch.float8_e4m3fn, device="cuda")
    vc = torch.zeros(2, 4, 64, 64, dtype=torch.float8_e4m3fn, device="cuda")
    start = torch.tensor(20, device="cuda")
    launch_kv_write(k, v, ks, vs, kc, vc, start)
    want_k = quantize_heads(k.cpu(), ks.cpu()).view(torch.uint8)
    want_v = quantize_heads(v.cpu(), vs.cpu()).view(torch.uint8).transpose(2, 3)
    got_k, got_v = kc.view(torch.uint8).cpu(), vc.view(torch.uint8).cpu()
    assert torch.equal(got_k[:, :, 20:57], want_k)
    assert torch.equal(got_v[:, :, :, 20:57], want_v)
    assert not got_k[:, :, :20].any() and not got_k[:, :, 57:].any()


@pytest.mark.gpu
def test_model_decode_with_fp8_cache_kernel_vs_emulation():
    """A small bf16 Llama on the GPU: prefill then decode with the FP8 cache through the kernels,
    against the same model with its attention in the emulation (``emulated()``: the same
    function as on the CPU, on the GPU so that the linears are the same bits). Layer 0 reads the
    same inputs in both: its cache bytes must be equal. The logits: each layer's attention is
    within BOUND of the emulation (above); the 4 layers add such differences to the residual
    stream, so 2 x BOUND is a coarse end-to-end check, with FP8's own cost several times
    larger."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fp8export.runtime import attention
    from fp8export.runtime.fp8_attention import emulated, kernel_available
    from fp8export.runtime.fp8_kv_cache import fp8_static_cache

    if not torch.cuda.is_available() or not kernel_available(torch.device("cuda")):
        pytest.skip("needs Triton and a GPU with FP8 tensor cores")
    torch.backends.cuda.matmul.allow_tf32 = False  # the emulation's fp32 matmuls in fp32
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, vocab_size=512,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    attention.install(model, {n: (0.02, 0.02) for n in attention.attention_layers(model)},
                      mode="fp8")
    ids = torch.randint(0, 512, (2, 140), device="cuda")

    def run():
        cache = fp8_static_cache(model, 160)
        with torch.no_grad():
            logits = [model(input_ids=ids[:, :130], past_key_values=cache,
                            use_cache=True).logits[:, -1]]
            for t in range(130, 140):
                logits.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache,
                                    use_cache=True).logits[:, -1])
        return torch.stack(logits, 1).float(), cache

    got, cache = run()
    with emulated():
        want, want_cache = run()
    a, b = cache.layers[0], want_cache.layers[0]
    assert torch.equal(a.keys.view(torch.uint8), b.keys.view(torch.uint8))
    assert torch.equal(a.values_t.view(torch.uint8), b.values_t.view(torch.uint8))
    attention.set_mode(model, "off")
    with torch.no_grad():
        bf16 = model(input_ids=ids).logits[:, 129:140].float()
    agree, cost = _rel(got, want), _rel(got, bf16)
    assert agree <= 2 * BOUND and cost >= 4 * agree, (agree, cost)
