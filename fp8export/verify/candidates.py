"""Which runner a path needs: detection of the candidate kind, and the reference runner."""

from __future__ import annotations

from pathlib import Path

from fp8export.checkpoint.model_config import read_model_config
from fp8export.errors import Fp8ExportError, UsageError
from fp8export.fp8dir.reader import fp8_folder_kind, is_fp8_folder
from fp8export.runners.base import Runner

ENGINE_SUFFIXES = (".engine", ".plan", ".trt")
KINDS_HINT = ("Give an FP8 folder (written by `fp8export convert`, or a compressed-tensors, "
              "quant_method fp8 or ModelOpt FP8 folder written by another tool), an "
              "ONNX file (.onnx, from `fp8export export-onnx`), a TensorRT engine "
              "(.engine/.plan, from `fp8export build-engine`), or an unquantized Hugging Face "
              "folder (config.json + weights).")


def candidate_kind(path: Path) -> str:
    """"fp8-folder", "onnx", "engine" or "hf-folder"; Fp8ExportError for anything else."""
    p = Path(path)
    if not p.exists():
        raise Fp8ExportError(f"{p}: no such candidate file or folder. {KINDS_HINT}")
    if p.is_dir():
        if fp8_folder_kind(p) is not None:
            return "fp8-folder"
        config = read_model_config(p)
        if config is not None:
            qc = config.get("quantization_config")
            if qc:
                method = qc.get("quant_method") if isinstance(qc, dict) else qc
                raise Fp8ExportError(
                    f"{p}: a quantized folder whose quantization_config (quant_method "
                    f"{str(method)[:40]!r}) is not FP8 in a dialect fp8export reads "
                    "(compressed-tensors with 8-bit float weights, quant_method fp8, ModelOpt "
                    "quant_algo FP8); verify runs FP8 folders. Convert the bf16 checkpoint with "
                    "fp8export, or export it to ONNX.")
            return "hf-folder"
        raise Fp8ExportError(f"{p}: folder has neither fp8export.json nor config.json. "
                             f"{KINDS_HINT}")
    suffix = p.suffix.lower()
    if suffix == ".onnx":
        return "onnx"
    if suffix in ENGINE_SUFFIXES:
        return "engine"
    raise Fp8ExportError(f"{p}: unknown candidate kind (suffix {p.suffix!r}). {KINDS_HINT}")


_BACKEND_OF = {"fp8-folder": "torch", "hf-folder": "torch", "onnx": "onnxruntime",
               "engine": "tensorrt"}


def open_candidate(path: Path, *, backend: str = "auto", device: str = "auto",
                   dtype: str = "bf16", fp8_mode: str = "auto",
                   max_memory: dict[int | str, int] | None = None,
                   ort_opt_level: str | None = None, kv_cache: str = "auto",
                   attention: str = "bf16") -> Runner:
    """The runner for ``path`` (not yet activated); ``backend`` must fit the kind when given.
    ``max_memory``: spread a torch candidate over these devices (``fp8export.placement``).
    ``ort_opt_level``: an ONNX candidate's onnxruntime level (None: onnxruntime's default)."""
    kind = candidate_kind(path)
    natural = _BACKEND_OF[kind]
    backend = str(backend)
    if backend not in ("auto", natural):
        raise Fp8ExportError(f"{path}: --backend {backend} cannot run a {kind} candidate; it "
                             f"runs with --backend {natural} (or auto).")
    if (kv_cache != "auto" or attention != "bf16") and kind != "fp8-folder":
        raise UsageError(f"--kv-cache / --attention choose how an FP8 folder's torch runtime "
                         f"runs its attention; {path} is a {kind}. Drop the options.")
    if ort_opt_level is not None and kind != "onnx":
        raise UsageError(f"--ort-opt-level sets onnxruntime's optimization level of an .onnx "
                         f"candidate; {path} is a {kind}. Drop the option.")
    if kind == "fp8-folder":
        from fp8export.runners.torch_fp8_runner import TorchFp8Runner

        return TorchFp8Runner(path, dtype=dtype, device=device, mode=fp8_mode, name="candidate",
                              max_memory=max_memory, kv_cache=kv_cache, attention=attention)
    if kind == "hf-folder":
        from fp8export.runners.torch_runner import TorchRunner

        return TorchRunner(path, dtype=dtype, device=device, name="candidate",
                           max_memory=max_memory)
    if kind == "onnx":
        try:
            from fp8export.runners.ort_runner import OrtRunner
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("fp8export"):
                raise Fp8ExportError("this fp8export build has no onnxruntime runner yet; "
                                     "verify the FP8 folder instead.") from exc
            raise
        return OrtRunner(path, graph_optimization_level=ort_opt_level)
    # TensorRT: the runner imports tensorrt lazily and checks the GPU in activate().
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        raise Fp8ExportError(
            f"{path}: a TensorRT engine, but TensorRT is not installed here, so it cannot run. "
            "Install it (pip install 'fp8export[tensorrt]', TensorRT 10.x/11.x from NVIDIA's "
            "index) on the GPU machine the engine was built for, or build and verify it in "
            "NVIDIA's TensorRT container (scripts/trt-container.sh), or verify the FP8 folder "
            "or its ONNX on this machine instead.")
    from fp8export.runners.trt_runner import TrtRunner

    return TrtRunner(path)


def open_reference(path: Path, *, dtype: str = "bf16", device: str = "auto",
                   max_memory: dict[int | str, int] | None = None) -> Runner:
    """The torch reference runner; the reference must be an unquantized checkpoint.

    A Keras ``.keras`` / ``.weights.h5`` file is rebuilt in torch from its config (float8
    layers with their full-precision kernels, as Keras keeps them).
    """
    p = Path(path)
    if not p.exists():
        raise Fp8ExportError(f"{p}: no such reference checkpoint. Give the bf16/fp32 model the "
                             "candidate was converted from (a Hugging Face folder).")
    if is_fp8_folder(p) or fp8_folder_kind(p) is not None:
        raise Fp8ExportError(f"{p}: the reference is an FP8 folder; the reference must be the "
                             "original high-precision checkpoint (swap the two arguments?).")
    if p.suffix.lower() in (".onnx",) + ENGINE_SUFFIXES:
        raise Fp8ExportError(f"{p}: the reference must be a torch checkpoint (a Hugging Face "
                             "folder), not an ONNX graph or an engine.")
    from fp8export.runners.keras_runner import KerasRunner, is_keras_file

    if is_keras_file(p):
        return KerasRunner(p, dtype=dtype, device=device, name="reference")
    from fp8export.runners.torch_runner import TorchRunner

    return TorchRunner(p, dtype=dtype, device=device, name="reference", max_memory=max_memory)
