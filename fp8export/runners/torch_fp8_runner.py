"""The torch FP8 runtime as a runner: weights in E4M3, ``torch._scaled_mm`` where possible."""

from __future__ import annotations

from typing import Any

from fp8export.runners.torch_runner import TorchModelRunner


class TorchFp8Runner(TorchModelRunner):
    """Runs an FP8 folder. ``mode``: "auto" | "emulate" | "scaled_mm" (see fp8_linear.py).

    ``compile``: False, True (``torch.compile`` default mode) or a ``torch.compile`` mode name;
    ``"reduce-overhead"`` captures CUDA graphs (fixed shapes pay off; each new shape recompiles).
    Numerics match up to float rounding (fusion reorders bf16 operations).
    """

    backend = "torch-fp8"

    def __init__(self, path, *, dtype: str = "bf16", device: str = "auto", mode: str = "auto",
                 compile: bool | str = False, name: str | None = None):
        super().__init__(path, dtype=dtype, device=device, name=name)
        self.mode = mode
        self.compile = compile
        self.info: dict[str, Any] = {}
        self.manifest: dict[str, Any] = {}

    def _build(self):
        import torch

        from fp8export.runners.fp8_model import load_fp8_model

        model, config, self.manifest, self.info = load_fp8_model(
            self.path, device=self.device, dtype=self.dtype, mode=self.mode)
        if self.compile:
            mode = self.compile if isinstance(self.compile, str) else None
            model = torch.compile(model, mode=mode)
        return model, config

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(mode=self.info.get("mode", self.mode), fallbacks=self.info.get("fallbacks", {}))
        return d
