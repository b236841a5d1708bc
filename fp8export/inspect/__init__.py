"""``fp8export inspect``: tables and plots of checkpoints, FP8 folders and ONNX graphs, as an
``InspectResult`` (JSON-safe ``to_dict``, a table ``to_text``) that the command renders."""

from fp8export.inspect.collect import inspect
from fp8export.inspect.result import InspectResult, TensorRow

__all__ = ["InspectResult", "TensorRow", "inspect"]
