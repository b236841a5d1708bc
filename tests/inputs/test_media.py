"""Media files named by a data file are bounded before they are decoded."""

from __future__ import annotations

import struct
import zlib

import pytest

from fp8export.errors import Fp8ExportError
from fp8export.inputs import media


def _png(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` over a few bytes of data: what a
    decompression bomb looks like before decoding."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + \
        chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def test_decompression_bomb_is_refused_before_decoding(tmp_path):
    # 7000 x 7000 = 49 M pixels: under Pillow's own bomb limit (89 M: only a warning there),
    # over ours, so only our header check stands between it and a 147 MB decode
    (tmp_path / "bomb.png").write_bytes(_png(7000, 7000))
    with pytest.raises(Fp8ExportError, match=r"refused before decoding \(7000 x 7000 pixels"):
        media.load_image(tmp_path / "bomb.png", tmp_path, "data.jsonl:1")


def test_a_real_small_image_decodes(tmp_path):
    from PIL import Image

    Image.new("RGB", (20, 10), (1, 2, 3)).save(tmp_path / "ok.png")
    img = media.load_image(tmp_path / "ok.png", tmp_path, "data.jsonl:1")
    assert img.size == (20, 10) and img.mode == "RGB"


def test_not_an_image(tmp_path):
    (tmp_path / "x.png").write_bytes(b"GIF89a" + b"\x00" * 10)
    with pytest.raises(Fp8ExportError, match="not a readable image"):
        media.load_image(tmp_path / "x.png", tmp_path, "data.jsonl:1")


@pytest.mark.parametrize("path", ["../outside.png", "/etc/passwd", ""])
def test_media_path_stays_in_the_data_folder(tmp_path, path):
    with pytest.raises(Fp8ExportError, match="media path|leaves the data file's folder"):
        media._media_path(tmp_path / "data.jsonl", path, "data.jsonl:1")


def test_symlink_out_of_the_folder_is_refused(tmp_path):
    from PIL import Image

    outside = tmp_path / "outside"
    outside.mkdir()
    Image.new("RGB", (4, 4)).save(outside / "secret.png")
    data = tmp_path / "data"
    data.mkdir()
    (data / "link.png").symlink_to(outside / "secret.png")
    with pytest.raises(Fp8ExportError):
        media.load_image(data / "link.png", data, "data.jsonl:1")


def test_audio_longer_than_the_bound_is_refused(tmp_path, monkeypatch):
    import numpy as np
    import soundfile as sf

    sf.write(tmp_path / "a.wav", np.zeros(16000 * 3, dtype="float32"), 16000)
    monkeypatch.setattr(media, "MAX_AUDIO_SECONDS", 2.0)
    with pytest.raises(Fp8ExportError, match="3 s long; at most 2 s"):
        media.load_audio(tmp_path / "a.wav", tmp_path, "data.jsonl:1")
    monkeypatch.setattr(media, "MAX_AUDIO_SECONDS", 4.0)
    samples, rate = media.load_audio(tmp_path / "a.wav", tmp_path, "data.jsonl:1")
    assert rate == 16000 and len(samples) == 48000


def test_audio_without_soundfile_names_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "soundfile", None)
    with pytest.raises(Fp8ExportError, match=r"fp8export\[audio\]"):
        media.load_audio(tmp_path / "a.wav", tmp_path, "data.jsonl:1")


def test_media_jsonl_without_a_processor(tmp_path):
    """A model folder without processor files: one line naming what is missing."""
    from PIL import Image

    from fp8export.inputs.samples import load_samples
    from tests.conftest import SAMPLES

    Image.new("RGB", (8, 8)).save(tmp_path / "i.png")
    (tmp_path / "d.jsonl").write_text('{"text": "a cat", "image": "i.png"}\n')
    with pytest.raises(Fp8ExportError, match="need the model's processor"):
        load_samples(tmp_path / "d.jsonl", SAMPLES / "tiny-llama" / "model")
