"""Fused q/k/v and gate/up: one GEMM per group, split after it, same function as the members."""

import json

import pytest
import torch

from fp8export.numerics.fp8 import amax_to_scale, quantize_e4m3
from fp8export.numerics.metrics import rel_l2
from fp8export.runners.torch_fp8_runner import TorchFp8Runner
from fp8export.runtime.fp8_fused import Fp8FusedLinear, Fp8LinearSlice, fusable, fuse_projections
from fp8export.runtime.fp8_linear import Fp8Linear
from fp8export.runtime.fp8_model import fp8_modules, load_fp8_model


@pytest.fixture(scope="module")
def llama_fp8(tmp_path_factory):
    """A random tiny Llama with q/k/v biases (Qwen2-style) converted by the real convert."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fp8export import api
    from fp8export.convert.config import ConvertConfig

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("llama")
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                      max_position_embeddings=64, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "ref")
    # per-tensor dynamic inputs: members scaled per token run as separate GEMMs
    api.convert(ConvertConfig(checkpoint=root / "ref", output=root / "fp8",
                              dynamic_activations="tensor"))
    return root / "fp8"


def _members(n_out=(48, 16, 16), in_f=32, bias=(True, False, True), static=True, seed=0,
             dtype=torch.float32):
    """Fp8Linears sharing one weight scale and one input scale, as convert writes a group."""
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(n, in_f, generator=g) * 0.05 for n in n_out]
    w_scale = amax_to_scale(max(float(w.abs().max()) for w in ws))
    s_in = float(amax_to_scale(3.0)) if static else None
    return [Fp8Linear(quantize_e4m3(w, w_scale), w_scale, s_in,
                      torch.randn(n, generator=g) if b else None, mode="emulate", out_dtype=dtype)
            for w, n, b in zip(ws, n_out, bias)]


def _dequantized(layer) -> torch.Tensor:
    return layer.weight.float() * layer.weight_scale


class _Parent(torch.nn.Module):
    def __init__(self, members):
        super().__init__()
        self.q, self.k, self.v = members


@pytest.mark.parametrize("static", [True, False])
def test_each_slice_computes_its_member(static):
    members = _members(static=static)
    x = torch.randn(2, 5, 32) * 2
    want = [m(x) for m in members]
    parent = _Parent(members)
    assert fuse_projections(parent, {"qkv": ["q", "k", "v"]}) == {}
    assert isinstance(parent.fused_qkv, Fp8FusedLinear) and parent.fused_qkv.splits == [48, 16, 16]
    got = [parent.q(x), parent.k(x), parent.v(x)]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert parent.fused_qkv._slot.value is None  # released once every member took its slice
    # the slices are views of the group's buffers: no second copy of any weight
    assert parent.k.weight.untyped_storage().data_ptr() == \
        parent.fused_qkv.weight.untyped_storage().data_ptr()
    assert parent.k.bias is None and parent.v.bias is not None
    torch.testing.assert_close(_dequantized(parent.v), _dequantized(members[2]))


@pytest.mark.parametrize("static", [True, False])
def test_a_slice_is_a_whole_fp8_linear(static):
    """Everything an Fp8Linear offers works on a slice as on the member it replaced: its repr
    (print(model)), its scale properties and its emulation (what a per-layer check calls)."""
    members = _members(static=static)
    x = torch.randn(7, 32) * 2
    want = [(m.extra_repr(), m.rowwise, m.per_tensor, m.forward_emulated(x),
             m.fake_quantized_input(x), m.weight_scale_rows()) for m in members]
    parent = _Parent(members)
    fuse_projections(parent, {"qkv": ["q", "k", "v"]})
    assert "slice of ['q', 'k', 'v'][1]" in repr(parent)
    for (rep, rowwise, per_tensor, out, xq, ws), s in zip(want, (parent.q, parent.k, parent.v)):
        assert s.extra_repr().startswith(rep)
        assert (s.rowwise, s.per_tensor) == (rowwise, per_tensor)
        assert torch.equal(s.forward_emulated(x), out)
        assert torch.equal(s.fake_quantized_input(x), xq)
        assert torch.equal(s.weight_scale_rows(), ws)


def test_a_member_called_with_another_input_recomputes():
    members = _members()
    parent = _Parent(members)
    fuse_projections(parent, {"qkv": ["q", "k", "v"]})
    x, y = torch.randn(3, 32), torch.randn(3, 32)
    q = parent.q(x)
    k = parent.k(y)  # cross-attention style: another tensor, so not q's pending result
    torch.testing.assert_close(k, members[1](y), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(q, members[0](x), rtol=1e-6, atol=1e-6)
    again = parent.k(y)  # same member, same input twice: still its own output
    torch.testing.assert_close(again, members[1](y), rtol=1e-6, atol=1e-6)


def test_the_hand_off_sets_no_module_attribute(monkeypatch):
    """The pending result lives in a plain object: nn.Module.__setattr__ costs eager host time
    per forward, and torch.compile would replay the store after every call of the graph."""
    parent = _Parent(_members())
    fuse_projections(parent, {"qkv": ["q", "k", "v"]})
    stored = []
    plain = Fp8FusedLinear.__setattr__
    monkeypatch.setattr(Fp8FusedLinear, "__setattr__",
                        lambda self, name, value: (stored.append(name), plain(self, name, value)))
    x = torch.randn(2, 32)
    parent.q(x), parent.k(x), parent.v(x)
    assert stored == [] and parent.fused_qkv._slot.value is None


def test_members_that_do_not_share_scales_stay_separate():
    members = _members()
    other = _members(seed=1)
    other[1].weight_scale.mul_(2.0)  # as written without shared group scales
    mixed = [members[0], other[1], members[2]]
    assert "weight scales" in fusable(mixed)
    parent = _Parent(mixed)
    assert "weight scales" in fuse_projections(parent, {"qkv": ["q", "k", "v"]})["qkv"]
    assert type(parent.k) is Fp8Linear and not hasattr(parent, "fused_qkv")
    dyn = _members(static=False)
    assert "input scales" in fusable([members[0], dyn[1]])


def test_loaded_model_fuses_manifest_groups(llama_fp8):
    manifest = json.loads((llama_fp8 / "fp8export.json").read_text())
    fused, _, _, info = load_fp8_model(llama_fp8, mode="emulate", dtype=torch.float32)
    plain, *_ = load_fp8_model(llama_fp8, mode="emulate", dtype=torch.float32, fuse=False)
    assert info["fused_groups"] == 4 and info["unfused_groups"] == {}
    attn = fused.model.layers[0].self_attn
    assert isinstance(attn.q_proj, Fp8LinearSlice) and attn.fused_qkv.splits == [64, 32, 32]
    assert attn.fused_qkv.member_names == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert isinstance(fused.model.layers[1].mlp.up_proj, Fp8LinearSlice)
    # per-layer tooling sees the manifest's layers, not the groups
    assert set(fp8_modules(fused)) == set(manifest["quantized"]) == set(fp8_modules(plain))
    ids = torch.randint(0, 128, (2, 17))
    with torch.inference_mode():
        a = plain(input_ids=ids, use_cache=False).logits
        b = fused(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert all(m._slot.value is None for m in fused.modules() if isinstance(m, Fp8FusedLinear))


def test_fused_model_traces_as_one_graph(llama_fp8):
    """torch.compile sees through the pending-slice logic: no graph breaks."""
    model, *_ = load_fp8_model(llama_fp8, mode="emulate", dtype=torch.float32)
    ids = torch.randint(0, 128, (1, 9))
    torch._dynamo.reset()
    with torch.inference_mode():
        explained = torch._dynamo.explain(model)(input_ids=ids, use_cache=False)
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_runner_says_which_path_runs(llama_fp8):
    with TorchFp8Runner(llama_fp8, device="cpu") as r:
        d = r.describe()
    assert d["mode"] == "emulate" and d["fused_groups"] == 4 and d["execution"] == "eager"
    assert "4 fused q/k/v and gate/up groups" in d["fp8_path"] and "emulation" in \
        d["execution_reason"]


# --------------------------------------------------------------------------------- GPU
def _integer_members(n_out=(64, 32, 32), in_f=256, bias=(True, False, True), static=True):
    """Members whose products and sums are exact in fp32 in any order: small integer codes,
    power-of-two scales. Any two correct paths then agree bit for bit."""
    g = torch.Generator().manual_seed(7)
    w_scale, s_in = 0.25, 0.5 if static else None
    members = []
    for n, b in zip(n_out, bias):
        w = torch.randint(-4, 5, (n, in_f), generator=g).float() * w_scale
        bias_t = torch.randint(-8, 9, (n,), generator=g).float() if b else None
        members.append(Fp8Linear(quantize_e4m3(w, w_scale), w_scale, s_in, bias_t,
                                 mode="auto", out_dtype=torch.bfloat16))
    return members


def _needs_fp8_gpu():
    from fp8export.runtime.fp8_linear import scaled_mm_available

    if not scaled_mm_available("cuda"):
        pytest.skip("needs compute capability >= 8.9 for FP8 GEMMs")


def _integer_input(rows: int, static: bool) -> torch.Tensor:
    """Static (input scale 0.5): codes -6..6. Dynamic: each row holds ±3.5, so the per-tensor
    scale amax/448 is 2**-7 exactly, and the other elements are codes -4..4 of it."""
    g = torch.Generator().manual_seed(rows)
    if static:
        return (torch.randint(-6, 7, (rows, 256), generator=g).float() * 0.5).to(torch.bfloat16)
    codes = torch.randint(-4, 5, (rows, 256), generator=g).float()
    codes[torch.arange(rows), torch.randint(0, 256, (rows,), generator=g)] = 448.0
    return (codes * 2.0 ** -7).to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 64, 65, 300])  # small-M Triton kernel and _scaled_mm
def test_gpu_paths_are_bit_identical_to_emulation(rows, static, monkeypatch):
    _needs_fp8_gpu()
    from fp8export.runtime import fp8_fused, fp8_gemm

    members = [m.cuda() for m in _integer_members(static=static)]
    x = _integer_input(rows, static).to("cuda")
    want = [m.forward_emulated(x) for m in members]
    for m, w in zip(members, want):
        assert m.uses_scaled_mm(x.device)
        assert torch.equal(m.forward_scaled_mm(x), w)
    parent = _Parent(members).cuda()
    assert fuse_projections(parent, {"qkv": ["q", "k", "v"]}) == {}
    for got, w in zip((parent.q(x), parent.k(x), parent.v(x)), want):
        assert torch.equal(got, w)
    # _scaled_mm at every row count (as in compiled code and CUDA graphs), warmed up eagerly
    monkeypatch.setattr(fp8_gemm, "EAGER_M", 0)
    for got, w in zip((parent.q(x), parent.k(x), parent.v(x)), want):
        assert torch.equal(got, w)
    monkeypatch.undo()
    # from SPLIT_M rows: one shared quantize, one GEMM per member, contiguous outputs
    monkeypatch.setattr(fp8_fused, "SPLIT_M", 1)
    for got, w in zip((parent.q(x), parent.k(x), parent.v(x)), want):
        assert got.is_contiguous() and torch.equal(got, w)
    monkeypatch.undo()
    # inside CUDA graph capture the GEMM is always _scaled_mm: same bits after replay
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = (parent.q(x), parent.k(x), parent.v(x))
    graph.replay()
    for got, w in zip(captured, want):
        assert torch.equal(got, w)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 33, 64])
def test_gpu_small_m_kernel_matches_emulation_on_random_data(rows):
    _needs_fp8_gpu()
    from fp8export.runtime.fp8_gemm import small_m_matmul
    from fp8export.runtime.fp8_quant import quantize_eager

    torch.manual_seed(rows)
    for n, k in ((3072, 2048), (2048, 8192), (96, 64)):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 2
        w = torch.randn(n, k, device="cuda") * 0.02
        sx = torch.tensor(float(amax_to_scale(float(x.float().abs().max()))), device="cuda")
        sw = torch.tensor(float(amax_to_scale(float(w.abs().max()))), device="cuda")
        wq = quantize_e4m3(w, sw)
        ref = (quantize_eager(x, sx).double() * sx.double()) @ (wq.double() * sw.double()).t()
        out = torch.full((rows, n), float("nan"), device="cuda")
        got = small_m_matmul(x, wq, sx, sw, None, torch.float32)
        out.copy_(got)
        assert not out.isnan().any()
        rel = float((out.double() - ref).norm() / ref.norm())
        assert rel < 1e-3, (n, k, rel)  # fp32 accumulation; a layout or scale bug is ~1


@pytest.mark.gpu
def test_gpu_fused_model_matches_emulation_eager_and_compiled(llama_fp8):
    _needs_fp8_gpu()
    emu, *_ = load_fp8_model(llama_fp8, device="cuda", mode="emulate")
    real, _, _, info = load_fp8_model(llama_fp8, device="cuda", mode="scaled_mm")
    assert info["fused_groups"] == 4
    ids = torch.randint(0, 128, (3, 40), device="cuda")
    with torch.inference_mode():
        a = emu(input_ids=ids, use_cache=False).logits.float()
        b = real(input_ids=ids, use_cache=False).logits.float()
        compiled = torch.compile(real)
        c = compiled(input_ids=ids, use_cache=False).logits.float()
    # Values, not cosine (blind to a wrong scale). The paths may round a layer's bf16 output
    # to the neighbouring value, and the next layer's E4M3 quantize can turn that into a code
    # step: on CPU, 1e-6..1e-4 relative noise on every linear's output moved these logits by
    # 4e-5..1.3e-2 rel-L2, and skipping the bf16 roundings of the inputs (as Inductor's fused
    # kernels may) by 2.3e-2. A scale off by 2x in any layer moves them by far more.
    assert rel_l2(a, b) <= 0.02 and rel_l2(a, c) <= 0.06
