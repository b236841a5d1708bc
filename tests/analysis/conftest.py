"""Fixtures for the analysis tests: the trained tiny Llama and its FP8 folders
(tests/markov_fixtures.py)."""

from markov_fixtures import (  # noqa: F401  (fixtures, registered by import)
    _one_torch_thread,
    damaged_fp8,
    eval_npz,
    tiny_fp8,
    tiny_llama,
)
