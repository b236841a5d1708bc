"""convert refuses up front what an FP8 folder cannot hold, and validates what it wrote with the
FP8-folder reader before it reports success (fp8export/convert/checks.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corrupt"))
from corpus_files import hf_folder, llama_tensors  # noqa: E402

from fp8export.convert.config import ConvertConfig  # noqa: E402
from fp8export.errors import Fp8ExportError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
O_PROJ = "model.layers.0.self_attn.o_proj"


def _scaled(path: Path, factor: float) -> Path:
    t = llama_tensors()
    t[f"{O_PROJ}.weight"] = (t[f"{O_PROJ}.weight"].float() * factor).to(torch.bfloat16)
    return hf_folder(path, t)


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_a_folder_the_reader_refuses_is_never_published(tmp_path, monkeypatch, granularity):
    """With the up-front check taken away, the reader's validation of the written folder still
    stops it: convert fails, nothing is left."""
    from fp8export.convert import pipeline

    monkeypatch.setattr(pipeline, "check_scale_range", lambda *a: None)
    out = tmp_path / "out" / "fp8"
    with pytest.raises(Fp8ExportError, match="the FP8-folder reader refuses") as err:
        pipeline.convert(ConvertConfig(_scaled(tmp_path / "src", 1e-20), output=out,
                                       weight_granularity=granularity))
    assert f"{O_PROJ}.weight_scale" in str(err.value) and ".tmp-" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_the_default_path_validates_without_torch(tmp_path):
    """The torch-free default path applies the reader's checks too (a real process: torch is
    not imported there)."""
    src = _scaled(tmp_path / "src", 1e20)
    code = ("import sys; import fp8export.convert.checks as c\n"
            "c.check_scale_range = lambda *a: None\n"
            "from fp8export.cli import main\n"
            "code = main(sys.argv[1:])\n"
            "print('TORCH', 'torch' in sys.modules)\n"
            "sys.exit(code)")
    r = subprocess.run([sys.executable, "-c", code, "convert", str(src), "-o",
                        str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "TORCH False" in r.stdout
    assert "the FP8-folder reader refuses" in r.stderr and "outside 1e-12" in r.stderr
    assert not (tmp_path / "out").exists()


def test_scales_beyond_a_folder_are_refused_before_writing(tmp_path):
    from fp8export.convert.pipeline import convert

    with pytest.raises(Fp8ExportError, match=rf"1 weight scale\(s\) lie outside.*{O_PROJ}"):
        convert(ConvertConfig(_scaled(tmp_path / "src", 1e-20), output=tmp_path / "out"))
    assert not (tmp_path / "out").exists()
