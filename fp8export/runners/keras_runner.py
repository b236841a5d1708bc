"""A Keras ``.keras`` / ``.weights.h5`` model as a reference runner, rebuilt in torch (no Keras).

Float8 layers run with their full-precision kernels (Keras keeps them unquantized), so this is
the model without FP8, in ``dtype`` (bf16 or fp32, the tutorial's two precisions). The output
is the Keras model's own (probabilities behind a sigmoid/softmax head); ``output_activation``
says which, so the comparison can turn both sides into class logits.
"""

from __future__ import annotations

from typing import Any

from fp8export.runners.torch_runner import TorchModelRunner

KERAS_SUFFIXES = (".keras", ".weights.h5")


def is_keras_file(path) -> bool:
    return str(path).endswith(KERAS_SUFFIXES)


class KerasRunner(TorchModelRunner):
    backend = "torch"

    def __init__(self, path, *, dtype: str = "bf16", device: str = "auto",
                 name: str | None = None):
        super().__init__(path, dtype=dtype, device=device, name=name)
        self._data_config: dict[str, Any] = {}

    def _build(self):
        from fp8export.keras_model.build import load_keras_model

        model = load_keras_model(self.path, self.dtype)
        self.output_activation = model.output_activation
        self._data_config = {"vocab_size": model.vocab_size,
                             "max_position_embeddings": model.max_positions}
        return model.to(self.device), model.config

    def _infer(self, feed):
        import numpy as np

        from fp8export.errors import Fp8ExportError

        vocab = self._data_config.get("vocab_size")
        ids = np.asarray(feed["input_ids"])
        if vocab and ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise Fp8ExportError(
                f"{self.path}: token id {int(ids.max() if ids.max() >= vocab else ids.min())} is "
                f"outside the model's vocabulary (0..{vocab - 1}); the data was tokenised for "
                "another model.")
        return super()._infer(feed)

    def data_config(self) -> dict[str, Any]:
        """The rebuilt model's vocabulary and positions (a Keras config names neither)."""
        return self._data_config or self.config

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "format": "keras (rebuilt in torch)",
                "output_activation": self.output_activation}
