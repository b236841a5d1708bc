"""Torch runners: the bf16/fp32 reference (``TorchRunner``) and their shared machinery.

The feed is ``{"input_ids": int64 [B, T], "attention_mask": int64 [B, T]}`` (numpy); the
output is ``{"logits": float32 [B, T, V]}`` (``[B, C]`` for classifiers).
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from fp8export.errors import Fp8ExportError
from fp8export.runners.base import Runner

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
          "fp16": "float16", "float16": "float16"}


def torch_dtype(name: str):
    import torch

    key = str(name).lower()
    if key not in DTYPES:
        raise Fp8ExportError(f"dtype {name!r} is unknown; use bf16, fp16 or fp32.")
    return getattr(torch, DTYPES[key])


class TorchModelRunner(Runner):
    """A runner around a torch module built in ``_build()``; subclasses say how to build it."""

    def __init__(self, path: str | Path, *, dtype: str = "bf16", device: str = "auto",
                 name: str | None = None, max_memory: dict[int | str, int] | None = None):
        super().__init__(name)
        self.path = Path(path)
        self.dtype_name = str(dtype)
        self.device_name = device
        #: per-device budgets (``fp8export.placement``); None: one device unless the model
        #: does not fit the GPU and several are visible
        self.max_memory = max_memory

    @abstractmethod
    def _build(self):  # -> (model, config)
        """Build the torch model on ``self.device`` in ``self.dtype`` (or spread it over the
        devices of ``self._budgets(...)``, setting ``self.placement``)."""

    def _budgets(self, weight_bytes) -> dict[int | str, int] | None:
        """Where to spread a model of ``weight_bytes()`` bytes, or None for ``self.device``."""
        from fp8export.placement import budgets

        return budgets(self.device, weight_bytes() if self.device == "cuda" else 0,
                       self.max_memory)

    def _activate(self) -> None:
        from fp8export.placement import resolve_device

        self.device = resolve_device(self.device_name or "auto")
        self.dtype = torch_dtype(self.dtype_name)
        self.model, self.config = self._build()
        # inputs go where the first layer runs (the embedding's GPU when spread)
        self.input_device = self.placement.main_device if self.placement else self.device

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        if "input_ids" not in feed:
            raise Fp8ExportError(f"runner {self.name}: feed needs 'input_ids', got {list(feed)}")
        ids = torch.as_tensor(np.asarray(feed["input_ids"]), dtype=torch.long,
                              device=self.input_device)
        kwargs = {"input_ids": ids}
        if feed.get("attention_mask") is not None:
            kwargs["attention_mask"] = torch.as_tensor(np.asarray(feed["attention_mask"]),
                                                       dtype=torch.long,
                                                       device=self.input_device)
        extras = {k: torch.as_tensor(np.asarray(v)) for k, v in feed.items()
                  if k not in ("input_ids", "attention_mask")}
        if extras or getattr(getattr(self.model, "config", None), "is_encoder_decoder", False):
            from fp8export.models import model_inputs

            kwargs = model_inputs(self.model, ids, kwargs.get("attention_mask"), extras,
                                  self.input_device)
        with torch.inference_mode():
            out = self.model(**kwargs, use_cache=False) if self._takes_cache() else \
                self.model(**kwargs)
        if isinstance(out, torch.Tensor):  # a rebuilt Keras model returns its output
            logits = out
        else:
            logits = out.logits if hasattr(out, "logits") else out[0]
        return {"logits": logits.float().cpu().numpy()}

    def _takes_cache(self) -> bool:
        return bool(getattr(getattr(self.model, "config", None), "use_cache", False))

    def _deactivate(self) -> None:
        self.model = None
        if self.placement is not None:
            self.placement.close()

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(path=str(self.path), dtype=self.dtype_name,
                 device=getattr(self, "device", self.device_name))
        if self.placement is not None:
            d["device"] = ",".join(self.placement.devices)
            d["placement"] = self.placement.describe()
        return d


class TorchRunner(TorchModelRunner):
    """The reference: the checkpoint in bf16 (or fp32), on one device or spread over several
    (``fp8export.models.load_model_placed``, as calibration loads it)."""

    backend = "torch"

    def _build(self):
        from fp8export.models import load_model_placed

        model, config, self.placement = load_model_placed(self.path, self.device,
                                                          self.max_memory, dtype=self.dtype)
        return model, config
