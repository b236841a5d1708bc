"""End to end: the Keras float8 sample converts with --scales history.

Expected values are computed here independently of the reader: the float8 layers' histories are
read straight from the archive with zipfile + h5py (a float8 layer is a ``vars`` group whose
last six datasets are scalar/1-D pairs), and the activation scale is max(history)/448.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from safetensors import safe_open

from fp8export.api import convert
from fp8export.convert.config import ConvertConfig

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "keras-float8" / "model"


def _raw_float8_layers(keras_path: Path) -> dict[str, dict]:
    """Module name → input history and kernel, read without fp8export."""
    with zipfile.ZipFile(keras_path) as zf:
        h5 = h5py.File(io.BytesIO(zf.read("model.weights.h5")), "r")
    found: dict[str, dict] = {}

    def visit(group: h5py.Group, chain: list[str]) -> None:
        for key, child in group.items():
            if key in ("optimizer", "vars") or not isinstance(child, h5py.Group):
                continue
            names = chain
            if "vars" in child:
                names = chain + [str(child["vars"].attrs["name"])]
                ds = [child["vars"][str(i)] for i in range(len(child["vars"]))]
                if len(ds) in (7, 8) and ds[-6].shape == () and len(ds[-5].shape) == 1:
                    found[".".join(names)] = {"inputs_amax_history": ds[-5][()],
                                              "kernel": ds[0][()]}
            visit(child, names)

    visit(h5, [])
    h5.close()
    return found


@pytest.mark.parametrize("source", ["float8_model.keras", "float8_model.weights.h5"])
def test_convert_sample_with_history_scales(tmp_path, source):
    expected = _raw_float8_layers(SAMPLE / "float8_model.keras")
    assert len(expected) == 8  # 4 attention projections, 2 feed-forward, 2 head Dense layers
    out = tmp_path / "fp8"
    convert(ConvertConfig(checkpoint=SAMPLE / source, output=out, scales="history"))
    manifest = json.loads((out / "fp8export.json").read_text())
    assert set(manifest["quantized"]) == set(expected)
    assert manifest["activation_scheme"] == "static"
    tensors = {}
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            tensors.update({k: st.get_tensor(k) for k in st.keys()})
    for module, raw in expected.items():
        entry = manifest["quantized"][module]
        hist = raw["inputs_amax_history"]
        want = np.float32(hist[np.isfinite(hist) & (hist > 0)].max() / 448.0)
        assert entry["input_scale_source"] == "history", module
        assert tensors[f"{module}.input_scale"].item() == pytest.approx(float(want), rel=1e-6)
        assert entry["input_scale"] == pytest.approx(float(want), rel=1e-6)
        w = tensors[f"{module}.weight"]
        assert str(w.dtype) == "torch.float8_e4m3fn" and w.dim() == 2
        kernel2d = raw["kernel"].reshape(w.shape) if entry["layout"] == "in_out" else None
        assert kernel2d is not None, f"{module}: Keras kernels are [in, out]"
        deq = w.float().numpy() * tensors[f"{module}.weight_scale"].item()
        # E4M3 keeps 3 mantissa bits: every dequantized value is within 1/16 of the original
        np.testing.assert_allclose(deq, kernel2d, rtol=1 / 16 + 1e-6,
                                   atol=tensors[f"{module}.weight_scale"].item())
