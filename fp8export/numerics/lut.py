"""E4M3 quantization of bf16 / fp16 weights as a table lookup, and its exact SQNR.

A 16-bit tensor holds at most 65,536 distinct values, so for one scale the E4M3 byte of every
bit pattern is computed once (:func:`e4m3_table`, by the arithmetic of
:func:`fp8export.numerics.fp8.quantize_e4m3`: ``x / scale`` in float32, clamp to ±448, cast
with round to nearest even; NaN, -0, subnormals and saturation included) and applied as a
gather. The same pass counts each bit pattern; the SQNR then follows from the counts and the
table's per-value error (:func:`sqnr_from_histogram`) without a second pass over the floats.

The gather + count loop is ``_fp8lut.c`` (an optional extension, loaded with ctypes, which
releases the GIL); without it (no compiler at install, or ``FP8EXPORT_NO_C=1``) numpy gives
the same bytes and counts, slower. No torch here: the default convert path runs without it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os

import ml_dtypes
import numpy as np

from fp8export.numerics.metrics import sqnr_from_sums

E4M3_MAX = 448.0
BINS = 1 << 16
LUT_DTYPES = ("BF16", "F16")  # safetensors dtypes this module quantizes


@functools.lru_cache(maxsize=2)
def source_values(dtype: str) -> np.ndarray:
    """The float32 value of each of the 65,536 bit patterns of ``dtype`` (index = pattern)."""
    bits = np.arange(BINS, dtype=np.uint32)
    if dtype == "BF16":
        values = (bits << 16).view(np.float32)
    elif dtype == "F16":
        values = bits.astype(np.uint16).view(np.float16).astype(np.float32)
    else:
        raise ValueError(f"no lookup table for {dtype}")
    values.setflags(write=False)
    return values


def quantize_values(x: np.ndarray, scale: float | np.floating) -> np.ndarray:
    """E4M3 bytes (uint8) of float32 ``x`` with dequantization factor ``scale``: the reference
    arithmetic, elementwise (also the read-back's independent check)."""
    with np.errstate(all="ignore"):  # x/scale may overflow to inf: the clamp then saturates
        y = np.asarray(x, dtype=np.float32) / np.float32(scale)
    np.clip(y, -E4M3_MAX, E4M3_MAX, out=y)  # NaN stays NaN, as torch's clamp keeps it
    return y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_table(scale: float | np.floating, dtype: str) -> np.ndarray:
    """The E4M3 byte of every ``dtype`` bit pattern for ``scale`` (uint8, 65,536 entries)."""
    return np.ascontiguousarray(quantize_values(source_values(dtype), scale))


def sqnr_from_histogram(hist: np.ndarray, table: np.ndarray, scale: float | np.floating,
                        dtype: str) -> float:
    """SQNR (dB) of a tensor quantized through ``table`` from the count of each bit pattern.

    Each value's error is computed as the float32 round trip gives it (``q * scale - x``, in
    float32, the way :func:`fp8export.scales.weights.quantize_weight_sqnr` forms it); squares
    and sums are taken in float64, each distinct value once, weighted by its count.
    """
    used = np.flatnonzero(hist)
    x = source_values(dtype)[used]
    q = table[used].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    with np.errstate(all="ignore"):
        err = (q * np.float32(scale) - x).astype(np.float64)
    counts = hist[used].astype(np.float64)
    x64 = x.astype(np.float64)
    return sqnr_from_sums(float(np.sum(counts * x64 * x64)), float(np.sum(counts * err * err)))


def _load_helper():
    if os.environ.get("FP8EXPORT_NO_C"):
        return None
    try:
        spec = importlib.util.find_spec("fp8export.numerics._fp8lut")
        if spec is None or not spec.origin or not os.path.isfile(spec.origin):
            return None
        lib = ctypes.CDLL(spec.origin)  # CDLL (not PyDLL): the GIL is released during calls
    except (ImportError, OSError):
        return None
    ptr, size = ctypes.c_void_p, ctypes.c_size_t
    lib.fp8lut_quantize.argtypes = [ptr, size, ptr, ptr, ptr]
    lib.fp8lut_quantize.restype = None
    lib.fp8lut_histogram.argtypes = [ptr, size, ptr]
    lib.fp8lut_histogram.restype = None
    return lib


_HELPER = _load_helper()


def compiled() -> bool:
    """Whether the C gather is in use (else the numpy fallback)."""
    return _HELPER is not None


def new_histogram() -> np.ndarray:
    return np.zeros(BINS, dtype=np.uint64)


def quantize_into(src: np.ndarray, table: np.ndarray, out: np.ndarray, hist: np.ndarray,
                  *, use_c: bool | None = None) -> None:
    """``out[i] = table[src[i]]`` and ``hist[src[i]] += 1`` for uint16 ``src`` (contiguous);
    ``out`` uint8 of the same length, ``hist`` uint64 of 65,536 counters."""
    n = src.size
    if src.dtype != np.uint16 or out.dtype != np.uint8 or out.size != n:
        raise ValueError("quantize_into: uint16 source and uint8 output of one length")
    if table.dtype != np.uint8 or table.size != BINS or hist.dtype != np.uint64 \
            or hist.size != BINS:
        raise ValueError("quantize_into: a 65,536-entry uint8 table and uint64 histogram")
    for a in (src, out, table, hist):
        if not a.flags.c_contiguous:
            raise ValueError("quantize_into: contiguous arrays only")
    if _HELPER is not None and use_c is not False:
        _HELPER.fp8lut_quantize(src.ctypes.data, n, table.ctypes.data, out.ctypes.data,
                                hist.ctypes.data)
        return
    np.take(table, src, out=out)
    hist += np.bincount(src, minlength=BINS).astype(np.uint64)
