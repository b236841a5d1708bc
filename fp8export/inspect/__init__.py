"""``fp8export inspect``: tables and plots of checkpoints, FP8 folders and ONNX graphs.

:func:`inspect` returns an :class:`InspectResult` (JSON-safe via ``to_dict``, a table via
``to_text``); the CLI command only renders it.
"""

from fp8export.inspect.collect import inspect
from fp8export.inspect.result import InspectResult, TensorRow

__all__ = ["InspectResult", "TensorRow", "inspect"]
