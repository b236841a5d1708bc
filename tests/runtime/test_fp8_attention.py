"""FP8 attention and the FP8 KV cache on the CPU: the emulation's math, the cache's bytes, decode
through the cache against the full forward, and the Triton kernel's logic in the interpreter."""

import math
import os
import subprocess
import sys
import textwrap
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from fp8export.runtime.attention_math import (
    MaskInfo,
    fp8_attention_reference,
    head_scales,
    quantize_heads,
    quantize_rows,
)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _direct(q, k8, v8, ks, vs, info, sm):
    """The same function written plainly in float64 (full softmax, P unrounded)."""
    q8, sq = quantize_rows(q)
    g = q.shape[1] // k8.shape[1]
    kf = (k8.double() * ks.double().view(1, -1, 1, 1)).repeat_interleave(g, 1)
    vf = (v8.double() * vs.double().view(1, -1, 1, 1)).repeat_interleave(g, 1)
    s = (q8.double() * sq.double()) @ kf.transpose(-1, -2) * sm
    tq, tk = q.shape[2], k8.shape[2]
    j = torch.arange(tk)
    pos = torch.arange(tq) + info.q_start
    ok = j[None, :] <= pos[:, None]
    if info.window:
        ok &= pos[:, None] - j[None, :] < info.window
    if info.key_mask is not None:
        ok = ok[None, None] & info.key_mask[:, None, None, :]
    p = torch.softmax(s.masked_fill(~ok, -math.inf), -1)
    return (p @ vf).transpose(1, 2)


@pytest.mark.parametrize("window,padded,q_start", [(0, False, 0), (24, False, 0),
                                                   (0, True, 0), (0, False, 90)])
def test_emulation_is_fp8_attention(window, padded, q_start):
    torch.manual_seed(0)
    b, hq, hkv, tq, d = 2, 6, 2, 100, 32
    tk = q_start + tq
    q = torch.randn(b, hq, tq, d)
    k, v = torch.randn(b, hkv, tk, d) * 3, torch.randn(b, hkv, tk, d)
    ks, vs = head_scales(torch.tensor([0.03, 0.02]), hkv), head_scales(0.01, hkv)
    km = None
    if padded:
        km = torch.ones(b, tk, dtype=torch.bool)
        km[1, :10] = False
    info = MaskInfo(q_start, True, window, km)
    k8, v8 = quantize_heads(k, ks), quantize_heads(v, vs)
    want = _direct(q, k8, v8, ks, vs, info, d ** -0.5)
    rows = slice(None) if not padded else (slice(None), slice(10, None))
    for p_fp8, bound in ((False, 1e-2), (True, 5e-2)):  # P rounded to bf16 / E4M3
        got = fp8_attention_reference(q, k8, v8, ks, vs, sm_scale=d ** -0.5, info=info,
                                      p_fp8=p_fp8, out_dtype=torch.float32)
        err = _rel(got[rows], want[rows])
        assert err < bound, (p_fp8, err)
        assert err > 1e-5  # P is rounded: not the float64 softmax itself


def test_prefill_tiles_fill_the_gpu(monkeypatch):
    """128-row tiles for long prompts; halved while the grid would leave multiprocessors idle
    (a short prompt on a 132-SM H200), never below 16 rows; the environment forces a tiling."""
    from fp8export.runtime.fp8_attention import prefill_config

    monkeypatch.delenv("FP8EXPORT_ATTN_CONFIG", raising=False)
    assert prefill_config(4 * 2048, 8 * 8, 132)["BLOCK_M"] == 128  # 8x2048, GQA 32/8
    assert prefill_config(4 * 512, 32 * 8, 132)["BLOCK_M"] == 128  # 32x512
    assert prefill_config(4 * 128, 8, 132)["BLOCK_M"] == 16  # 1x128: 256 tiles, not 32
    assert prefill_config(4 * 300, 2 * 2, 132)["BLOCK_M"] == 32  # 38 tiles of 32 x 4 heads
    assert prefill_config(4 * 128, 8, 0)["BLOCK_M"] == 128  # no GPU known: as before
    assert prefill_config(48, 1, 132)["BLOCK_M"] == 16 and prefill_config(48)["BLOCK_M"] == 64
    monkeypatch.setenv("FP8EXPORT_ATTN_CONFIG", "128,8,3")
    assert prefill_config(4 * 128, 8, 132) == {"BLOCK_M": 128, "num_warps": 8, "num_stages": 3}


def test_p_rounding_follows_the_kernels_key_blocks():
    """The emulation rounds each block's p against the running max, as the kernel does: over
    more than one block that differs from rounding the final probabilities."""
    from fp8export.runtime.attention_math import KEY_BLOCK

    torch.manual_seed(1)
    t = 3 * KEY_BLOCK
    q = torch.randn(1, 1, t, 64)
    k8 = quantize_heads(torch.randn(1, 1, t, 64) * 4, torch.tensor([0.02]))
    v8 = quantize_heads(torch.randn(1, 1, t, 64), torch.tensor([0.01]))
    s = torch.tensor([0.02]), torch.tensor([0.01])
    got = fp8_attention_reference(q, k8, v8, *s, sm_scale=0.125, info=MaskInfo(),
                                  p_fp8=True, out_dtype=torch.float32)
    assert torch.isfinite(got).all()
    first = fp8_attention_reference(q[:, :, :KEY_BLOCK], k8[:, :, :KEY_BLOCK],
                                    v8[:, :, :KEY_BLOCK], *s, sm_scale=0.125, info=MaskInfo(),
                                    p_fp8=True, out_dtype=torch.float32)
    assert torch.equal(got[:, :KEY_BLOCK], first)  # one block: nothing to rescale


def _tiny_llama(heads=4, kv=2):
    """A random 2-layer Llama whose attention is not uniform: at init (std 0.02) its scores are
    ~0.05 and every key weighs the same, so the keys' rounding could not show; q_proj and
    k_proj x10 give scores of a few units, as a trained model has."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=100,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    return model


def _kv_scales(model, ids) -> dict[str, tuple[float, float]]:
    """(k_scale, v_scale) = amax / 448 per attention layer on ``ids`` (keys after RoPE), as
    ``convert --kv-cache fp8`` calibrates them."""
    from fp8export.runtime.kv_cache import kv_hook

    amax: dict[str, list[float]] = {}

    def observe(name, key, value):
        a = amax.setdefault(name, [0.0, 0.0])
        a[0], a[1] = max(a[0], float(key.abs().max())), max(a[1], float(value.abs().max()))
        return key, value

    with torch.no_grad(), kv_hook(model, observe):
        model(input_ids=ids)
    return {n: (k / 448, v / 448) for n, (k, v) in amax.items()}


def test_fp8_cache_holds_half_the_bytes_and_decodes_as_the_full_forward():
    from transformers import StaticCache

    from fp8export.runtime import attention
    from fp8export.runtime.fp8_kv_cache import cache_bytes, fp8_static_cache

    model = _tiny_llama()
    ids = torch.randint(0, 100, (2, 24))
    with torch.no_grad():
        bf16 = StaticCache(config=model.config, max_cache_len=32)
        _tiny_llama().to(torch.bfloat16)(input_ids=ids[:, :4], past_key_values=bf16,
                                         use_cache=True)
        attention.install(model, _kv_scales(model, ids), mode="fp8")
        full = model(input_ids=ids).logits
        cache = fp8_static_cache(model, 32)
        steps = [model(input_ids=ids[:, :16], past_key_values=cache,
                       use_cache=True).logits[:, -1]]
        for t in range(16, 24):
            steps.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache,
                               use_cache=True).logits[:, -1])
    assert cache.layers[0].keys.dtype == torch.float8_e4m3fn
    assert cache_bytes(cache) * 2 == cache_bytes(bf16) > 0
    assert _rel(torch.stack(steps, 1), full[:, 15:24]) < 1e-5


def test_modes_switch_and_a_wrong_scale_shows():
    from fp8export.runtime import attention

    model = _tiny_llama()
    ids = torch.randint(0, 100, (2, 20))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        scales = _kv_scales(model, ids)
        attention.install(model, scales, mode="kv")
        kv = model(input_ids=ids).logits
        attention.set_mode(model, "fp8")
        fp8 = model(input_ids=ids).logits
        attention.set_mode(model, "off")
        assert torch.equal(model(input_ids=ids).logits, ref)
        # layer 0's k_scale 8x too small: its largest keys clip at 448 (E4M3 is a float
        # format, so a scale too large only costs the smallest keys' precision)
        attention.install(model, {n: (ks / (8 if i == 0 else 1), vs)
                                  for i, (n, (ks, vs)) in enumerate(sorted(scales.items()))},
                          mode="fp8")
        bad = model(input_ids=ids).logits
    assert 0 < _rel(kv, ref) < 0.1 and 0 < _rel(fp8, ref) < 0.1
    assert _rel(bad, ref) > 1.5 * _rel(fp8, ref)


def _compile_recorder():
    """A torch.compile backend that records, per compiled graph, what Inductor checks before it
    captures a CUDA graph (``torch._inductor.cudagraph_utils``): the graph inputs whose data the
    graph mutates must all be static inputs (parameters, buffers, tensors marked with
    ``mark_static_address``, as a static KV cache is), and no node may be unsafe for a graph
    (a host sync such as ``.item()``, data-dependent shapes, ops tagged cudagraph-unsafe). It
    runs the functionalized graph itself, so the outputs are those of the traced program."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    graphs: list[dict] = []

    def fw(gm, inputs):
        meta = torch._guards.TracingContext.get().fw_metadata
        mutated = [i for i, info in enumerate(meta.input_info) if info.mutates_data]
        unsafe = get_first_incompatible_cudagraph_node(gm)
        graphs.append({"mutated": mutated, "static": set(meta.static_input_indices),
                       "unsafe": None if unsafe is None else str(unsafe.target),
                       "ops": {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}})
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

    return backend, graphs


@pytest.mark.slow  # two torch.compile traces of a tiny Llama (~30 s each on 2 cores)
@pytest.mark.parametrize("path", ["emulation", "kernel"])
def test_compiled_decode_step_is_one_cuda_graph_capturable_graph(monkeypatch, path):
    """The decode step a server compiles with ``mode="reduce-overhead"``: prefill eager, then
    one-token steps with the FP8 cache and the position on the device. On a CPU: one graph
    (``fullgraph``: no graph break), compiled once for all steps (no recompilation as the
    position advances), the cache written in place into its static buffers only, nothing that
    would stop a CUDA graph; and the steps' logits are the eager ones. ``kernel``: the path a
    GPU with FP8 tensor cores traces (the attention as the ``fp8export::fp8_attention`` custom
    op, whose CPU implementation is the emulation)."""
    from fp8export.runtime import attention
    from fp8export.runtime import fp8_attention as fa
    from fp8export.runtime.fp8_kv_cache import fp8_static_cache

    model = _tiny_llama().to(torch.bfloat16)  # the kernel takes 16-bit queries
    ids = torch.randint(0, 100, (2, 20))
    attention.install(model, _kv_scales(model, ids), mode="fp8")

    def decode(fwd, steps, kernel=False):
        cache = fp8_static_cache(model, 32)
        with torch.no_grad():
            out = model(input_ids=ids[:, :16], past_key_values=cache, use_cache=True)
            if kernel:  # the steps (compiled) take the GPU's path; the prefill ran eager
                monkeypatch.setattr(fa, "kernel_available", lambda device: not fa._EMULATE[-1])
            pos = torch.tensor([16])
            tok, logits = out.logits[:, -1:].argmax(-1), []
            for _ in range(steps):
                out = fwd(input_ids=tok, past_key_values=cache, use_cache=True,
                          cache_position=pos, position_ids=pos.expand(2, 1))
                tok = out.logits[:, -1:].argmax(-1)
                logits.append(out.logits[:, -1])
                pos.add_(1)
        return torch.stack(logits, 1), cache

    want, _ = decode(model, 3)
    backend, graphs = _compile_recorder()
    torch._dynamo.reset()
    try:
        got, cache = decode(torch.compile(model, backend=backend, fullgraph=True,
                                          dynamic=False), 3, kernel=path == "kernel")
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1, f"{len(graphs)} graphs: recompiled as the position advanced"
    g = graphs[0]
    assert g["unsafe"] is None, g["unsafe"]
    assert g["mutated"], "the cache write must be an in-place update inside the graph"
    assert set(g["mutated"]) <= g["static"], "mutated inputs that are not static buffers"
    assert ("fp8export.fp8_attention.default" in g["ops"]) == (path == "kernel")
    assert cache.layers[0].keys.dtype == torch.float8_e4m3fn
    assert _rel(got, want) < 1e-5, _rel(got, want)


@pytest.mark.slow  # one torch.compile trace of a tiny Llama
def test_compiled_prefill_with_a_padding_mask_takes_the_kernel(monkeypatch):
    """Compiled prefill as a server runs it (with the padding mask): the attention is the
    kernel's custom op in one graph, no graph break. (Without an ``attention_mask``,
    transformers' compiled mask is the packed-sequence one, which it cannot rule out while
    tracing; the kernel does not take that mask and the step would trace the torch emulation.)"""
    from fp8export.runtime import attention
    from fp8export.runtime import fp8_attention as fa

    model = _tiny_llama().to(torch.bfloat16)
    ids = torch.randint(0, 100, (2, 24))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    attention.install(model, _kv_scales(model, ids), mode="fp8")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    monkeypatch.setattr(fa, "kernel_available", lambda device: not fa._EMULATE[-1])
    backend, graphs = _compile_recorder()
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            got = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(
                input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1 and graphs[0]["unsafe"] is None
    assert "fp8export.fp8_attention.default" in graphs[0]["ops"]
    assert _rel(got[1], want[1]) < 1e-4 and _rel(got[0, 5:], want[0, 5:]) < 1e-4


@pytest.mark.slow
@pytest.mark.skipif(find_spec("triton") is None, reason="needs triton (the interpreter)")
def test_kernel_logic_in_the_triton_interpreter():
    """The kernels run in Triton's CPU interpreter must compute the emulation's function to
    float32 rounding (the interpreter's own fp32->bf16/E4M3 casts are wrong, so the kernel
    rounds exactly there and writes fp32)."""
    code = textwrap.dedent("""
        import numpy as np, torch
        from triton.runtime import interpreter as it
        orig = it._patch_lang_tensor
        def patched(tensor, scope):  # numpy 2 refuses int() of a 1-element array
            orig(tensor, scope)
            scope.set_attr(tensor, "__index__",
                           lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
        it._patch_lang_tensor = patched
        from fp8export.runtime import fp8_attention as fa
        from fp8export.runtime.attention_math import (MaskInfo, fp8_attention_reference,
                                                      quantize_heads, head_scales)
        worst = 0.0
        for b, hq, hkv, tq, tk, d, q0, win, pad in [(1, 4, 2, 70, 70, 64, 0, 0, False),
                                                    (2, 6, 2, 5, 80, 32, 75, 0, True),
                                                    (2, 2, 1, 140, 140, 64, 0, 0, True),
                                                    (1, 2, 1, 40, 40, 64, 0, 16, False)]:
            g = torch.Generator().manual_seed(tq)
            q = torch.randn(b, hq, tq, d, generator=g).bfloat16().float()
            k = (torch.randn(b, hkv, tk, d, generator=g) * 2).bfloat16()
            v = torch.randn(b, hkv, tk, d, generator=g).bfloat16()
            ks = head_scales(k.float().abs().amax(dim=(0, 2, 3)) / 448, hkv)
            vs = head_scales(0.01, hkv)
            km = None
            if pad:
                km = torch.ones(b, tk, dtype=torch.bool); km[0, :9] = False
            emu = fp8_attention_reference(q, quantize_heads(k, ks), quantize_heads(v, vs), ks,
                                          vs, sm_scale=d ** -0.5,
                                          info=MaskInfo(q0, True, win, km), p_fp8=True,
                                          out_dtype=torch.float32)
            out = fa.launch_attention(q, k, v, ks, vs, km, None, q0, d ** -0.5, True, win, True)
            worst = max(worst, float((out - emu).norm() / emu.norm()))
        kc = torch.zeros(1, 2, 96, 64, dtype=torch.float8_e4m3fn)
        vc = torch.zeros(1, 2, 64, 96, dtype=torch.float8_e4m3fn)
        k, v = torch.randn(1, 2, 7, 64) * 5, torch.randn(1, 2, 7, 64)
        s = head_scales(0.02, 2)
        fa.launch_kv_write(k, v, s, s, kc, vc, torch.tensor(40))
        same = torch.equal(kc[:, :, 40:47].view(torch.uint8),
                           quantize_heads(k, s).view(torch.uint8))
        print(worst, same)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    worst, same = out.stdout.split()[-2:]
    assert float(worst) < 1e-5 and same == "True", out.stdout
