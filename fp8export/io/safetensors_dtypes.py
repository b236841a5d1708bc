"""safetensors dtype spellings, shared by the reader and the writer."""

from __future__ import annotations

import functools

_TORCH_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0",
    "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "uint16": "U16",
    "uint32": "U32", "uint64": "U64",
}


@functools.cache
def _maps() -> tuple[dict, dict]:
    import torch

    to_st = {getattr(torch, n): st for n, st in _TORCH_NAMES.items() if hasattr(torch, n)}
    return to_st, {v: k for k, v in to_st.items()}


def __getattr__(name: str):
    # TORCH_TO_ST / ST_TO_TORCH hold torch dtypes: built on first use, so the readers and
    # writers that only need ST_BYTES (convert's default path) never import torch.
    if name == "TORCH_TO_ST":
        return _maps()[0]
    if name == "ST_TO_TORCH":
        return _maps()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
            "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4,
            "U64": 8}
