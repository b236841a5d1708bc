"""fp8dir/formats.py: the dtype engines hold a dialect's scales in, and scales rounded to it."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from fp8export.config import OutputFormat
from fp8export.fp8dir.formats import as_loaded, loaded_scale_dtype


def test_only_compressed_tensors_scales_are_held_in_the_model_dtype():
    bf16, f16, f32 = ({"dtype": d} for d in ("bfloat16", "float16", "float32"))
    ct = OutputFormat.COMPRESSED_TENSORS
    assert loaded_scale_dtype(ct, bf16) == "BF16" and loaded_scale_dtype(ct, f16) == "F16"
    assert loaded_scale_dtype(ct, {"torch_dtype": "bfloat16"}) == "BF16"  # transformers 4 key
    assert loaded_scale_dtype(ct, f32) is None and loaded_scale_dtype(ct, None) is None
    assert loaded_scale_dtype(ct, bf16, keras=True) is None
    assert loaded_scale_dtype(OutputFormat.VLLM, bf16) is None
    assert loaded_scale_dtype(OutputFormat.MODELOPT, bf16) is None


def test_scales_round_to_the_nearest_value_of_that_dtype_and_stay_float32():
    scales = {"a": np.float32(1 / 448), "b": np.array([3e-4, 7.1e-5], dtype=np.float32),
              "grid": np.full((2, 3), 0.00016566685, dtype=np.float32)}
    out = as_loaded(scales, "BF16")
    assert isinstance(out["a"], np.float32) and out["a"] == np.float32(ml_dtypes.bfloat16(1 / 448))
    assert out["b"].dtype == np.float32 and out["grid"].shape == (2, 3)
    for k in scales:  # exact in BF16, within its rounding of the input
        v = np.asarray(out[k])
        assert np.array_equal(v, v.astype(ml_dtypes.bfloat16).astype(np.float32))
        assert np.all(np.abs(v / scales[k] - 1) <= 2 ** -8)
    assert float(out["grid"][0, 0]) == 0.0001659393310546875  # what transformers held (measured)
    assert as_loaded(scales, None) is scales
    # F16: a value that would flush to zero or overflow keeps its float32 value
    tiny = as_loaded({"t": np.float32(1e-9), "h": np.float32(1e6)}, "F16")
    assert tiny["t"] == np.float32(1e-9) and tiny["h"] == np.float32(1e6)
