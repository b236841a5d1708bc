"""CUDA path (skips without a GPU): device-side statistics match the CPU run."""

from __future__ import annotations

import pytest
import torch

from fp8export.calibration.observe import observe
from fp8export.inputs.samples import as_samples


@pytest.mark.gpu
def test_cuda_statistics_match_cpu(tiny_llama):
    from fp8export.models import load_model

    mods = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
            "model.layers.1.mlp.down_proj"]
    data = as_samples([[2, 5, 6, 7], [2, 8, 9], [2, 10, 11, 12, 13, 14]])
    groups = {"qk": mods[:2]}
    out = {}
    for dev in ("cpu", "cuda"):
        model, _ = load_model(tiny_llama, dtype=torch.float32, device=dev)
        out[dev] = observe(model, data, mods, method="percentile", groups=groups, batch_size=2,
                           show_progress=False).stats
    for m in mods:
        c, g = out["cpu"][m], out["cuda"][m]
        assert g.amax == pytest.approx(c.amax, rel=1e-2)
        assert int(g.counts.sum()) == int(c.counts.sum())  # padding excluded on the device too
