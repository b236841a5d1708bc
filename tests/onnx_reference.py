"""``onnx.reference`` as a Runner: numpy, slow, independent of onnxruntime (a cross-check).

Runs bf16 graphs too (through ml_dtypes). For tests and small graphs only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fp8export.runners.base import Runner
from fp8export.runners.ort_runner import _prepare_feed

_INT64 = 7  # onnx.TensorProto.INT64


class OnnxReferenceRunner(Runner):
    backend = "onnx-reference"

    def __init__(self, path: str | Path, name: str | None = None):
        super().__init__(name)
        self.path = Path(path)
        self.evaluator = None

    def _activate(self) -> None:
        from onnx.reference import ReferenceEvaluator

        from fp8export.onnx.load import load_onnx

        model = load_onnx(self.path, load_data=True)
        self.evaluator = ReferenceEvaluator(model)
        self._inputs = {i.name: ("tensor(int64)" if i.type.tensor_type.elem_type == _INT64
                                 else "") for i in model.graph.input}
        self._outputs = [o.name for o in model.graph.output]

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = self.evaluator.run(None, _prepare_feed(feed, self._inputs, self.name))
        return dict(zip(self._outputs, values))

    def _deactivate(self) -> None:
        self.evaluator = None
