"""export-onnx refuses a trace whose dynamic axes the exporter fixed (a Python loop over the
tokens, as Jamba's Mamba scan runs without its kernels): such a graph takes one sequence length
only, which verify would meet as an onnxruntime shape error."""

from __future__ import annotations

import pytest
import torch

from fp8export.onnx.export import fixed_dims


class _Loop(torch.nn.Module):
    def forward(self, x):
        return torch.stack([x[:, i] * 2 for i in range(x.shape[1])], 1)


class _Plain(torch.nn.Module):
    def forward(self, x):
        return x * 2


@pytest.mark.parametrize("module,fixed", [(_Loop(), "x sequence = 8"), (_Plain(), "")])
def test_fixed_dims(module, fixed):
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}
    program = torch.onnx.export(module, (torch.ones(2, 8),), dynamo=True, input_names=["x"],
                                dynamic_shapes=(dims,), verbose=False)
    assert fixed_dims(program.model, {"x": dims}) == fixed
