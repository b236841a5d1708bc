"""The trained tiny Llama and its FP8 folders (session fixtures of tests/conftest.py) under the
names the verify, analysis and report tests use, on one torch thread. Those folders' conftests
import these fixtures, so the names mean the same model in all three."""

from __future__ import annotations

import pytest
from fp8_folders import one_torch_thread


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="session")
def tiny_llama(markov_llama):
    return markov_llama


@pytest.fixture(scope="session")
def tiny_fp8(markov_fp8):
    return markov_fp8


@pytest.fixture(scope="session")
def damaged_fp8(markov_damaged_fp8):
    return markov_damaged_fp8


@pytest.fixture(scope="session")
def eval_npz(markov_eval_npz):
    return markov_eval_npz
