"""Session-scoped tiny models of every family (built once, shared by the family tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_families import FAMILIES, save_family  # noqa: E402


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """``family_dir(name)``: the saved tiny model of family ``name`` (built on first use)."""
    root = tmp_path_factory.mktemp("families")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = save_family(name, root / name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def family_names():
    return list(FAMILIES)


@pytest.fixture(scope="session")
def next_dir(tmp_path_factory):
    """``next_dir(name)``: the saved tiny model of a newer family (``next_families.py``)."""
    from next_families import save_next

    root = tmp_path_factory.mktemp("next-families")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = save_next(name, root / name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def media_data(tmp_path_factory):
    """A folder with ``images.jsonl`` (12 PNGs of 24..68 x 40 px with calibration text, one
    text-only line) and ``audio.jsonl`` (12 WAVs of 0.8 s at 16 kHz with a transcript)."""
    from next_families import write_media

    return write_media(tmp_path_factory.mktemp("media"))
