"""build-engine through trtexec: the command line, the layer-info format, the subprocess plumbing.

TensorRT cannot run here. What is tested:

* the argv build-engine gives trtexec (flags from TensorRT ``samples/common/sampleOptions.cpp``),
  and that ``--print-command`` prints exactly that command with the final paths;
* parsing of the layer information ``trtexec --profilingVerbosity=detailed --exportLayerInfo=F``
  writes: ``IEngineInspector::getEngineInformation(kJSON)`` (``sampleReporting.cpp``,
  ``printLayerInfo``). The 10.x documents below follow the output shown in NVIDIA/TensorRT#4020
  (``{"Layers": [{Name, LayerType, Inputs/Outputs [{Name, Location, Dimensions,
  "Format/Datatype"}], ParameterType, Origin, TacticValue|TacticName, StreamId, Metadata}],
  "Bindings": [...]}``); the 11.x one follows TensorRT's "Migrating IEngineInspector Usage from
  10.x to 11.x" (``"I/O Tensors"`` objects, split data type and format). FP8 tactic names follow
  cuBLASLt's ``sm90_xmma_gemm_e4m3bf16_e4m3f32_f32...`` (NVIDIA/TransformerEngine#1391). They are
  written by hand in those formats, not captured from a real engine;
* the subprocess plumbing, with a **fake** ``trtexec`` on PATH: a small script that records its
  argv, writes an engine-shaped file, a layer-info JSON and trtexec-style log lines. It is a test
  harness for our side of the pipe; it proves nothing about TensorRT itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from qdq_graphs import qdq_matmul_graph  # noqa: E402

from fp8export.engine.build import BuildEngineConfig, trtexec_command_for  # noqa: E402
from fp8export.engine.layers import attribute_gemms  # noqa: E402
from fp8export.engine.shapes import ShapeRange  # noqa: E402
from fp8export.engine.trtexec import parse_log, trtexec_command  # noqa: E402

HAS_TRT = importlib.util.find_spec("tensorrt") is not None
GEMM = "/fc/MatMul"  # the MatMul node of qdq_matmul_graph
FP8_TACTIC = "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1"
BF16_TACTIC = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1"


def layer_info_10x(tactic: str = FP8_TACTIC, gemm: str = GEMM) -> dict:
    """trtexec --exportLayerInfo output in the TensorRT 10.x layout (see module docstring)."""
    return {"Layers": [
        {"Name": "Reformatting CopyNode for Input Tensor 0 to x_q", "LayerType": "Reformat",
         "Inputs": [{"Name": "x", "Location": "Device", "Dimensions": [-1, 16],
                     "Format/Datatype": "Row major linear FP32"}],
         "Outputs": [{"Name": "x_fp8", "Location": "Device", "Dimensions": [-1, 16],
                      "Format/Datatype": "Row major linear FP8"}],
         "ParameterType": "Reformat", "Origin": "REFORMAT",
         "TacticValue": "0x00000000000003e8", "StreamId": 0, "Metadata": ""},
        {"Name": "__myl_MulGemm_myl0_1", "LayerType": "gemm",
         "Inputs": [{"Name": "x_fp8", "Location": "Device", "Dimensions": [-1, 16],
                     "Format/Datatype": "Row major linear FP8"},
                    {"Name": "w_fp8", "Location": "Device", "Dimensions": [16, 8],
                     "Format/Datatype": "Row major linear FP8"}],
         "Outputs": [{"Name": "y", "Location": "Device", "Dimensions": [-1, 8],
                      "Format/Datatype": "Row major linear FP32"}],
         "TacticName": tactic, "StreamId": 0,
         "Metadata": f"[ONNX Layer: {gemm}]\x1f[ONNX Layer: dq_w]"},
    ], "Bindings": ["x", "y"]}


def layer_info_11x(tactic: str = FP8_TACTIC) -> dict:
    """The same engine in the TensorRT 11.x layout."""
    return {"Layers": [
        {"Name": "__myl_MulGemm_myl0_1", "LayerType": "gemm",
         "Inputs": [{"Name": "x_fp8", "Dimensions": [-1, 16], "DataType": "FP8",
                     "Format": "Row major linear"}],
         "Outputs": [{"Name": "y", "Dimensions": [-1, 8], "DataType": "Float",
                      "Format": "Row major linear"}],
         "TacticName": tactic, "Metadata": f"[ONNX Layer: {GEMM}]"},
    ], "I/O Tensors": [
        {"Name": "x", "IOMode": "Input", "DataType": "Float", "Dimensions": [-1, 16]},
        {"Name": "y", "IOMode": "Output", "DataType": "Float", "Dimensions": [-1, 8]}]}


def test_command_line():
    profile = [ShapeRange("input_ids", (1, 1), (1, 128), (8, 512)),
               ShapeRange("past:0", (1, 1), (2, 2), (4, 4))]
    cmd = trtexec_command("trtexec", Path("m.onnx"), Path("m.engine"), Path("m.layers.json"),
                          profile, optimization_level=4, workspace_gib=1.5,
                          timing_cache=Path("tc.cache"))
    assert cmd == [
        "trtexec", "--onnx=m.onnx", "--saveEngine=m.engine", "--stronglyTyped",
        "--minShapes=input_ids:1x1,'past:0':1x1",
        "--optShapes=input_ids:1x128,'past:0':2x2",
        "--maxShapes=input_ids:8x512,'past:0':4x4",
        "--memPoolSize=workspace:1536", "--builderOptimizationLevel=4",
        "--timingCacheFile=tc.cache", "--profilingVerbosity=detailed",
        "--exportLayerInfo=m.layers.json", "--skipInference"]
    # strongly typed: precision comes from the graph, never from builder flags
    assert not {"--fp8", "--fp16", "--bf16", "--int8", "--best"} & set(cmd)
    static = trtexec_command("trtexec", Path("m.onnx"), Path("e"), Path("l"), [])
    assert not [a for a in static if "Shapes=" in a] and "--timingCacheFile" not in " ".join(static)


def test_print_command_builds_nothing(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no trtexec anywhere
    g = qdq_matmul_graph(tmp_path / "m.onnx")
    (tmp_path / "m.engine").write_bytes(b"old")  # printing needs no --force
    r = run_cli("build-engine", g, "--print-command", "--shapes", "x:1x16,4x16,8x16",
                "--timing-cache", tmp_path / "tc.cache", "--opt-level", "5")
    assert r.exit_code == 0, r.output
    line = r.stdout.strip().splitlines()[0]
    engine = tmp_path / "m.engine"
    assert shlex.split(line) == [
        "trtexec", f"--onnx={g}", f"--saveEngine={engine}", "--stronglyTyped",
        "--minShapes=x:1x16", "--optShapes=x:4x16", "--maxShapes=x:8x16",
        "--builderOptimizationLevel=5", f"--timingCacheFile={tmp_path / 'tc.cache'}",
        "--profilingVerbosity=detailed", f"--exportLayerInfo={engine}.layers.json",
        "--skipInference"]
    assert engine.read_bytes() == b"old" and not (tmp_path / "tc.cache").exists()
    # shapes default from the graph's dynamic batch axis
    default = trtexec_command_for(BuildEngineConfig(onnx=g))
    assert "--minShapes=x:1x16" in default and "--maxShapes=x:8x16" in default


def test_print_command_refuses_a_graph_that_breaks_the_rules(run_cli, tmp_path):
    import onnx

    g = qdq_matmul_graph(tmp_path / "m.onnx")
    m = onnx.load(str(g))
    for n in m.graph.node:
        if n.op_type == "QuantizeLinear":
            del n.input[2]  # no zero point: TensorRT would quantize to INT8
    onnx.save(m, str(g))
    r = run_cli("build-engine", g, "--print-command")
    assert r.exit_code == 1 and "zero-point" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("layout", [layer_info_10x, layer_info_11x])
def test_layer_info_formats(layout):
    rep = attribute_gemms(json.dumps(layout()), [GEMM])
    assert rep.schema == ("10.x" if layout is layer_info_10x else "11.x")
    assert rep.fp8_gemms == [GEMM] and not rep.fallback_gemms and not rep.unattributed
    slow = attribute_gemms(layout(BF16_TACTIC), [GEMM])
    if layout is layer_info_10x:  # FP8 inputs with a bf16 tactic: the input dtypes still say FP8
        assert slow.fp8_gemms == [GEMM]
    bf16 = layer_info_10x(BF16_TACTIC)
    for t in bf16["Layers"][1]["Inputs"]:
        t["Format/Datatype"] = "Row major linear BF16"
    rep = attribute_gemms(bf16, [GEMM])
    assert rep.fallback_gemms == [GEMM] and "fell back" in " ".join(rep.notes)


def test_log_parsing():
    text = ("&&&& RUNNING TensorRT.trtexec [TensorRT v100300] [b10] # trtexec --onnx=m.onnx\n"
            "[I] === Device Information ===\n[I] Selected Device: NVIDIA H100 80GB HBM3\n"
            "[I] Compute Capability: 9.0\n&&&& PASSED TensorRT.trtexec [TensorRT v100300]\n")
    log = parse_log(text)
    assert (log.tensorrt_version, log.gpu, log.compute_capability, log.passed) == \
        ("10.3.0", "NVIDIA H100 80GB HBM3", "9.0", True)
    assert parse_log("[TensorRT v110400]").tensorrt_version == "11.4.0"
    assert parse_log("[TensorRT v8601]").tensorrt_version == "8.6.1"
    assert parse_log("").tensorrt_version == "unknown"


# ------------------------------------------------------------------------------------------------
# subprocess plumbing, with a fake trtexec (a harness, not TensorRT)

FAKE_TRTEXEC = r'''#!{python}
"""FAKE trtexec for fp8export's tests: records argv, writes files in trtexec's formats."""
import json, os, sys
args = dict(a[2:].split("=", 1) if "=" in a else (a[2:], "") for a in sys.argv[1:])
with open(os.environ["FAKE_TRTEXEC_RECORD"], "w") as f:
    json.dump(sys.argv, f)
print("&&&& RUNNING TensorRT.trtexec [TensorRT v100300] [b10] # " + " ".join(sys.argv))
print("[I] === Device Information ===")
print("[I] Selected Device: FAKE GPU (fp8export test harness)")
print("[I] Compute Capability: 9.0")
if os.environ.get("FAKE_TRTEXEC_FAIL"):
    open(args["saveEngine"], "wb").write(b"partial")
    print("[E] Error[4]: fake failure for the test", file=sys.stderr)
    print("&&&& FAILED TensorRT.trtexec [TensorRT v100300]")
    sys.exit(1)
open(args["saveEngine"], "wb").write(b"FAKE-ENGINE")
if "timingCacheFile" in args:
    with open(args["timingCacheFile"], "ab") as f:
        f.write(b"+cache")
open(args["exportLayerInfo"], "w").write(os.environ["FAKE_TRTEXEC_LAYERS"])
print("&&&& PASSED TensorRT.trtexec [TensorRT v100300]")
'''


def _install(bin_dir: Path, name: str, text: str) -> Path:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture()
def fake_trtexec(tmp_path, monkeypatch):
    """A fake trtexec first on PATH (no nvidia-smi there); returns its argv record file."""
    bin_dir = tmp_path / "bin"
    _install(bin_dir, "trtexec", FAKE_TRTEXEC.replace("{python}", sys.executable))
    record = tmp_path / "argv.json"
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("FAKE_TRTEXEC_RECORD", str(record))
    monkeypatch.setenv("FAKE_TRTEXEC_LAYERS", json.dumps(layer_info_10x()))
    return record


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.skipif(HAS_TRT, reason="with the tensorrt package installed it is the default builder")
def test_builds_through_trtexec_when_tensorrt_is_missing(run_cli, tmp_path, fake_trtexec):
    g = qdq_matmul_graph(tmp_path / "m.onnx")
    cache = tmp_path / "tc.cache"
    cache.write_bytes(b"old")
    r = run_cli("build-engine", g, "--timing-cache", cache)
    assert r.exit_code == 0, r.output
    engine = tmp_path / "m.engine"
    assert engine.read_bytes() == b"FAKE-ENGINE" and cache.read_bytes() == b"old+cache"
    assert "via trtexec" in r.output and "FP8 GEMMs: 1" in r.output
    report = json.loads((tmp_path / "m.engine.build.json").read_text())
    assert report["builder"] == "trtexec" and report["tensorrt_version"] == "10.3.0"
    assert report["gpu"] == "FAKE GPU (fp8export test harness)"
    assert report["compute_capability"] == "9.0" and report["fp8_gemms"] == 1
    assert report["layers"]["schema"] == "10.x" and report["layers"]["fp8_gemms"] == [GEMM]
    assert report["profile"] == [{"name": "x", "min": [1, 16], "opt": [1, 16], "max": [8, 16]}]
    # trtexec ran on hidden temporary names; the report keeps the command with the final ones
    argv = json.loads(fake_trtexec.read_text())
    final = trtexec_command_for(BuildEngineConfig(onnx=g, timing_cache=cache, force=True))
    assert report["command"][1:] == final[1:]
    assert len(argv) == len(final) and argv[0].endswith("trtexec")
    for ran, printed in zip(argv[1:], final[1:]):
        if ran != printed:  # only the three output paths differ
            flag, path = ran.split("=", 1)
            assert flag in ("--saveEngine", "--exportLayerInfo", "--timingCacheFile")
            assert Path(path).name.startswith(".") and Path(path).parent == tmp_path
    assert json.loads((tmp_path / "m.engine.layers.json").read_text()) == layer_info_10x()
    log = (tmp_path / "m.engine.trtexec.log").read_text()
    assert log.startswith("$ ") and "&&&& PASSED" in log
    assert _hidden(tmp_path) == []


def test_explicit_trtexec_and_fallback_warning(run_cli, tmp_path, fake_trtexec, monkeypatch):
    bf16 = layer_info_10x(BF16_TACTIC)
    for t in bf16["Layers"][1]["Inputs"]:
        t["Format/Datatype"] = "Row major linear BF16"
    monkeypatch.setenv("FAKE_TRTEXEC_LAYERS", json.dumps(bf16))
    exe = tmp_path / "bin" / "trtexec"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    g = qdq_matmul_graph(tmp_path / "m.onnx")
    r = run_cli("build-engine", g, "--trtexec", exe, "-o", tmp_path / "out.plan")
    assert r.exit_code == 0, r.output
    assert "WARNING: 1 quantized GEMM(s) did NOT run in FP8" in r.output
    report = json.loads((tmp_path / "out.plan.build.json").read_text())
    assert report["fallback_gemms"] == [GEMM] and report["fp8_gemms"] == 0
    assert report["command"][0] == str(exe)


def test_trtexec_failure_keeps_old_outputs(run_cli, tmp_path, fake_trtexec, monkeypatch):
    monkeypatch.setenv("FAKE_TRTEXEC_FAIL", "1")
    g = qdq_matmul_graph(tmp_path / "m.onnx")
    (tmp_path / "m.engine").write_bytes(b"old engine")
    (tmp_path / "tc.cache").write_bytes(b"old cache")
    r = run_cli("build-engine", g, "--force", "--trtexec", tmp_path / "bin" / "trtexec",
                "--timing-cache", tmp_path / "tc.cache")
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "trtexec failed (exit 1)" in r.output and "m.engine.trtexec.log" in r.output
    assert "fake failure for the test" in r.output  # the log's tail is in the message
    assert (tmp_path / "m.engine").read_bytes() == b"old engine"
    assert (tmp_path / "tc.cache").read_bytes() == b"old cache"
    assert _hidden(tmp_path) == []


def test_bad_layer_info_is_a_note_not_a_crash(run_cli, tmp_path, fake_trtexec, monkeypatch):
    monkeypatch.setenv("FAKE_TRTEXEC_LAYERS", "{not json")
    g = qdq_matmul_graph(tmp_path / "m.onnx")
    r = run_cli("build-engine", g, "--trtexec", tmp_path / "bin" / "trtexec")
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "m.engine.build.json").read_text())
    assert report["unattributed_gemms"] == [GEMM] and report["fp8_gemms"] == 0
    assert any("not inspector JSON" in n for n in report["notes"])


def test_gpu_below_fp8_is_refused_before_building(run_cli, tmp_path, fake_trtexec):
    _install(tmp_path / "bin", "nvidia-smi",
             "#!/bin/sh\necho 'NVIDIA A100-SXM4-80GB, 8.0'\n")  # fake, like the fake trtexec
    g = qdq_matmul_graph(tmp_path / "m.onnx")
    r = run_cli("build-engine", g, "--trtexec", tmp_path / "bin" / "trtexec")
    assert r.exit_code == 1 and "8.0" in r.output and ">= 8.9" in r.output
    assert not fake_trtexec.exists() and not (tmp_path / "m.engine").exists()


def test_bad_trtexec_path(run_cli, tmp_path):
    g = qdq_matmul_graph(tmp_path / "m.onnx")
    r = run_cli("build-engine", g, "--trtexec", tmp_path / "nope")
    assert r.exit_code == 1 and "--trtexec" in r.output and "Traceback" not in r.output
    assert os.listdir(tmp_path) == ["m.onnx"]
