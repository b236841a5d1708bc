"""Torch runners whose model is streamed one decoder layer at a time (``fp8export.streaming``):
the reference (and its fp32 floor) and an FP8 folder candidate, as verify runs them when the
models do not fit the device.

Activating one opens its parts (the architecture on the meta device, no weights); verify's
streamed comparison (``verify/streamed.py``) then drives every stream layer by layer and takes
each batch's logits at the end, so :meth:`infer` is not used. What the runner says of itself
(backend, dtype, FP8 path, fallbacks, fused groups, KV cache) is what the whole-model runner
says, plus how it was streamed.
"""

from __future__ import annotations

from typing import Any

from fp8export.errors import Fp8ExportError
from fp8export.runners.torch_fp8_runner import TorchFp8Runner
from fp8export.runners.torch_runner import TorchModelRunner


class _Streamed:
    parts: Any = None
    streaming: dict[str, Any] | None = None

    def _infer(self, feed):
        raise Fp8ExportError("internal: a streamed model runs through verify's streamed "
                             "comparison, not batch by batch.")

    def _deactivate(self) -> None:
        if self.parts is not None:
            self.parts.close()
            self.parts = None
        self.model = None

    def data_config(self) -> dict[str, Any]:
        return self.config


class StreamedTorchRunner(_Streamed, TorchModelRunner):
    """The bf16 / fp32 reference (or an unquantized candidate), streamed."""

    backend = "torch"

    def _build(self):
        from fp8export.streaming.parts import CheckpointParts

        self.parts = CheckpointParts(self.path, self.dtype, experts="routed")
        return None, self.parts.config

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["streaming"] = self.streaming or {"mode": "layers"}
        return d


class StreamedFp8Runner(_Streamed, TorchFp8Runner):
    """An FP8 folder through the FP8 runtime, streamed; its layers run as
    :func:`~fp8export.runtime.fp8_model.load_fp8_model` builds them."""

    def _build(self):
        import torch

        from fp8export.runtime.fp8_model import resolve_mode
        from fp8export.streaming.parts import Fp8FolderParts

        mode = resolve_mode(self.mode, torch.device(self.device))
        self.parts = parts = Fp8FolderParts(self.path, self.dtype, mode)
        fmt = parts.format
        self.manifest = parts.manifest
        self.info = {"mode": mode, "quantized_layers": len(parts.quantized), "fallbacks": {},
                     "activation_scheme": parts.manifest.get("activation_scheme"),
                     "weight_granularity": fmt.granularity,
                     "block_size": fmt.to_dict()["block_size"],
                     "dynamic_activations": fmt.dynamic or parts.dynamic,
                     "folder_format": fmt.describe(), "fused_groups": len(parts.groups),
                     "unfused_groups": {}, "kv_cache": parts.kv, "moe": None}
        why = ("eager: emulation (no FP8 GEMMs on this device)" if mode == "emulate" else
               "eager: layer streaming runs each layer once per batch")
        self.execution = {"execution": "eager", "execution_reason": why}
        return None, parts.config

    def describe(self) -> dict[str, Any]:
        parts = self.parts
        if parts is not None:  # what building and running the layers showed
            self.info["fallbacks"] = dict(parts.fallbacks)
            self.info["unfused_groups"] = dict(parts.unfused)
            self.info["fused_groups"] = len(parts.groups) - len(parts.unfused)
            if parts.expert_gemms:
                self.info["moe"] = {"expert_gemms": dict(parts.expert_gemms),
                                    "note": "experts run per layer, streamed"}
        d = super().describe()
        d["streaming"] = self.streaming or {"mode": "layers"}
        return d
