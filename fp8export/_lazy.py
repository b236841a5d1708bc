"""Lazy imports of heavy optional packages, failing with an install hint, never auto-installing."""

from __future__ import annotations

import importlib
from types import ModuleType

from fp8export.errors import Fp8ExportError

_HINTS = {
    "tensorrt": "pip install 'fp8export[tensorrt]' (TensorRT 10.x or 11.x from NVIDIA's index)",
    "keras": "pip install 'fp8export[keras]'",
    "h5py": "pip install 'fp8export[keras]'",
    "matplotlib": "pip install 'fp8export[plot]'",
    "onnxruntime": "pip install onnxruntime (or onnxruntime-gpu via 'fp8export[gpu]')",
}


def lazy_import(name: str, purpose: str | None = None) -> ModuleType:
    """Import ``name`` or raise Fp8ExportError saying how to install it.

    Args:
        name: module to import, e.g. ``"tensorrt"``.
        purpose: what needs it, for the message, e.g. ``"build-engine"``.
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        top = name.split(".")[0]
        hint = _HINTS.get(top, f"pip install {top}")
        what = f" (needed for {purpose})" if purpose else ""
        raise Fp8ExportError(f"Python package '{top}' is not installed{what}: {hint}. ({exc})") from exc
