"""Where the hidden states of every sample wait between layers: on the device, in host memory,
or in a spill file.

One :class:`HiddenStore` per streamed model holds one tensor per batch (``[B, T, H]``, the
model's dtype). A layer reads batch ``b``'s tensor, and its output replaces it in the same place,
so a stream needs the hidden states of the samples once, whatever the number of layers.

* ``device``: the tensors stay where the layers run (nothing moves).
* ``host``: one host buffer per batch (page-locked for the GPU), copied in and out per layer.
* ``spill``: one file of exactly the bytes the batches need, in a hidden folder under the
  output's parent, memory-mapped. The folder is removed when the store closes (on success,
  error and Ctrl-C alike), and the file is unlinked as soon as it is mapped, so even a killed
  process leaves nothing behind. Its size is checked against the free space before it is made.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from fp8export.errors import Fp8ExportError

TIERS = ("device", "host", "spill")
_ALIGN = 64


def tier_bytes(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> int:
    """Bytes of one stream's hidden states: every batch's tensor, aligned."""
    return sum(_aligned(_numel(s) * dtype.itemsize) for s in shapes)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class HiddenStore:
    """One tensor per batch in one tier (see the module docstring)."""

    def __init__(self, tier: str, device: torch.device, spill_dir: Path | None = None,
                 name: str = "hidden"):
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        self.tier, self.device, self.name = tier, torch.device(device), name
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        self.items: list[torch.Tensor | None] = []
        self._file: torch.Tensor | None = None
        self._folder: str | None = None
        self.nbytes = 0

    def reserve(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> None:
        """Make room for batches of ``shapes`` (the spill file is made here)."""
        self.shapes, self.dtype = [tuple(s) for s in shapes], dtype
        self.items = [None] * len(shapes)
        self.nbytes = tier_bytes(self.shapes, dtype)
        if self.tier == "spill":
            with torch.inference_mode(False):  # buffers that outlive any inference block
                self._open_spill()

    def _open_spill(self) -> None:
        parent = self.spill_dir or Path(tempfile.gettempdir())
        try:
            free = shutil.disk_usage(parent).free
        except OSError as exc:
            raise Fp8ExportError(f"{parent}: cannot put the hidden-state spill file there "
                                 f"({exc.strerror or exc}).") from exc
        if self.nbytes > free:
            raise Fp8ExportError(
                f"{parent}: the hidden states need {self.nbytes / 2**30:.1f} GiB of spill file "
                f"but {free / 2**30:.1f} GiB are free there. Free disk space, use fewer "
                "samples or a shorter --seq-len, or give more host memory (--max-memory "
                "cpu=SIZE).")
        self._folder = tempfile.mkdtemp(prefix=".fp8export-spill-", dir=parent)
        path = os.path.join(self._folder, f"{self.name}.bin")
        try:
            with open(path, "wb") as f:
                f.truncate(max(self.nbytes, 1))
            self._file = torch.from_file(path, shared=True, size=max(self.nbytes, 1),
                                         dtype=torch.uint8)
        finally:
            # mapped: the name is no longer needed, and a killed process leaves nothing behind
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
        offset = 0
        for b, shape in enumerate(self.shapes):
            n = _numel(shape) * self.dtype.itemsize
            self.items[b] = self._file[offset:offset + n].view(self.dtype).view(shape)
            offset += _aligned(n)

    def put(self, b: int, t: torch.Tensor) -> None:
        """Batch ``b``'s tensor is now ``t`` (a layer's output; the input it replaces is done)."""
        if tuple(t.shape) != self.shapes[b] or t.dtype != self.dtype:
            raise Fp8ExportError(f"internal: batch {b} is {tuple(t.shape)} {t.dtype}, the store "
                                 f"holds {self.shapes[b]} {self.dtype}.")
        if self.tier == "device":
            self.items[b] = t
            return
        with torch.inference_mode(False):  # buffers that outlive any inference block
            slot = self.items[b]
            if slot is None:  # host: one buffer per batch, made on first use
                slot = torch.empty(t.shape, dtype=t.dtype,
                                   pin_memory=self.device.type == "cuda")
                self.items[b] = slot
            slot.copy_(t, non_blocking=False)

    def get(self, b: int) -> torch.Tensor:
        """Batch ``b``'s tensor on the device (a copy unless it lives there)."""
        t = self.items[b]
        if t is None:
            raise Fp8ExportError(f"internal: batch {b} has no hidden state yet.")
        if self.tier == "device":
            return t
        return t.to(self.device, non_blocking=self.device.type == "cuda")

    def close(self) -> None:
        self.items = []
        self._file = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def __enter__(self) -> HiddenStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
