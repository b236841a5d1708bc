"""The string enums several stages share, and what their configs build on.

Each verb's frozen config lives with its stage (``convert/config.py``, ``calibration/
config.py``, ``onnx/export.py``, ``engine/build.py``, ``verify/config.py``); the CLI builds one
from its options and hands it to one function in ``fp8export.api``; library users build them
directly. Enums here are the ones more than one stage reads (the scale source, the output
format, the calibration method and amax algorithm, the device).
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from fp8export.errors import UsageError


class StrEnum(str, Enum):
    """An enum whose values are the strings users type."""

    def __str__(self) -> str:  # click and JSON show the value
        return self.value

    @classmethod
    def parse(cls, value: str | StrEnum, option: str):
        """Look up ``value`` (case-insensitive, ``_`` = ``-``) or list the valid names."""
        if isinstance(value, cls):
            return value
        key = str(value).strip().lower().replace("_", "-")
        for member in cls:
            if member.value == key:
                return member
        valid = ", ".join(m.value for m in cls)
        raise UsageError(f"{option}: unknown value {value!r}; valid values are: {valid}.")


class ReadBack(StrEnum):
    """How much of the written shards convert reads back before publishing them
    (``convert --read-back``)."""

    SAMPLED = "sampled"  # 3 x 4 KiB of every tensor, compared with the source re-quantized
    FULL = "full"  # every byte; each file's sha256 must equal the one taken while writing


def sibling_output(source: Path, tail: str) -> Path:
    """Default output beside ``source``: ``<name><tail>`` (folder) or ``<stem><tail>`` (file)."""
    stem = source.name if source.is_dir() else source.stem
    return source.parent / f"{stem}{tail}"


class ScaleSource(StrEnum):
    """Where one recorded scale came from (the manifest's ``scale source``)."""

    HISTORY = "history"
    CALIBRATION = "calibration"
    WEIGHTS = "weights"


class OutputFormat(StrEnum):
    """On-disk dialect of the FP8 folder's config (``convert --format``)."""

    COMPRESSED_TENSORS = "compressed-tensors"
    VLLM = "vllm"
    MODELOPT = "modelopt"


class CalibMethod(StrEnum):
    """Calibrator used to turn observed activations into an amax."""

    MAX = "max"
    PERCENTILE = "percentile"
    MSE = "mse"
    ENTROPY = "entropy"


class AmaxAlgo(StrEnum):
    """How an amax history becomes one amax (``--amax-algo``)."""

    MAX = "max"
    MOST_RECENT = "most-recent"
    STORED = "stored"  # the framework's stored scale: what its own FP8 inference uses


class Device(StrEnum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class Offload(StrEnum):
    """``--offload``: how a model larger than the device runs (``fp8export.streaming.plan``)."""

    AUTO = "auto"  # whole when it fits, spread over a host's GPUs, else one layer at a time
    NONE = "none"  # never stream: the whole model (or accelerate's spread)
    LAYERS = "layers"  # always stream one decoder layer (block) at a time
