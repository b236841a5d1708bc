"""Lazy imports of heavy optional packages, failing with an install hint, never auto-installing."""

from __future__ import annotations

from fp8export.errors import Fp8ExportError

_HINTS = {
    "tensorrt": "pip install 'fp8export[tensorrt]' (TensorRT 10.x or 11.x from NVIDIA's index)",
    "keras": "pip install 'fp8export[keras]'",
    "h5py": "pip install 'fp8export[keras]'",
    "onnxruntime": "pip install onnxruntime (or onnxruntime-gpu via 'fp8export[gpu]')",
}


def missing(name: str, purpose: str | None, exc: ImportError) -> Fp8ExportError:
    """The error for an optional package that failed to import: what needs it, how to install it.

    Callers import the package with an ordinary ``import`` inside the function that needs it
    and raise this from the ImportError.

    Args:
        name: the package, e.g. ``"tensorrt"``.
        purpose: what needs it, for the message, e.g. ``"build-engine"``.
        exc: the ImportError.
    """
    top = name.split(".")[0]
    hint = _HINTS.get(top, f"pip install {top}")
    what = f" (needed for {purpose})" if purpose else ""
    return Fp8ExportError(f"Python package '{top}' is not installed{what}: {hint}. ({exc})")
