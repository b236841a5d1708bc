"""``build-engine``: a strongly typed TensorRT FP8 engine from a Q/DQ ONNX graph.

Two builders, one report. The ``tensorrt`` Python API for 10.x (STRONGLY_TYPED network flag, no
precision builder flags — they were deprecated in 10.12) and 11.x (networks are always strongly
typed; the precision flags are gone), see reference/tensorrt_fp8_onnx.md §3; or, where only the
``trtexec`` binary is installed (NVIDIA's containers), the same build through it
(:mod:`fp8export.engine.trtexec`). Both export the engine inspector's JSON, which
:mod:`fp8export.engine.layers` turns into ``<engine>.build.json``. TensorRT is imported only here
and in the TensorRT runner.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8export._progress import stage
from fp8export.engine.shapes import ShapeRange, default_profile, read_graph
from fp8export.errors import Fp8ExportError, UsageError
from fp8export.io.atomic import write_file_atomic
from fp8export.io.guarded import TIMING_CACHE, read_input
from fp8export.io.outputs import check_file_target, claim_output_file, refuse_overlap

MIN_FP8_CC = (8, 9)  # Ada 8.9, Hopper 9.0, Blackwell 10.x/12.x


@dataclass(frozen=True)
class BuildEngineConfig:
    """Options of ``fp8export build-engine``."""

    onnx: Path
    output: Path | None = None  # default: <onnx stem>.engine beside the graph
    shapes: tuple[ShapeRange, ...] = ()
    workspace_gib: float | None = None
    optimization_level: int = 3
    timing_cache: Path | None = None
    force: bool = False
    trtexec: Path | None = None  # build through this trtexec binary instead of the Python API

    def __post_init__(self):
        object.__setattr__(self, "onnx", Path(self.onnx))
        for name in ("output", "timing_cache", "trtexec"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        if not 0 <= self.optimization_level <= 5:
            raise UsageError(f"--opt-level must be 0..5, got {self.optimization_level}.")
        if self.workspace_gib is not None and self.workspace_gib <= 0:
            raise UsageError(f"--workspace must be > 0 GiB, got {self.workspace_gib}.")

    @property
    def resolved_output(self) -> Path:
        return self.output or self.onnx.with_suffix(".engine")


@dataclass
class BuildEngineResult:
    engine: str
    report: str
    tensorrt_version: str
    gpu: str
    compute_capability: str
    build_seconds: float
    profile: list[dict]
    fp8_gemms: int
    fallback_gemms: list[str] = field(default_factory=list)
    unattributed_gemms: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    builder: str = "tensorrt"  # "tensorrt" (Python API) or "trtexec"
    command: list[str] = field(default_factory=list)  # the trtexec argv, when trtexec built it

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def trt_major(trt) -> int:
    return int(str(trt.__version__).split(".")[0])


def network_flags(trt) -> int:
    """Creation flags: STRONGLY_TYPED on 10.x; 0 on 11.x where it is implicit (and deprecated)."""
    if trt_major(trt) >= 11:
        return 0
    return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)


def check_gpu() -> tuple[str, tuple[int, int]]:
    """Name and compute capability of GPU 0; FP8 needs CC >= 8.9."""
    import torch

    if not torch.cuda.is_available():
        raise Fp8ExportError(
            "build-engine needs an NVIDIA GPU with compute capability >= 8.9 (Ada, Hopper, "
            "Blackwell); none is visible here. Build on the machine that will run the engine."
        )
    cc = torch.cuda.get_device_capability(0)
    name = torch.cuda.get_device_name(0)
    if cc < MIN_FP8_CC:
        raise Fp8ExportError(
            f"GPU {name} has compute capability {cc[0]}.{cc[1]}; TensorRT FP8 needs >= 8.9 "
            "(Ada, Hopper, Blackwell). Use an FP16 export, or build on a newer GPU."
        )
    return name, cc


def parser_errors(parser) -> list[str]:
    """Every ONNX parser error with node name and operator (TensorRT reports them one by one)."""
    out = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        node = e.node_name() if hasattr(e, "node_name") else str(e.node())
        op = e.node_operator() if hasattr(e, "node_operator") else "?"
        out.append(f"node {node!r} ({op}): {e.desc()}")
    return out


def _structural_check(onnx_path: Path) -> list[str]:
    """Run the Q/DQ structural checker; return the ONNX GEMM nodes expected in FP8."""
    from fp8export.onnx.check import check_model

    report = check_model(onnx_path)
    if not report.ok:
        raise Fp8ExportError(
            f"{onnx_path} fails the FP8 Q/DQ structural check, so TensorRT would not build FP8 "
            f"GEMMs from it:\n{report.to_text()}\nRe-export it with `fp8export export-onnx`."
        )
    d = report.to_dict()
    return list(d.get("fp8_gemms", []))


@dataclass(frozen=True)
class _Plan:
    """What both builders need, checked before either starts."""

    out: Path
    profile: list[ShapeRange]
    expected_fp8: list[str]


def _plan(cfg: BuildEngineConfig, *, for_print: bool = False) -> _Plan:
    if not cfg.onnx.is_file():
        raise Fp8ExportError(
            f"{cfg.onnx}: no such ONNX file. Make one with `fp8export export-onnx`.")
    out = cfg.resolved_output
    from fp8export.engine.trtexec import layer_info_path, log_path

    # the engine, its build report and trtexec's layer information and log
    written = [out, Path(f"{out}.build.json"), layer_info_path(out), log_path(out)]
    for path in written:
        if for_print:  # only the command is printed: nothing is replaced yet
            refuse_overlap(path, [cfg.onnx])
        else:
            claim_output_file(path, inputs=[cfg.onnx], force=cfg.force)
    if cfg.timing_cache is not None:  # read and rewritten by design: never one of the others
        refuse_overlap(cfg.timing_cache, [cfg.onnx, *written], "--timing-cache")
        if cfg.timing_cache.exists() or cfg.timing_cache.is_symlink():
            check_file_target(cfg.timing_cache, True, "--timing-cache")
    inputs, longest = read_graph(cfg.onnx)
    profile = default_profile(inputs, list(cfg.shapes), max_positions=longest)
    return _Plan(out, profile, _structural_check(cfg.onnx))


def choose_builder(cfg: BuildEngineConfig) -> str:
    """"trtexec" when asked for or when only trtexec is installed, else "tensorrt"."""
    from fp8export.engine.trtexec import find_trtexec

    if cfg.trtexec is not None:
        find_trtexec(cfg.trtexec)
        return "trtexec"
    if importlib.util.find_spec("tensorrt") is not None:
        return "tensorrt"
    if find_trtexec() is not None:
        return "trtexec"
    raise Fp8ExportError(
        "TensorRT is not installed here: neither the Python package 'tensorrt' nor a 'trtexec' "
        "binary on PATH. Install it (pip install 'fp8export[tensorrt]', TensorRT 10.x/11.x from "
        "NVIDIA's index), pass --trtexec PATH, or print the build command with --print-command "
        "and run it where TensorRT lives (README: the TensorRT container recipe).")


def trtexec_command_for(cfg: BuildEngineConfig) -> list[str]:
    """The trtexec command that builds ``cfg``'s engine (final paths), after the same checks."""
    from fp8export.engine.trtexec import TRTEXEC, find_trtexec, layer_info_path

    plan = _plan(cfg, for_print=True)
    exe = find_trtexec(cfg.trtexec) or TRTEXEC
    return _trtexec_argv(cfg, plan, exe, plan.out, layer_info_path(plan.out), cfg.timing_cache)


def build_engine(cfg: BuildEngineConfig) -> BuildEngineResult:
    """Parse, build, inspect and save an engine; write ``<engine>.build.json`` beside it."""
    plan = _plan(cfg)
    if choose_builder(cfg) == "trtexec":
        return _build_trtexec(cfg, plan)
    return _build_python(cfg, plan)


def _result(plan: _Plan, info, **fields) -> BuildEngineResult:
    """The result and its JSON report, from the inspector's JSON (either builder)."""
    from fp8export.engine.layers import attribute_gemms

    layers = attribute_gemms(info, plan.expected_fp8)
    notes = list(fields.pop("notes", [])) + layers.notes
    result = BuildEngineResult(
        engine=str(plan.out), report=str(plan.out) + ".build.json",
        profile=[r.to_dict() for r in plan.profile], fp8_gemms=len(layers.fp8_gemms),
        fallback_gemms=layers.fallback_gemms, unattributed_gemms=layers.unattributed,
        notes=notes, **fields)
    report = {**result.to_dict(), "layers": layers.to_dict(), "host": platform.node(),
              "expected_fp8_gemms": plan.expected_fp8}
    write_file_atomic(Path(result.report), json.dumps(report, indent=2, sort_keys=True).encode())
    return result


def _build_python(cfg: BuildEngineConfig, plan: _Plan) -> BuildEngineResult:
    from fp8export._lazy import missing

    try:
        import tensorrt as trt
    except ImportError as exc:
        raise missing("tensorrt", "build-engine", exc) from exc
    gpu, cc = check_gpu()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(cfg.onnx)):
        errors = parser_errors(parser)
        raise Fp8ExportError(
            f"TensorRT {trt.__version__} could not parse {cfg.onnx}:\n  " + "\n  ".join(errors)
        )

    config = builder.create_builder_config()
    if cfg.workspace_gib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(cfg.workspace_gib * 2**30))
    config.builder_optimization_level = cfg.optimization_level
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # the inspector needs it
    has_cache = cfg.timing_cache is not None and cfg.timing_cache.exists()
    cache_bytes = read_input(cfg.timing_cache, TIMING_CACHE) if has_cache else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=False)
    if plan.profile:
        p = builder.create_optimization_profile()
        for r in plan.profile:
            p.set_shape(r.name, r.min, r.opt, r.max)
        config.add_optimization_profile(p)

    start = time.perf_counter()
    with stage(f"building the TensorRT engine (optimization level {cfg.optimization_level})"):
        blob = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - start
    if blob is None:
        raise Fp8ExportError(
            f"TensorRT {trt.__version__} failed to build an engine from {cfg.onnx}; its log above "
            "says why (often: workspace too small — raise --workspace)."
        )
    if cfg.timing_cache:
        write_file_atomic(cfg.timing_cache, bytes(config.get_timing_cache().serialize()))

    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(blob)
    if engine is None:
        raise Fp8ExportError(
            "TensorRT built an engine it cannot deserialize; rebuild with --force.")
    inspector = engine.create_engine_inspector()
    info = inspector.get_engine_information(trt.LayerInformationFormat.JSON)
    write_file_atomic(plan.out, bytes(blob))
    return _result(plan, info, tensorrt_version=str(trt.__version__), gpu=gpu,
                   compute_capability=f"{cc[0]}.{cc[1]}", build_seconds=round(seconds, 3))


def _build_trtexec(cfg: BuildEngineConfig, plan: _Plan) -> BuildEngineResult:
    from fp8export.engine.trtexec import build_with_trtexec, find_trtexec, gpu_from_nvidia_smi

    gpu = gpu_from_nvidia_smi()
    if gpu is not None and gpu[1] < MIN_FP8_CC:
        raise Fp8ExportError(
            f"GPU {gpu[0]} has compute capability {gpu[1][0]}.{gpu[1][1]}; TensorRT FP8 needs "
            ">= 8.9 (Ada, Hopper, Blackwell). Build on the GPU that will run the engine.")
    exe = find_trtexec(cfg.trtexec)
    build = build_with_trtexec(lambda *paths: _trtexec_argv(cfg, plan, exe, *paths), plan.out,
                               cfg.timing_cache, MIN_FP8_CC)
    return _result(plan, build.info, notes=build.notes,
                   tensorrt_version=build.log.tensorrt_version, gpu=build.log.gpu,
                   compute_capability=build.log.compute_capability,
                   build_seconds=round(build.seconds, 3), builder="trtexec",
                   command=build.command)


def _trtexec_argv(cfg: BuildEngineConfig, plan: _Plan, exe, engine: Path, layer_info: Path,
                  timing_cache: Path | None) -> list[str]:
    from fp8export.engine.trtexec import trtexec_command

    return trtexec_command(exe, cfg.onnx, engine, layer_info, plan.profile,
                           optimization_level=cfg.optimization_level,
                           workspace_gib=cfg.workspace_gib, timing_cache=timing_cache)
