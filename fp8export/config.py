"""Frozen configs and string enums shared across commands.

The CLI builds one of these from its options and hands it to one function in
``fp8export.api``; library users build them directly. Every default is ``None`` or the
documented default, validation happens in ``__post_init__`` and raises UsageError (an
Fp8ExportError that the CLI reports with exit code 2).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
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


def sibling_output(source: Path, tail: str) -> Path:
    """Default output beside ``source``: ``<name><tail>`` (folder) or ``<stem><tail>`` (file)."""
    stem = source.name if source.is_dir() else source.stem
    return source.parent / f"{stem}{tail}"


class ScalesMode(StrEnum):
    """Where activation scales come from (``convert --scales``)."""

    AUTO = "auto"  # history if the checkpoint has it, else calibrate if data given, else weights
    HISTORY = "history"
    CALIBRATE = "calibrate"
    WEIGHTS = "weights"  # weight scales only; activations dynamic


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


class WeightGranularity(StrEnum):
    """One weight scale per tensor, or one per output channel (``convert --weight-granularity``)."""

    TENSOR = "tensor"
    CHANNEL = "channel"


class DynamicActivations(StrEnum):
    """How layers without a static input scale scale their input at run time
    (``convert --dynamic-activations``): one amax per tensor, or one per token (row). Per
    token is the default: what vLLM runs for dynamic inputs (compressed-tensors always; its
    native fp8 dialect on GPUs with CUTLASS FP8)."""

    TENSOR = "tensor"
    TOKEN = "token"


class WeightRounding(StrEnum):
    """How weights reach the E4M3 grid of their scale (``convert --weight-rounding``): each to
    its nearest value, or GPTQ (codes chosen for the layer's output on ``--calib-data``)."""

    NEAREST = "nearest"
    GPTQ = "gptq"


class KvCache(StrEnum):
    """KV-cache precision the folder declares (``convert --kv-cache``)."""

    NONE = "none"
    FP8 = "fp8"  # per-attention-layer k_scale / v_scale, calibrated


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


@dataclass(frozen=True)
class ConvertConfig:
    """Options of ``fp8export convert`` (see DESIGN.md, CLI contract)."""

    checkpoint: Path
    output: Path | None = None  # default: sibling "<checkpoint>-fp8"
    scales: ScalesMode = ScalesMode.AUTO
    calib_data: Path | None = None
    calib_amax: Path | None = None  # amax.json written by `fp8export calibrate`
    calib_method: CalibMethod = CalibMethod.MAX
    calib_samples: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    percentile: float | None = None
    amax_algo: AmaxAlgo = AmaxAlgo.MAX
    margin: int = 0  # extra power-of-two headroom: amax * 2**margin
    weight_scales_from_history: bool = False
    format: OutputFormat = OutputFormat.COMPRESSED_TENSORS
    exclude: tuple[str, ...] = ()
    include: tuple[str, ...] = ()
    fuse_scales: bool = True
    weight_granularity: WeightGranularity = WeightGranularity.TENSOR
    dynamic_activations: DynamicActivations = DynamicActivations.TOKEN
    weight_rounding: WeightRounding = WeightRounding.NEAREST
    kv_cache: KvCache = KvCache.NONE
    device: Device = Device.AUTO
    force: bool = False
    accuracy_budget: float | None = None  # KL budget: keep linears in bf16 (verify/fallback.py)
    workers: int | None = None  # threads converting at once; None: every core
    accuracy_samples: int | None = None  # samples the budget is measured on (default 32)
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "checkpoint", Path(self.checkpoint))
        if self.output is not None:
            object.__setattr__(self, "output", Path(self.output))
        for name, enum in (("scales", ScalesMode), ("calib_method", CalibMethod),
                           ("amax_algo", AmaxAlgo), ("format", OutputFormat), ("device", Device),
                           ("weight_granularity", WeightGranularity),
                           ("dynamic_activations", DynamicActivations),
                           ("weight_rounding", WeightRounding), ("kv_cache", KvCache)):
            option = f"--{name.replace('_', '-')}"
            object.__setattr__(self, name, enum.parse(getattr(self, name), option))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        object.__setattr__(self, "include", tuple(self.include))
        no_calib_source = self.calib_data is None and self.calib_amax is None
        if self.scales is ScalesMode.CALIBRATE and no_calib_source:
            raise UsageError(
                "--scales calibrate needs --calib-data PATH (or --calib-amax amax.json from "
                "`fp8export calibrate`)."
            )
        if self.weight_rounding is WeightRounding.GPTQ and self.calib_data is None:
            raise UsageError("--weight-rounding gptq rounds each weight for its layer's output "
                             "on sample inputs: give --calib-data PATH.")
        if self.kv_cache is KvCache.FP8 and self.calib_data is None:
            raise UsageError("--kv-cache fp8 calibrates the keys and values: give --calib-data "
                             "PATH.")
        if self.margin < 0:
            raise UsageError(f"--margin must be >= 0, got {self.margin}.")
        if self.accuracy_budget is not None and not self.accuracy_budget > 0:
            raise UsageError(f"--accuracy-budget must be a KL > 0 (nats per token), got "
                             f"{self.accuracy_budget}.")
        if self.workers is not None and self.workers < 1:
            raise UsageError(f"--workers must be >= 1, got {self.workers}.")
        self._check_combinations()

    def _check_combinations(self) -> None:
        """Options that cannot work together: a usage error before any file is read."""
        channel = self.weight_granularity is WeightGranularity.CHANNEL
        if channel and self.format is not OutputFormat.COMPRESSED_TENSORS:
            why = ("its quant_method fp8 loader reads one weight scale per shard or a block grid"
                   if self.format is OutputFormat.VLLM else
                   "ModelOpt's quant_algo FP8 is per-tensor (0-dim scales)")
            raise UsageError(f"--format {self.format} cannot hold per-channel weight scales "
                             f"({why}). Use --format compressed-tensors (strategy: channel) or "
                             "--weight-granularity tensor.")
        if channel and self.weight_scales_from_history:
            raise UsageError("--weight-scales-from-history gives one scale per tensor (training "
                             "histories are per tensor); use it with --weight-granularity tensor.")
        if self.format is OutputFormat.MODELOPT and self.scales is ScalesMode.WEIGHTS:
            raise UsageError("--format modelopt needs a static input scale for every layer "
                             "(ModelOpt FP8 is static-only), but --scales weights gives none. "
                             "Use --scales auto/calibrate with --calib-data PATH, or --format "
                             "compressed-tensors.")
        if self.scales is ScalesMode.WEIGHTS and self.calib_amax is not None:
            raise UsageError("--scales weights takes no activation ranges, so --calib-amax would "
                             "be ignored. Drop one of them.")
        if self.scales is ScalesMode.WEIGHTS and self.calib_data is not None \
                and self.kv_cache is not KvCache.FP8 and self.accuracy_budget is None \
                and self.weight_rounding is WeightRounding.NEAREST:
            raise UsageError("--scales weights calibrates nothing, so --calib-data would be "
                             "ignored. Drop --calib-data, or use --scales calibrate.")
        if self.percentile is not None:
            if not 0.0 < float(self.percentile) <= 100.0:
                raise UsageError(f"--percentile must be in (0, 100], got {self.percentile}.")
            if self.calib_method is not CalibMethod.PERCENTILE:
                raise UsageError(f"--percentile applies to --calib-method percentile, not "
                                 f"{self.calib_method}. Drop --percentile or choose percentile.")
        if self.accuracy_samples is not None and self.accuracy_budget is None:
            raise UsageError("--accuracy-samples sets how many samples --accuracy-budget "
                             "measures on; give --accuracy-budget KL too, or drop it.")

    @property
    def resolved_output(self) -> Path:
        return self.output if self.output is not None else sibling_output(self.checkpoint, "-fp8")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra", None)
        return {k: (str(v) if isinstance(v, (Path, Enum)) else v) for k, v in d.items()}
