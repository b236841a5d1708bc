"""TrtRunner on a machine without TensorRT, and its engine I/O dtype table.

Running an engine needs TensorRT and a GPU: ``tests/engine/test_build_cli.py``
(``test_real_build_runs_fp8_gemm``, marked tensorrt) builds one and runs it through this runner.
"""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from fp8export.errors import Fp8ExportError
from fp8export.runners.trt_runner import TrtRunner, _torch_dtype


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None,
                    reason="TensorRT is installed here")
def test_activate_without_tensorrt_names_the_extra(tmp_path):
    runner = TrtRunner(tmp_path / "model.engine")
    assert runner.backend == "tensorrt" and runner.name == "tensorrt"
    with pytest.raises(Fp8ExportError, match=r"'tensorrt' is not installed \(needed for running "
                       r"a TensorRT engine\): pip install 'fp8export\[tensorrt\]'"):
        runner.activate()
    assert not runner.is_active
    with pytest.raises(Fp8ExportError, match="must be activated"):
        runner.infer({"input_ids": torch.zeros(1, 2).numpy()})


def _trt(*newer: str):
    """The part of the tensorrt module the table reads: ``DataType`` members (TensorRT 8.6
    lacks BF16, INT64 and FP8; 10.x has them)."""
    names = ("FLOAT", "HALF", "INT32", "INT8", "BOOL", *newer)
    return SimpleNamespace(DataType=SimpleNamespace(**{n: f"DataType.{n}" for n in names}))


def test_engine_dtypes_map_to_torch():
    trt = _trt("BF16", "INT64", "FP8")
    table = {"FLOAT": torch.float32, "HALF": torch.float16, "INT32": torch.int32,
             "INT8": torch.int8, "BOOL": torch.bool, "BF16": torch.bfloat16,
             "INT64": torch.int64, "FP8": torch.float8_e4m3fn}
    for name, want in table.items():
        assert _torch_dtype(trt, getattr(trt.DataType, name)) is want


def test_an_engine_dtype_this_tensorrt_lacks_is_a_clear_error():
    with pytest.raises(Fp8ExportError, match="DataType.BF16 is not supported by the TensorRT"):
        _torch_dtype(_trt(), "DataType.BF16")
