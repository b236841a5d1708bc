"""safetensors dtype spellings, shared by the reader and the writer."""

from __future__ import annotations

import torch

TORCH_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
ST_TO_TORCH = {v: k for k, v in TORCH_TO_ST.items()}
ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
            "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8}
