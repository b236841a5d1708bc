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


@pytest.fixture(scope="session")
def next_fp8(next_dir, media_data, tmp_path_factory):
    """``next_fp8(name)``: the tiny model of a newer family converted with calibrated static
    scales (16 lines of text at 64 tokens; Whisper: 8 clips of audio with their transcripts),
    built once and shared by the pipeline, transformers and peer tests."""
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig
    from tests.conftest import SAMPLES

    root = tmp_path_factory.mktemp("next-fp8")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            data = media_data / "audio.jsonl" if name == "whisper" else \
                SAMPLES / "tiny-llama" / "data" / "calib.txt"
            convert(ConvertConfig(checkpoint=next_dir(name), output=root / name,
                                  scales="calibrate", calib_data=data,
                                  calib_samples=8 if name == "whisper" else 16, seq_len=64))
            built[name] = root / name
        return built[name]

    return get
