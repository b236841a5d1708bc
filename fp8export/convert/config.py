"""``ConvertConfig``: the options of ``fp8export convert``, and the enums only convert reads.

Built by the CLI from its options (or directly by library users) and handed to
``fp8export.api.convert``. Every default is ``None`` or the documented default; validation
happens in ``__post_init__`` and raises UsageError (an Fp8ExportError that the CLI reports with
exit code 2). The enums several stages share are in ``fp8export/config.py``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from fp8export.config import (
    AmaxAlgo,
    CalibMethod,
    Device,
    Offload,
    OutputFormat,
    ReadBack,
    StrEnum,
    sibling_output,
)
from fp8export.errors import UsageError
from fp8export.placement import parse_max_memory

DEFAULT_BLOCK = (128, 128)
"""Block size (rows of the output dimension x columns of the input dimension) of
``--weight-granularity block``: DeepSeek-V3's, Qwen3-FP8's and compressed-tensors' FP8_BLOCK."""


def parse_block_size(value: str | int | tuple | list | None) -> tuple[int, int] | None:
    """``"128"``, ``"128x128"``, ``"128,64"``, ``128`` or ``(128, 64)`` → ``(bn, bk)``; None stays
    None. Raises ValueError for anything else (sizes must be positive integers)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        parts = [value, value]
    elif isinstance(value, (tuple, list)):
        parts = list(value)
    else:
        text = str(value).strip().lower().replace("x", ",").replace("*", ",")
        parts = [p.strip() for p in text.split(",")]
        if len(parts) == 1:
            parts = parts * 2
        try:
            parts = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"block size {value!r} is not N or NxK") from None
    if len(parts) != 2 or not all(isinstance(p, int) and not isinstance(p, bool) and p > 0
                                  for p in parts):
        raise ValueError(f"block size {value!r} is not two positive integers")
    return int(parts[0]), int(parts[1])


class ScalesMode(StrEnum):
    """Where activation scales come from (``convert --scales``)."""

    AUTO = "auto"  # history if the checkpoint has it, else calibrate if data given, else weights
    HISTORY = "history"
    CALIBRATE = "calibrate"
    WEIGHTS = "weights"  # weight scales only; activations dynamic


class WeightGranularity(StrEnum):
    """One weight scale per tensor, per output channel, or per ``bn x bk`` block
    (``convert --weight-granularity``)."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    BLOCK = "block"  # DeepSeek-V3 / Qwen3-FP8 / compressed-tensors FP8_BLOCK, 128x128 default


class DynamicActivations(StrEnum):
    """How layers without a static input scale scale their input at run time
    (``convert --dynamic-activations``): one amax per tensor, one per token (row), or one per
    token and group of ``block_size[1]`` input elements (block-scaled weights only). Per token
    is the default for tensor and channel weights: what vLLM runs for dynamic inputs
    (compressed-tensors always; its native fp8 dialect on GPUs with CUTLASS FP8); per group for
    block weights, their only scheme."""

    TENSOR = "tensor"
    TOKEN = "token"
    GROUP = "group"


class WeightRounding(StrEnum):
    """How weights reach the E4M3 grid of their scale (``convert --weight-rounding``): each to
    its nearest value, or GPTQ (codes chosen for the layer's output on ``--calib-data``)."""

    NEAREST = "nearest"
    GPTQ = "gptq"  # every layer's inputs from the bf16 model (one pass, parallel Hessians)
    # each layer's inputs from the layers before it as they will be written (llm-compressor's
    # sequential pipeline): quantization error propagates into the later layers' Hessians
    GPTQ_SEQUENTIAL = "gptq-sequential"


class ScaleFormat(StrEnum):
    """How block weight scales are stored (``convert --scale-format``): float32, or UE8M0
    (powers of two, one byte: F8_E8M0, what transformers writes with ``scale_fmt="ue8m0"`` and
    recent DeepSeek releases ship)."""

    FLOAT = "float"
    UE8M0 = "ue8m0"


class KvCache(StrEnum):
    """KV-cache precision the folder declares (``convert --kv-cache``)."""

    NONE = "none"
    FP8 = "fp8"  # per-attention-layer k_scale / v_scale, calibrated


# The options whose values are enum names: what a recipe file's values are checked against.
OPTION_ENUMS: dict[str, type[StrEnum]] = {
    "scales": ScalesMode, "calib_method": CalibMethod, "amax_algo": AmaxAlgo,
    "format": OutputFormat, "device": Device, "weight_granularity": WeightGranularity,
    "dynamic_activations": DynamicActivations, "weight_rounding": WeightRounding,
    "kv_cache": KvCache, "scale_format": ScaleFormat, "offload": Offload,
}


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
    # None: token, or group for block weights (resolved in __post_init__)
    dynamic_activations: DynamicActivations | None = None
    weight_rounding: WeightRounding = WeightRounding.NEAREST
    block_size: tuple[int, int] | None = None  # (bn, bk) of block granularity; (128, 128)
    kv_cache: KvCache = KvCache.NONE
    scale_format: ScaleFormat = ScaleFormat.FLOAT
    device: Device = Device.AUTO
    max_memory: str | None = None  # device budgets (fp8export.placement.parse_max_memory)
    offload: Offload = Offload.AUTO  # layer streaming (fp8export.streaming.plan)
    plan: bool = False  # print the plan and stop
    force: bool = False
    accuracy_budget: float | None = None  # KL budget: keep linears in bf16 (analysis/fallback.py)
    workers: int | None = None  # threads converting at once; None: every core
    read_back: ReadBack | None = None  # None: the writer's own (parallel sampled, general full)
    accuracy_samples: int | None = None  # samples the budget is measured on (default 32)
    # The named scheme (convert/schemes.py) these options were expanded from, recorded in the
    # manifest; a label only: fp8export.convert.recipe.resolve_config applies a scheme.
    scheme: str | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "checkpoint", Path(self.checkpoint))
        if self.output is not None:
            object.__setattr__(self, "output", Path(self.output))
        for name, enum in OPTION_ENUMS.items():
            option = f"--{name.replace('_', '-')}"
            if getattr(self, name) is not None:
                object.__setattr__(self, name, enum.parse(getattr(self, name), option))
        if self.scheme is not None:
            from fp8export.convert.schemes import scheme_named

            object.__setattr__(self, "scheme", scheme_named(self.scheme).name)
        object.__setattr__(self, "exclude", tuple(self.exclude))
        object.__setattr__(self, "include", tuple(self.include))
        self._check_block()
        no_calib_source = self.calib_data is None and self.calib_amax is None
        if self.scales is ScalesMode.CALIBRATE and no_calib_source:
            raise UsageError(
                "--scales calibrate needs --calib-data PATH (or --calib-amax amax.json from "
                "`fp8export calibrate`)."
            )
        parse_max_memory(self.max_memory)  # a usage error before any file is read
        if self.weight_rounding is not WeightRounding.NEAREST and self.calib_data is None:
            raise UsageError("--weight-rounding gptq rounds each weight for its layer's output "
                             "on sample inputs: give --calib-data PATH.")
        if self.kv_cache is KvCache.FP8 and self.calib_data is None:
            raise UsageError("--kv-cache fp8 calibrates the keys and values: give --calib-data "
                             "PATH.")
        if self.margin < 0:
            raise UsageError(f"--margin must be >= 0, got {self.margin}.")
        if self.accuracy_budget is not None and not 0 < self.accuracy_budget < math.inf:
            raise UsageError(f"--accuracy-budget must be a finite KL > 0 (nats per token), got "
                             f"{self.accuracy_budget}.")
        if self.read_back is not None:
            object.__setattr__(self, "read_back", ReadBack.parse(self.read_back, "--read-back"))
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
        # --calib-data is also read by GPTQ, the KV-cache scales and the accuracy budget
        data_used_elsewhere = self.kv_cache is KvCache.FP8 or self.accuracy_budget is not None \
            or self.weight_rounding is not WeightRounding.NEAREST
        if self.scales is ScalesMode.WEIGHTS and self.calib_data is not None \
                and not data_used_elsewhere:
            raise UsageError("--scales weights calibrates nothing, so --calib-data would be "
                             "ignored. Drop --calib-data, or use --scales calibrate.")
        if self.calib_amax is not None and self.calib_data is not None \
                and not data_used_elsewhere:
            raise UsageError("--calib-amax gives the activation ranges, so --calib-data would be "
                             "ignored (only --weight-rounding gptq, --kv-cache fp8 and "
                             "--accuracy-budget read it next to an amax file). Drop one of them.")
        if self.percentile is not None:
            if not 0.0 < float(self.percentile) <= 100.0:
                raise UsageError(f"--percentile must be in (0, 100], got {self.percentile}.")
            if self.calib_method is not CalibMethod.PERCENTILE:
                raise UsageError(f"--percentile applies to --calib-method percentile, not "
                                 f"{self.calib_method}. Drop --percentile or choose percentile.")
        if self.accuracy_samples is not None and self.accuracy_budget is None:
            raise UsageError("--accuracy-samples sets how many samples --accuracy-budget "
                             "measures on; give --accuracy-budget KL too, or drop it.")

    def _check_block(self) -> None:
        """Block granularity: a block size (default 128x128) and activations quantized
        dynamically per token group of ``bk``, which is what every engine that loads
        block-scaled FP8 runs (vLLM's ``weight_block_size`` requires ``activation_scheme:
        dynamic``; compressed-tensors' FP8_BLOCK declares ``group`` inputs)."""
        block = self.weight_granularity is WeightGranularity.BLOCK
        try:
            size = parse_block_size(self.block_size)
        except ValueError as exc:
            raise UsageError(f"--block-size: {exc}; give N or NxK, e.g. 128x128.") from None
        if size is not None and not block:
            raise UsageError("--block-size sets the blocks of --weight-granularity block; add "
                             "--weight-granularity block or drop --block-size.")
        if size is not None:
            from fp8export.numerics.block import MAX_BLOCK

            if max(size) > MAX_BLOCK:
                raise UsageError(f"--block-size {size[0]}x{size[1]}: each side must be at most "
                                 f"{MAX_BLOCK}, the largest block an FP8 folder can record "
                                 "(DeepSeek-V3 and Qwen3-FP8 use 128x128).")
        object.__setattr__(self, "block_size", (size or DEFAULT_BLOCK) if block else None)
        if self.scale_format is ScaleFormat.UE8M0 and (
                not block or self.format is not OutputFormat.VLLM):
            raise UsageError("--scale-format ue8m0 stores block weight scales as powers of two "
                             "(F8_E8M0), the fine-grained dialect's scale_fmt: give "
                             "--weight-granularity block --format vllm, or drop it.")
        if not block:
            if self.dynamic_activations is DynamicActivations.GROUP:
                raise UsageError("--dynamic-activations group goes with --weight-granularity "
                                 "block (its group size is the block's input size).")
            if self.dynamic_activations is None:
                object.__setattr__(self, "dynamic_activations", DynamicActivations.TOKEN)
            return
        if self.dynamic_activations in (DynamicActivations.TOKEN, DynamicActivations.TENSOR):
            raise UsageError("--weight-granularity block quantizes activations per token group "
                             "of the block's input size (what vLLM and transformers run for "
                             "block-scaled FP8); drop --dynamic-activations "
                             f"{self.dynamic_activations}.")
        object.__setattr__(self, "dynamic_activations", DynamicActivations.GROUP)
        if self.format is OutputFormat.MODELOPT:
            raise UsageError("--format modelopt cannot hold block weight scales (ModelOpt's "
                             "quant_algo FP8 is per-tensor with static inputs). Use --format "
                             "compressed-tensors (strategy: block) or --format vllm "
                             "(weight_block_size, as DeepSeek-V3 ships).")
        why = ("--weight-granularity block quantizes activations dynamically per token group "
               "(vLLM's weight_block_size requires activation_scheme dynamic)")
        if self.scales in (ScalesMode.HISTORY, ScalesMode.CALIBRATE) or self.calib_amax:
            raise UsageError(f"{why}, so static input scales cannot be used: drop --scales "
                             f"{self.scales}{' and --calib-amax' if self.calib_amax else ''}.")
        if self.weight_scales_from_history:
            raise UsageError("--weight-scales-from-history gives one scale per tensor; "
                             "--weight-granularity block computes one per block from the "
                             "weights. Drop one of them.")

    @property
    def resolved_output(self) -> Path:
        return self.output if self.output is not None else sibling_output(self.checkpoint, "-fp8")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra", None)
        return {k: (str(v) if isinstance(v, (Path, Enum)) else v) for k, v in d.items()}
