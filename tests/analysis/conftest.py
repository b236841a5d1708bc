"""Fixtures for the analysis tests: the trained tiny Llama and its FP8 folders
(tests/markov_fixtures.py), and data long enough for a budget's splits."""

import numpy as np
import pytest
from markov_fixtures import (  # noqa: F401  (fixtures, registered by import)
    _one_torch_thread,
    damaged_fp8,
    eval_npz,
    tiny_fp8,
    tiny_llama,
)


@pytest.fixture(scope="session")
def budget_npz(tmp_path_factory):
    """40 sequences of 48 tokens of the tiny Llama's Markov chain: 8 to calibrate, 8 to
    search, 4 to check and some to spare."""
    from fp8_folders import markov_tokens

    path = tmp_path_factory.mktemp("data") / "budget.npz"
    np.savez(path, input_ids=markov_tokens(256, 40, 48, seed=77).numpy())
    return path
