"""Fixtures for verify tests: a tiny Llama and FP8 folders built from it (session-scoped)."""

from __future__ import annotations

import shutil

import pytest
from fp8_folders import DAMAGED, damage_scale, make_fp8_folder, make_tiny_llama


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """These models are tiny: one thread is faster, and far faster on a busy 2-core machine
    (two spinning intra-op threads under load made training ~30x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("ref") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_fp8(tiny_llama, tmp_path_factory):
    return make_fp8_folder(tiny_llama, tmp_path_factory.mktemp("fp8") / "tiny-llama-fp8")


@pytest.fixture(scope="session")
def damaged_fp8(tiny_fp8, tmp_path_factory):
    out = tmp_path_factory.mktemp("damaged") / "tiny-llama-fp8-damaged"
    shutil.copytree(tiny_fp8, out)
    damage_scale(out, DAMAGED, 8.0)
    return out


@pytest.fixture(scope="session")
def eval_npz(tmp_path_factory):
    """16 held-out sequences of 48 tokens from the tiny Llama's own Markov chain."""
    import numpy as np
    from fp8_folders import markov_tokens

    path = tmp_path_factory.mktemp("data") / "eval.npz"
    np.savez(path, input_ids=markov_tokens(256, 16, 48, seed=99).numpy())
    return path
