"""Tensors from torch files: views whose storage is smaller than their shape, odd layouts."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from fp8export.checkpoint.source import open_checkpoint
from fp8export.errors import Fp8ExportError


def _open(tmp_path, state):
    p = tmp_path / "w.pt"
    torch.save(state, p)
    with open_checkpoint(p) as ckpt:
        return {i.name: ckpt.load(i.name) for i in ckpt.tensors()}


@pytest.mark.parametrize("view", [
    lambda: torch.ones(1).expand(10**6, 10**6),  # 4 bytes standing for 4 TB
    lambda: torch.ones(64).as_strided((16, 16), (1, 1)),  # 256 elements over 64
    lambda: torch.ones(4, 1).expand(4, 8),
])
def test_views_that_repeat_their_storage_are_refused(tmp_path, view):
    with pytest.raises(Fp8ExportError, match="fc.weight.*overlap"):
        _open(tmp_path, {"fc.weight": view()})


def test_non_overlapping_views_are_fine(tmp_path):
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    got = _open(tmp_path, {"t.weight": base.t(), "s.weight": base[::2], "e.weight": base[:0]})
    assert torch.equal(got["t.weight"], base.t())
    assert torch.equal(got["s.weight"], base[::2])


def test_meta_and_nested_tensors_are_refused(tmp_path):
    with pytest.raises(Fp8ExportError, match="meta tensor"):
        _open(tmp_path, {"fc.weight": torch.empty(4, 4, device="meta")})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)])
    with pytest.raises(Fp8ExportError, match="nested tensor"):
        _open(tmp_path, {"fc.weight": nested})


def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path):
    state: dict = {"w": torch.ones(2)}
    for _ in range(2000):
        state = {"a": state}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        with pytest.raises(Fp8ExportError, match="nested more than"):
            _open(tmp_path, state)
    finally:
        sys.setrecursionlimit(limit)
