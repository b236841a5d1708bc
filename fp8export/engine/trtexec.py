"""``build-engine`` through TensorRT's ``trtexec`` binary, where the Python package is missing.

NVIDIA's containers and TensorRT tarballs ship ``trtexec`` (TensorRT ``samples/trtexec``) whether
or not the ``tensorrt`` wheel is installed. It builds the same strongly typed engine as the Python
path, with these flags (``samples/common/sampleOptions.cpp``):

``--onnx``, ``--saveEngine``        the graph and the engine.
``--stronglyTyped``                 TensorRT 10.x: opt in to strong typing (what FP8 Q/DQ needs, and
                                    no precision flags with it); 11.x: accepted, strong typing is
                                    always on.
``--minShapes/--optShapes/--maxShapes``  the optimization profile, ``name:AxB`` joined by commas;
                                    a name holding ``:`` or ``,`` is wrapped in single quotes.
``--memPoolSize=workspace:N``       workspace limit in MiB (trtexec's unit without a suffix).
``--builderOptimizationLevel=N``    0..5, default 3.
``--timingCacheFile=F``             loaded when present, saved after the build.
``--profilingVerbosity=detailed`` and ``--exportLayerInfo=F``  trtexec writes
                                    ``IEngineInspector::getEngineInformation(kJSON)`` to F
                                    (``samples/common/sampleReporting.cpp``,
                                    ``printLayerInfo``): the document the Python path gets from
                                    the inspector, parsed by :mod:`fp8export.engine.layers` into
                                    the same build report.
``--skipInference``                 build, save and export layer info; no benchmark run.

From its log: ``&&&& RUNNING TensorRT.trtexec [TensorRT v100300]`` (``NV_TENSORRT_VERSION`` =
major·10000 + minor·100 + patch; 8.x used major·1000 + minor·100 + patch), ``Selected Device:``
and ``Compute Capability:`` (``samples/common/sampleDevice.cpp``).

build-engine runs trtexec on hidden temporary names beside the outputs and renames them into
place only after a successful build; ``--print-command`` prints the command with the final names,
for a machine where TensorRT lives.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fp8export.engine.shapes import ShapeRange
from fp8export.errors import Fp8ExportError
from fp8export.io.atomic import OUTPUT_MODE

TRTEXEC = "trtexec"
_VERSION = re.compile(r"\[TensorRT v(\d+)\]")
_DEVICE = re.compile(r"Selected Device:\s*(.+?)\s*$", re.M)
_CC = re.compile(r"Compute Capability:\s*(\d+)\.(\d+)")


def find_trtexec(explicit: Path | None = None) -> Path | None:
    """The trtexec to run: ``explicit`` (must be an executable file), else ``trtexec`` on PATH."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file() or not os.access(path, os.X_OK):
            raise Fp8ExportError(f"--trtexec {path}: not an executable file. Give the path of "
                                 "TensorRT's trtexec binary (e.g. /usr/src/tensorrt/bin/trtexec).")
        return path
    found = shutil.which(TRTEXEC)
    return Path(found) if found else None


def _name(name: str) -> str:
    return f"'{name}'" if any(c in name for c in ":,") else name


def _shapes(profile: list[ShapeRange], which: str) -> str:
    return ",".join(f"{_name(r.name)}:{'x'.join(str(d) for d in getattr(r, which))}"
                    for r in profile)


def trtexec_command(trtexec: str | Path, onnx: Path, engine: Path, layer_info: Path,
                    profile: list[ShapeRange], *, optimization_level: int = 3,
                    workspace_gib: float | None = None,
                    timing_cache: Path | None = None) -> list[str]:
    """The trtexec argv that builds ``engine`` from ``onnx`` (strongly typed, layer info on)."""
    cmd = [str(trtexec), f"--onnx={onnx}", f"--saveEngine={engine}", "--stronglyTyped"]
    if profile:
        cmd += [f"--minShapes={_shapes(profile, 'min')}", f"--optShapes={_shapes(profile, 'opt')}",
                f"--maxShapes={_shapes(profile, 'max')}"]
    if workspace_gib:
        cmd.append(f"--memPoolSize=workspace:{max(1, int(workspace_gib * 1024))}")
    cmd.append(f"--builderOptimizationLevel={optimization_level}")
    if timing_cache is not None:
        cmd.append(f"--timingCacheFile={timing_cache}")
    cmd += ["--profilingVerbosity=detailed", f"--exportLayerInfo={layer_info}", "--skipInference"]
    return cmd


def layer_info_path(engine: Path) -> Path:
    return Path(str(engine) + ".layers.json")


def log_path(engine: Path) -> Path:
    return Path(str(engine) + ".trtexec.log")


@dataclass(frozen=True)
class TrtexecLog:
    """What trtexec's log says about the build."""

    tensorrt_version: str  # "10.3.0", or "unknown"
    gpu: str
    compute_capability: str  # "9.0", or "unknown"
    passed: bool


def _version(code: int) -> str:
    if code >= 100000:  # NV_TENSORRT_VERSION_INT since 10.0: major*10000 + minor*100 + patch
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"  # 8.x: major*1000 + minor*100 + patch


def parse_log(text: str) -> TrtexecLog:
    v = _VERSION.search(text)
    d = _DEVICE.search(text)
    cc = _CC.search(text)
    return TrtexecLog(
        tensorrt_version=_version(int(v.group(1))) if v else "unknown",
        gpu=d.group(1) if d else "unknown",
        compute_capability=f"{cc.group(1)}.{cc.group(2)}" if cc else "unknown",
        passed="&&&& PASSED" in text)


def gpu_from_nvidia_smi() -> tuple[str, tuple[int, int]] | None:
    """Name and compute capability of GPU 0 from ``nvidia-smi``, or None when it cannot say."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    m = re.match(r"\s*(.+?)\s*,\s*(\d+)\.(\d+)\s*$", line)
    if not m:
        return None
    return m.group(1), (int(m.group(2)), int(m.group(3)))


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n  ".join(text[-lines:])


def run_trtexec(cmd: list[str], log: Path) -> float:
    """Run ``cmd`` writing its output to ``log`` (and to the terminal when one is attached).

    Returns the wall time. Raises Fp8ExportError naming the log when trtexec fails; an interrupt
    stops trtexec before it is re-raised.
    """
    from fp8export._progress import info, printable, progress_enabled

    echo = progress_enabled()
    info(f"building with {cmd[0]} (log: {log})")
    start = time.perf_counter()
    try:  # never through a symlink planted at the (predictable) log name
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0),
                     OUTPUT_MODE)
    except OSError as exc:
        raise Fp8ExportError(f"{log}: cannot write the trtexec log ({exc.strerror or exc}). "
                             "Remove it, or choose another -o.") from exc
    with os.fdopen(fd, "w") as out:
        out.write("$ " + shlex.join(cmd) + "\n")
        out.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace")
        except OSError as exc:
            raise Fp8ExportError(f"cannot run {cmd[0]}: {exc}. Check --trtexec / PATH.") from exc
        try:
            for line in proc.stdout:
                out.write(line)
                if echo:
                    sys.stderr.write(printable(line))
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    seconds = time.perf_counter() - start
    if rc != 0:
        raise Fp8ExportError(
            f"trtexec failed (exit {rc}) building the engine; the end of its log ({log}):\n  "
            f"{_tail(log)}\nThe full command is the first line of the log.")
    return seconds


def read_layer_info(path: Path) -> tuple[dict | list | None, str]:
    """The exported layer information, or (None, why not)."""
    if not path.is_file() or path.stat().st_size == 0:
        return None, f"trtexec wrote no layer information ({path.name}); precisions unknown"
    from fp8export.engine.layers import parse_engine_information

    try:
        info = json.loads(path.read_text(errors="replace"))
        parse_engine_information(info)
    except (json.JSONDecodeError, ValueError, AttributeError, TypeError) as exc:
        return None, f"trtexec's layer information {path.name} is not inspector JSON ({exc})"
    return info, ""


@dataclass
class TrtexecBuild:
    """One finished trtexec build: its outputs are in place under their final names."""

    seconds: float
    log: TrtexecLog
    info: dict | list  # the inspector JSON ({"Layers": []} when trtexec wrote none)
    command: list[str]  # the argv with the final paths (what --print-command prints)
    notes: list[str] = field(default_factory=list)


def build_with_trtexec(argv: Callable[[Path, Path, Path | None], list[str]], engine: Path,
                       timing_cache: Path | None, min_cc: tuple[int, int]) -> TrtexecBuild:
    """Run the trtexec build on hidden temporary names; rename them into place on success.

    ``argv(engine, layer_info, timing_cache)`` gives the command for a set of paths. The engine,
    layer information and timing cache are renamed into place only when trtexec exits 0, wrote an
    engine, and ran on a GPU of compute capability >= ``min_cc``; otherwise the previous files
    stay as they were and the temporaries are removed. The log stays beside the engine.
    """
    from fp8export.io.atomic import fsync_dir

    info_path, log = layer_info_path(engine), log_path(engine)
    from fp8export.io.guarded import TIMING_CACHE, copy_input

    # Random names: trtexec opens what it is given, so a name planted beside the output (a
    # symlink elsewhere) must not be guessable.
    tag = f".tmp-{os.getpid()}-{secrets.token_hex(8)}"
    tmp_engine = engine.with_name(f".{engine.name}{tag}")
    tmp_info = info_path.with_name(f".{info_path.name}{tag}")
    tmp_cache = None
    if timing_cache is not None:
        tmp_cache = timing_cache.with_name(f".{timing_cache.name}{tag}")
        if timing_cache.is_file():
            copy_input(timing_cache, tmp_cache, TIMING_CACHE, mode=OUTPUT_MODE)
    try:
        seconds = run_trtexec(argv(tmp_engine, tmp_info, tmp_cache), log)
        facts = parse_log(log.read_text(errors="replace"))
        if not tmp_engine.is_file() or tmp_engine.stat().st_size == 0:
            raise Fp8ExportError(f"trtexec exited 0 but wrote no engine; see its log {log}.")
        if facts.compute_capability != "unknown" and \
                tuple(int(x) for x in facts.compute_capability.split(".")) < min_cc:
            raise Fp8ExportError(
                f"trtexec built on {facts.gpu} (compute capability {facts.compute_capability}); "
                f"TensorRT FP8 needs >= {min_cc[0]}.{min_cc[1]}, so this engine has no FP8 "
                "GEMMs. Build on an Ada, Hopper or Blackwell GPU.")
        info, why = read_layer_info(tmp_info)
        os.replace(tmp_engine, engine)
        if tmp_info.exists():
            os.replace(tmp_info, info_path)
        if tmp_cache is not None and tmp_cache.is_file():
            os.replace(tmp_cache, timing_cache)
        fsync_dir(engine.parent)
    finally:
        for t in (tmp_engine, tmp_info, tmp_cache):
            if t is not None and t.exists():
                t.unlink()
    return TrtexecBuild(seconds=seconds, log=facts,
                        info=info if info is not None else {"Layers": []},
                        command=argv(engine, info_path, timing_cache),
                        notes=[why] if why else [])
