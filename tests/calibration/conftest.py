"""Fixtures: a tiny Llama folder (random weights, a word-level tokenizer) built in a tmp dir."""

from __future__ import annotations

from pathlib import Path

import pytest
from calib_fixtures import WORDS, build_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture()
def calib_txt(tmp_path) -> Path:
    import random

    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20))) for _ in range(24)]
    p = tmp_path / "calib.txt"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads; on a loaded CI box they cost a lot."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
