"""scripts/trt-container.sh: the docker command it runs, checked with a FAKE docker.

The recipe was not executed here (no Docker, no TensorRT, no FP8 GPU). The fake ``docker`` only
records its argv; the test checks the mounts (read-only except the output folder), the image,
and that every ``fp8export`` command the container would run parses with this CLI's options.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "trt-container.sh"


@pytest.fixture()
def inputs(tmp_path):
    (tmp_path / "exp").mkdir()
    onnx = tmp_path / "exp" / "tiny-fp8.onnx"
    onnx.write_bytes(b"graph")
    ref = tmp_path / "ref"
    ref.mkdir()
    data = tmp_path / "data" / "eval.txt"
    data.parent.mkdir()
    data.write_text("once upon a time\n")
    fake = tmp_path / "docker"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "json.dump(sys.argv[1:], open(os.environ['FAKE_DOCKER_RECORD'], 'w'))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return onnx, ref, data, fake


def _run(args, fake, tmp_path, **env):
    record = tmp_path / "docker-argv.json"
    record.unlink(missing_ok=True)
    e = {**os.environ, "DOCKER": str(fake), "FAKE_DOCKER_RECORD": str(record), **env}
    r = subprocess.run(["bash", str(SCRIPT), *map(str, args)], cwd=tmp_path, env=e,
                       capture_output=True, text=True, timeout=60)
    return r, (json.loads(record.read_text()) if record.exists() else None)


def _parse_fp8export(line: str):
    """Parse one ``fp8export CMD ...`` line with the real CLI (options and types, no run)."""
    from fp8export.cli import cli

    name, *rest = shlex.split(line)[1:]
    ctx = cli.make_context("fp8export", [name], resilient_parsing=True)
    cmd = cli.get_command(ctx, name)
    return cmd.make_context(name, rest).params


def test_docker_command(inputs, tmp_path):
    onnx, ref, data, fake = inputs
    r, argv = _run([onnx, ref, data, tmp_path / "out"], fake, tmp_path,
                   BUILD_ARGS="--shapes input_ids:1x1,4x128,8x512")
    assert r.returncode == 0, r.stderr
    assert argv[:3] == ["run", "--rm", "--gpus"] and "all" in argv
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert mounts == [f"{REPO}:/src:ro", f"{onnx.parent}:/in:ro", f"{ref}:/ref:ro",
                      f"{data.parent}:/data:ro", f"{tmp_path / 'out'}:/out"]
    image, shell, flags, inner = argv[-4:]
    assert image == "nvcr.io/nvidia/tensorrt:25.11-py3" and (shell, flags) == ("bash", "-euc")
    lines = [ln for ln in inner.splitlines() if ln.startswith("fp8export ")]
    assert len(lines) == 2
    build, verify = (_parse_fp8export(ln) for ln in lines)
    assert str(build["model"]) == "/in/tiny-fp8.onnx"
    assert str(build["output"]) == "/out/tiny-fp8.engine"
    assert build["force"] and str(build["timing_cache"]) == "/out/timing.cache"
    assert build["shapes"] == ("input_ids:1x1,4x128,8x512",)
    assert verify["reference"] == "/ref" and verify["candidate"] == "/out/tiny-fp8.engine"
    assert verify["data"] == "/data/eval.txt" and verify["report_dir"] == "/out/report"
    assert "pip install" in inner and "--exclude=./.venv" in inner


def test_image_override_and_bad_arguments(inputs, tmp_path):
    onnx, ref, data, fake = inputs
    r, argv = _run([onnx, ref, data], fake, tmp_path, TRT_IMAGE="nvcr.io/nvidia/tensorrt:X-py3")
    assert r.returncode == 0 and argv[-4] == "nvcr.io/nvidia/tensorrt:X-py3"
    assert (tmp_path / "trt-out").is_dir()  # default output folder
    r, argv = _run([onnx, ref], fake, tmp_path)
    assert r.returncode == 2 and "MODEL.onnx REFERENCE_DIR DATA_FILE" in r.stderr and argv is None
    r, argv = _run([onnx, tmp_path / "nope", data], fake, tmp_path)
    assert r.returncode == 1 and "nope" in r.stderr and argv is None
