"""fp8export: take a trained transformer to a verified FP8 (E4M3) deployment.

Importing this package is cheap: it pulls in nothing heavier than the standard library.
torch, onnx, onnxruntime, transformers, keras and tensorrt are imported inside the functions
that need them (see ``fp8export._lazy``), so ``fp8export --help`` stays instant.
"""

__version__ = "0.1.0"

from fp8export.errors import Fp8ExportError, VerificationFailed  # noqa: E402

__all__ = [
    # version
    "__version__",
    # errors
    "Fp8ExportError",
    "VerificationFailed",
]
