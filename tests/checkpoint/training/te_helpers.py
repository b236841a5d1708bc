"""Shared helpers for the Transformer Engine / torchao training-state tests.

Loads ``samples/te-fixtures/make_fixtures.py`` (the reproduced TE serialisation) as module
``te_make_fixtures`` so that objects it pickles by reference resolve, and opens checkpoints
through the real reader registry.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
FIXTURE_SCRIPT = REPO / "samples" / "te-fixtures" / "make_fixtures.py"


def fixtures_module():
    name = "te_make_fixtures"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, FIXTURE_SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def open_ckpt(path: Path):
    """``open_checkpoint`` with the built-in readers and the TE reader registered."""
    from fp8export.checkpoint import source

    source._load_builtin_readers()
    import fp8export.checkpoint.training.te_reader  # noqa: F401  (registers on import)

    return source.open_checkpoint(path)
