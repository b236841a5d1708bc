"""The fast convert path: positional reads, SQNR while quantizing, read-back by content identity.

These pin what the speed-ups must not lose: the one-pass quantizer gives the same bytes and the
same SQNR float as the two-pass reference, the float32 rounding it uses for SQNR equals the real
FP8 cast, sources are read without memory-mapping, and read-back with the write record still
catches a flipped byte, a changed scale, a truncated file and a missing SQNR.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8export.checkpoint.safetensors_reader import SafetensorsFile
from fp8export.errors import Fp8ExportError
from fp8export.fp8dir.readback import verify_output
from fp8export.fp8dir.write import plan_shards, write_shards
from fp8export.scales.select import select_targets
from fp8export.scales.weights import (
    CHUNK,
    _round_to_e4m3_grid_,
    quantize_weight,
    quantize_weight_sqnr,
    roundtrip_sqnr,
    scan_weights,
)


def test_round_to_grid_equals_the_fp8_cast_on_every_bf16_value_and_random_floats():
    every_bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(-2**31, 2**31 - 1, (1 << 20,), dtype=torch.int32, generator=g)
    for values in (every_bf16.float(), rand.view(torch.float32)):
        for s in (1.0, 0.0123, 3.7e-5, 1 / 448, 7.1):
            y = (values / s)
            y = y[y.isfinite()].clamp(-448, 448)
            ref = y.to(torch.float8_e4m3fn).float()
            got = _round_to_e4m3_grid_(y.clone(), torch.empty_like(y))
            assert torch.equal(got, ref)  # -0.0 == 0.0: the sign of a zero never reaches SQNR


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_pass_quantizer_matches_the_two_pass_reference_exactly(dtype):
    torch.manual_seed(1)
    w = (torch.randn(CHUNK + 4099) * 0.05).to(dtype)  # two chunks, a ragged tail
    w[7] = 3.0  # an outlier that saturates with the small scale below
    for scale in (np.float32(float(w.float().abs().max()) / 448), np.float32(1e-4)):
        q, sqnr = quantize_weight_sqnr(w, scale)
        ref = quantize_weight(w, scale)
        assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
        assert sqnr == roundtrip_sqnr(w, ref, float(scale))  # the same float, not just close


def test_safetensors_loads_are_positional_reads_not_mmaps(tmp_path):
    from safetensors.torch import save_file

    t = {"a": torch.randn(300, 7).to(torch.bfloat16), "b": torch.arange(5), "c": torch.zeros(0)}
    path = tmp_path / "m.safetensors"
    save_file(t, str(path))
    f = SafetensorsFile(path)
    try:
        for name, want in t.items():
            got = f.load(name)
            assert got.dtype == want.dtype and torch.equal(got, want)
        maps = Path("/proc/self/maps")
        if maps.exists():
            assert str(path) not in maps.read_text()
    finally:
        f.close()
    # a file that shrinks after its header was validated: an error naming the tensor
    f = SafetensorsFile(path)
    first, *_, last = sorted(("a", "b"), key=lambda n: f.spans[n])
    f.load(first)  # opened (and checked by safe_open) before the file changes
    data = path.read_bytes()
    with open(path, "r+b") as fh:  # same inode, as a concurrent writer would leave it
        fh.truncate(len(data) - 20)
    with pytest.raises(Fp8ExportError, match=f"'{last}'.*cut short"):
        f.load(last)
    f.close()


def _written(tmp_path, dict_ckpt):
    torch.manual_seed(0)
    t = {"x.q_proj.weight": torch.randn(16, 8).to(torch.bfloat16),
         "x.k_proj.weight": torch.randn(8, 8).to(torch.bfloat16),
         "x.norm.weight": torch.ones(8, dtype=torch.bfloat16)}
    ckpt = dict_ckpt(t, config={"model_type": "llama"})
    sel = select_targets(ckpt.tensors(), ckpt.config)
    scan = scan_weights(sel.targets, ckpt.load, sel.groups)
    ws = {m: scan.scale[m] for m in sel.modules}
    ins = {"x.q_proj": np.float32(0.01)}
    plans = plan_shards(ckpt, {x.weight: x for x in sel.targets}, ws, ins, (1,))
    record = write_shards(tmp_path, plans, ckpt, ws, ins)
    return ckpt, plans, ws, ins, record


def _patch(path: Path, name: str, fn):
    data = bytearray(path.read_bytes())
    (hlen,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8:8 + hlen])[name]["data_offsets"]
    data[8 + hlen + begin: 8 + hlen + end] = fn(bytes(data[8 + hlen + begin: 8 + hlen + end]))
    path.write_bytes(bytes(data))


def test_record_holds_digests_of_every_tensor_and_the_sqnr_readback_returns(tmp_path, dict_ckpt):
    ckpt, plans, ws, ins, record = _written(tmp_path, dict_ckpt)
    names = {e.tensor.name for p in plans for e in p.entries}
    assert set(record.digests["model.safetensors"]) == names
    sqnr = verify_output(tmp_path, plans, ckpt, ws, ins, record=record)
    assert sqnr == record.sqnr and set(sqnr) == {"x.q_proj", "x.k_proj"}
    # the recorded SQNR is that of the bytes on disk, recomputed from the source
    assert sqnr == verify_output(tmp_path, plans, ckpt, ws, ins)


def test_readback_catches_one_flipped_weight_byte(tmp_path, dict_ckpt):
    ckpt, plans, ws, ins, record = _written(tmp_path, dict_ckpt)
    _patch(tmp_path / "model.safetensors", "x.k_proj.weight",
           lambda b: bytes([b[0] ^ 0x01]) + b[1:])
    with pytest.raises(Fp8ExportError, match=r"x\.k_proj\.weight on disk differ.*digest"):
        verify_output(tmp_path, plans, ckpt, ws, ins, record=record)


def test_readback_catches_a_flipped_copied_tensor_byte(tmp_path, dict_ckpt):
    ckpt, plans, ws, ins, record = _written(tmp_path, dict_ckpt)
    _patch(tmp_path / "model.safetensors", "x.norm.weight",
           lambda b: b[:-1] + bytes([b[-1] ^ 0x80]))
    with pytest.raises(Fp8ExportError, match=r"x\.norm\.weight on disk differ"):
        verify_output(tmp_path, plans, ckpt, ws, ins, record=record)


def test_readback_catches_a_changed_scale(tmp_path, dict_ckpt):
    ckpt, plans, ws, ins, record = _written(tmp_path, dict_ckpt)
    _patch(tmp_path / "model.safetensors", "x.q_proj.weight_scale",
           lambda b: np.float32(float(ws["x.q_proj"]) * 2).tobytes())
    _patch(tmp_path / "model.safetensors", "x.q_proj.input_scale",
           lambda b: np.float32(-1.0).tobytes())
    with pytest.raises(Fp8ExportError) as err:
        verify_output(tmp_path, plans, ckpt, ws, ins, record=record)
    msg = str(err.value)
    assert "x.q_proj.weight_scale" in msg and "was computed" in msg
    assert "x.q_proj.input_scale = -1.0 is not a finite positive scale" in msg


def test_readback_catches_a_truncated_file(tmp_path, dict_ckpt):
    ckpt, plans, ws, ins, record = _written(tmp_path, dict_ckpt)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(Fp8ExportError, match="model.safetensors: cannot be reopened"):
        verify_output(tmp_path, plans, ckpt, ws, ins, record=record)


def test_readback_refuses_a_weight_without_recorded_sqnr(tmp_path, dict_ckpt):
    ckpt, plans, ws, ins, record = _written(tmp_path, dict_ckpt)
    del record.sqnr["x.k_proj"]
    with pytest.raises(Fp8ExportError, match="x.k_proj.weight: no SQNR was recorded"):
        verify_output(tmp_path, plans, ckpt, ws, ins, record=record)


def test_readback_with_record_fails_a_low_sqnr(tmp_path, dict_ckpt):
    ckpt, plans, ws, ins, record = _written(tmp_path, dict_ckpt)
    with pytest.raises(Fp8ExportError, match="x.q_proj.weight: the FP8 weight read back.*SQNR"):
        verify_output(tmp_path, plans, ckpt, ws, ins, record=record, min_sqnr_db=60.0)


def _roundtrip_file(path: Path, tensors: dict) -> None:
    from safetensors import safe_open

    from fp8export.fp8dir.safetensors_writer import PlannedTensor, write_safetensors
    from fp8export.io.safetensors_dtypes import TORCH_TO_ST

    plan = [PlannedTensor(n, TORCH_TO_ST[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    size = write_safetensors(path, plan, lambda p: tensors[p.name])
    assert size == path.stat().st_size  # cut to its exact size after the last aligned block
    with safe_open(str(path), framework="pt") as f:
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name).view(torch.uint8), t.view(torch.uint8))


def test_block_writer_spans_stage_boundaries_and_odd_sizes(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {"a": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
               "big": torch.randint(0, 255, ((9 << 20) + 5,), dtype=torch.uint8, generator=g),
               "c": torch.randn(7, generator=g).to(torch.bfloat16)}
    _roundtrip_file(tmp_path / "x.safetensors", tensors)


def test_block_writer_falls_back_when_direct_writes_are_refused(tmp_path, monkeypatch):
    import errno
    import fcntl
    import os

    real = os.pwrite
    refused = []

    def pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    tensors = {"w": torch.arange(5000, dtype=torch.float32), "s": torch.tensor([0.5])}
    _roundtrip_file(tmp_path / "y.safetensors", tensors)
    assert len(refused) <= 1  # refused once at most (where O_DIRECT opened), then buffered


def test_disk_reader_reads_unaligned_ranges_and_reports_a_short_file(tmp_path):
    from fp8export.fp8dir.readback import _DiskReader

    data = bytes(range(256)) * 40 + np.float32(0.125).tobytes() + b"xyz"
    path = tmp_path / "d.bin"
    path.write_bytes(data)
    reader = _DiskReader(path)
    try:
        assert float(reader.read(10240, 10244).view(torch.float32)[0]) == 0.125
        assert bytes(reader.read(4095, 4099).numpy()) == data[4095:4099]
        assert reader.read(10241, 10249) is None  # past the end of the file
    finally:
        reader.close()
