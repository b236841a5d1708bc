"""The Transformer Engine reader is linear in the number of tensors (60k took a minute)."""

from __future__ import annotations

import time

import torch
from safetensors.torch import save_file
from te_helpers import fixtures_module, open_ckpt

from fp8export.checkpoint.training.te import plan_modules

# Generous: linear code does these in well under a second; the quadratic code took minutes.
LIMIT_S = 20


def test_planning_60k_names_is_linear():
    names = []
    for i in range(20_000):
        p = f"layers.{i}.proj"
        names += [f"{p}.weight", f"{p}.bias", f"{p}._extra_state"]
    start = time.monotonic()
    plans = plan_modules(names)
    assert time.monotonic() - start < LIMIT_S
    assert len(plans) == 20_000 and plans["layers.7.proj"].kind == "Linear"


def test_safetensors_te_file_with_30k_tensors_opens_in_linear_time(tmp_path):
    import numpy as np

    mf = fixtures_module()
    state, _ = mf._fwd_bwd(1, 4, 6, np.random.default_rng(0))
    tensors = {"fc.weight": torch.ones(4, 4),
               "fc._extra_state": mf.serialize_2x(state, 1, mf.DelayedScaling(amax_history_len=4))}
    for i in range(30_000):
        tensors[f"buffers.b{i}"] = torch.zeros(1)
    p = tmp_path / "te.safetensors"
    save_file(tensors, str(p))
    start = time.monotonic()
    with open_ckpt(p) as ckpt:
        assert len(ckpt.tensors()) == 30_001
        assert ckpt.training_state() is not None
    assert time.monotonic() - start < LIMIT_S
