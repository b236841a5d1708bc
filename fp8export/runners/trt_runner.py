"""TensorRT runner: runs a serialized engine with torch tensors as I/O buffers.

The only runner module that imports tensorrt (lazily). bf16/fp8 I/O cannot go through numpy
(``trt.nptype`` raises for them), so buffers are torch CUDA tensors and ``execute_async_v3``
gets their ``data_ptr()`` (reference/tensorrt_fp8_onnx.md §3.4). Outputs come back as numpy
float32 (bf16 is widened) so comparisons share one format.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fp8export.errors import Fp8ExportError
from fp8export.runners.base import Runner


def _torch_dtype(trt, dt):
    import torch

    table = {
        trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
        trt.DataType.INT32: torch.int32, trt.DataType.INT8: torch.int8,
        trt.DataType.BOOL: torch.bool,
    }
    newer = (("BF16", torch.bfloat16), ("INT64", torch.int64), ("FP8", torch.float8_e4m3fn))
    for name, tdt in newer:
        if hasattr(trt.DataType, name):
            table[getattr(trt.DataType, name)] = tdt
    if dt not in table:
        raise Fp8ExportError(f"engine I/O dtype {dt} is not supported by the TensorRT runner.")
    return table[dt]


class TrtRunner(Runner):
    """Run ``model.engine`` on GPU 0. Feed: numpy arrays by input name."""

    backend = "tensorrt"

    def __init__(self, engine_path: str | Path, name: str | None = None):
        super().__init__(name)
        self.engine_path = Path(engine_path)
        self._engine = self._context = self._stream = None

    def _activate(self) -> None:
        from fp8export._lazy import missing
        from fp8export.engine.build import check_gpu

        try:
            import tensorrt as trt
        except ImportError as exc:
            raise missing("tensorrt", "running a TensorRT engine", exc) from exc
        check_gpu()
        import torch

        if not self.engine_path.is_file():
            raise Fp8ExportError(f"{self.engine_path}: no such engine file.")
        self._trt = trt
        logger = trt.Logger(trt.Logger.WARNING)
        self._engine = trt.Runtime(logger).deserialize_cuda_engine(self.engine_path.read_bytes())
        if self._engine is None:
            raise Fp8ExportError(
                f"{self.engine_path}: TensorRT {trt.__version__} cannot load this engine. Engines "
                "are tied to the GPU model and TensorRT version that built them: rebuild it here "
                "with `fp8export build-engine`."
            )
        self._context = self._engine.create_execution_context()
        self._stream = torch.cuda.Stream()

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        trt, engine, ctx = self._trt, self._engine, self._context
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        missing = [n for n in inputs if n not in feed]
        if missing:
            raise Fp8ExportError(f"engine {self.engine_path.name} needs inputs {missing}; "
                                 f"got {sorted(feed)}.")
        keep = []
        for n in inputs:
            t = torch.from_numpy(np.ascontiguousarray(feed[n])).to(
                device="cuda", dtype=_torch_dtype(trt, engine.get_tensor_dtype(n)))
            if not ctx.set_input_shape(n, tuple(t.shape)):
                raise Fp8ExportError(
                    f"input {n} shape {tuple(t.shape)} is outside the engine's optimization "
                    "profile; rebuild with --shapes covering it."
                )
            ctx.set_tensor_address(n, t.data_ptr())
            keep.append(t)
        outputs = {}
        for n in names:
            if n in inputs:
                continue
            shape = tuple(ctx.get_tensor_shape(n))
            dtype = _torch_dtype(trt, engine.get_tensor_dtype(n))
            t = torch.empty(shape, device="cuda", dtype=dtype)
            ctx.set_tensor_address(n, t.data_ptr())
            outputs[n] = t
        if not ctx.execute_async_v3(self._stream.cuda_stream):
            raise Fp8ExportError(f"TensorRT failed to execute {self.engine_path.name}.")
        self._stream.synchronize()
        return {n: t.float().cpu().numpy() for n, t in outputs.items()}

    def _deactivate(self) -> None:
        self._context = self._engine = self._stream = None
