"""Session fixtures: one converted tiny Llama (static and dynamic scales) and its exports.

Each export traces the model with torch.export (~10-20 s on 2 cores), so they are shared.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fp8_folder_maker import make_fp8_folder  # noqa: E402


@pytest.fixture(scope="session")
def fp8_static(tmp_path_factory) -> Path:
    return make_fp8_folder(tmp_path_factory.mktemp("static") / "fp8", scales="calibrate")


@pytest.fixture(scope="session")
def fp8_dynamic(tmp_path_factory) -> Path:
    return make_fp8_folder(tmp_path_factory.mktemp("dynamic") / "fp8", scales="weights")


@pytest.fixture(scope="session")
def onnx_fp32(fp8_static, tmp_path_factory):
    """(ExportResult, path) of the fp32 export of the static folder."""
    from fp8export.onnx.export import ExportOnnxConfig, export_onnx

    out = tmp_path_factory.mktemp("export") / "model.onnx"
    result = export_onnx(ExportOnnxConfig(fp8_dir=fp8_static, output=out, dtype="fp32"))
    return result, out


from fp8_folder_maker import token_feed  # noqa: E402,F401  (one home, importable by tests)
