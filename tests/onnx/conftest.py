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


def _export(folder: Path, out: Path, dtype: str | None = None):
    from fp8export.onnx.export import ExportOnnxConfig, export_onnx

    return export_onnx(ExportOnnxConfig(fp8_dir=folder, output=out, dtype=dtype)), out


@pytest.fixture(scope="session")
def onnx_fp16(fp8_static, tmp_path_factory):
    """(ExportResult, path) of the fp16 export of the static folder."""
    return _export(fp8_static, tmp_path_factory.mktemp("export16") / "model.onnx", "fp16")


@pytest.fixture(scope="session")
def onnx_dynamic_fp16(fp8_dynamic, tmp_path_factory):
    """(ExportResult, path): the dynamic-activation folder (weight-only DQ) in fp16."""
    return _export(fp8_dynamic, tmp_path_factory.mktemp("export-dyn") / "model.onnx", "fp16")


@pytest.fixture(scope="session")
def channel_fp8(tmp_path_factory) -> Path:
    """The tiny Llama with per-output-channel weight scales (static input scales)."""
    root = tmp_path_factory.mktemp("channel")
    return make_fp8_folder(root / "fp8", scales="calibrate", weight_granularity="channel")


@pytest.fixture(scope="session")
def onnx_channel_fp32(channel_fp8):
    """(ExportResult, path): the per-channel folder in fp32."""
    return _export(channel_fp8, channel_fp8.parent / "model.onnx", "fp32")


@pytest.fixture(scope="session")
def block_fp8(tmp_path_factory) -> Path:
    """The tiny Llama with 32x16 block weight scales (dynamic per-token-group inputs)."""
    root = tmp_path_factory.mktemp("block")
    return make_fp8_folder(root / "fp8", scales="weights", weight_granularity="block",
                           block_size="32x16")


@pytest.fixture(scope="session")
def onnx_block_fp32(block_fp8):
    """(ExportResult, path): the block folder in fp32."""
    return _export(block_fp8, block_fp8.parent / "model32.onnx", "fp32")


@pytest.fixture(scope="session")
def onnx_block_fp16(block_fp8):
    """(ExportResult, path): the block folder in fp16."""
    return _export(block_fp8, block_fp8.parent / "model16.onnx", "fp16")


@pytest.fixture(scope="session")
def onnx_keras_float8(keras_float8_folder, tmp_path_factory):
    """(ExportResult, path): the Keras look-alike sample (--scales history), fp32 (its default)."""
    return _export(keras_float8_folder, tmp_path_factory.mktemp("keras-onnx") / "model.onnx")


from fp8_folder_maker import token_feed  # noqa: E402,F401  (one home, importable by tests)
