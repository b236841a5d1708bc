"""Read-back policies of the parallel writer, on real files: ``sampled`` finds a flipped byte
inside a sample, ``full`` finds one anywhere (and ``sampled`` does miss one between samples:
the policies really differ)."""

from __future__ import annotations

from pathlib import Path

import pytest

import fp8export.fp8dir.parallel_write as pw
from fp8export.api import convert
from fp8export.config import ReadBack
from fp8export.convert.config import ConvertConfig
from fp8export.errors import Fp8ExportError
from fp8export.fp8dir.readback import SAMPLE

MODEL = Path(__file__).resolve().parents[2] / "samples" / "tiny-llama" / "model"
TARGET = "model.layers.0.mlp.gate_proj.weight"  # 176 KiB of FP8: bytes between the samples


def _flip_at(monkeypatch, where) -> list[int]:
    """Flip one bit of TARGET's bytes as they go to the file (its sha256 is taken from the
    intact buffer, as a bad write would leave it)."""
    real = pw._Writer._write_out
    sizes: list[int] = []

    def corrupt(self, job, fd, data):
        if job.entry.tensor.name == TARGET:
            sizes.append(len(data))
            data = data.copy()
            data[where(len(data))] ^= 0x01
        return real(self, job, fd, data)

    monkeypatch.setattr(pw._Writer, "_write_out", corrupt)
    return sizes


def _between_samples(n: int) -> int:
    assert n > 3 * SAMPLE + 16, "the test needs a tensor with bytes outside the samples"
    return SAMPLE + 8  # after the first sample, before the middle one


@pytest.mark.parametrize("policy", [ReadBack.SAMPLED, ReadBack.FULL])
def test_a_flipped_byte_in_a_sample_fails_either_policy(tmp_path, monkeypatch, policy):
    _flip_at(monkeypatch, lambda n: n // 2 + 7)
    with pytest.raises(Fp8ExportError, match="read-back verification") as err:
        convert(ConvertConfig(checkpoint=MODEL, output=tmp_path / "out", workers=2,
                              read_back=policy))
    assert TARGET in str(err.value)
    assert not (tmp_path / "out").exists()


def test_full_read_back_finds_a_flipped_byte_between_the_samples(tmp_path, monkeypatch):
    sizes = _flip_at(monkeypatch, _between_samples)
    with pytest.raises(Fp8ExportError, match="sha256 differs") as err:
        convert(ConvertConfig(checkpoint=MODEL, output=tmp_path / "out", workers=2,
                              read_back="full"))
    assert sizes and "model.safetensors" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_sampled_read_back_misses_a_flip_between_the_samples(tmp_path, monkeypatch):
    # The documented limit of the default policy, kept honest: the convert succeeds.
    sizes = _flip_at(monkeypatch, _between_samples)
    convert(ConvertConfig(checkpoint=MODEL, output=tmp_path / "out", workers=2))
    assert sizes and (tmp_path / "out" / "model.safetensors").is_file()


def test_read_back_policy_does_not_change_the_output(tmp_path):
    a = tmp_path / "a"
    b = tmp_path / "b"
    convert(ConvertConfig(checkpoint=MODEL, output=a))
    convert(ConvertConfig(checkpoint=MODEL, output=b, read_back="full"))
    for p in sorted(a.iterdir()):
        assert p.read_bytes() == (b / p.name).read_bytes(), p.name
