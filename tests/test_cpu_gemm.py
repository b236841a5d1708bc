"""16-bit linears on CPUs without 16-bit matrix units run in fp32 (fp8export/cpu_gemm.py)."""

from __future__ import annotations

import pytest
import torch

from fp8export import cpu_gemm


@pytest.fixture
def gemm(monkeypatch):
    def choose(value: str):
        monkeypatch.setenv("FP8EXPORT_CPU_GEMM", value)
        cpu_gemm._slow.cache_clear()

    yield choose
    cpu_gemm._slow.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_converted_linear_is_the_fp32_product_rounded_once(gemm, dtype):
    gemm("fp32")
    torch.manual_seed(0)
    lin = torch.nn.Linear(384, 96).to(dtype)
    x = torch.randn(4, 7, 384).to(dtype)
    want = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float()).to(dtype)
    cpu_gemm.fp32_linears(lin)
    with torch.no_grad():
        got = lin(x)
    assert got.dtype == dtype and torch.equal(got, want)
    # what a 16-bit GEMM means (fp32 accumulation, one rounding): the exact result, rounded,
    # almost everywhere
    exact = (x.double() @ lin.weight.double().t() + lin.bias.double()).to(dtype)
    assert (got == exact).float().mean() > 0.995


def test_native_keeps_torchs_kernel_and_fp32_models_are_untouched(gemm):
    gemm("native")
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        native = torch.nn.functional.linear(x, lin.weight, lin.bias)
        cpu_gemm.fp32_linears(lin)
        assert torch.equal(lin(x), native)
    gemm("fp32")
    assert not cpu_gemm.converts(torch.float32)
    on_gpu = torch.nn.Linear(4, 4)
    cpu_gemm.fp32_linears(on_gpu, "cuda")
    assert "forward" not in vars(on_gpu)  # a model placed on a GPU keeps torch's forward


def test_models_fp8export_runs_get_it_and_subclasses_keep_their_forward(gemm, tmp_path):
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig
    from fp8export.models import load_model
    from fp8export.runtime.fp8_linear import Fp8Linear
    from fp8export.runtime.fp8_model import load_fp8_model

    gemm("fp32")
    model, _ = load_model("samples/tiny-llama/model")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all("forward" in vars(m) for m in linears)

    class Own(torch.nn.Linear):
        def forward(self, x):
            return x

    own = Own(4, 4)
    cpu_gemm.fp32_linears(own)
    assert "forward" not in vars(own)
    # the FP8 runtime: its 16-bit layers (lm_head) get it, its FP8 layers keep their own
    convert(ConvertConfig(checkpoint="samples/tiny-llama/model", output=tmp_path / "fp8",
                          scales="weights"))
    fp8_model = load_fp8_model(tmp_path / "fp8", mode="emulate")[0]
    plain = [m for m in fp8_model.modules() if type(m) is torch.nn.Linear]
    fp8 = [m for m in fp8_model.modules() if isinstance(m, Fp8Linear)]
    assert plain and fp8
    assert all("forward" in vars(m) for m in plain)
    assert not any("forward" in vars(m) for m in fp8)
