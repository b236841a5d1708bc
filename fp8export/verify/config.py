"""``VerifyConfig``: the options of ``fp8export verify`` as one frozen value."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from fp8export.config import Device, Offload, StrEnum
from fp8export.errors import UsageError
from fp8export.placement import parse_max_memory
from fp8export.verify.thresholds import check_spec


class Backend(StrEnum):
    """How the candidate runs (``verify --backend``); auto picks from the path."""

    AUTO = "auto"
    TORCH = "torch"  # FP8 folder through the torch FP8 runtime, or a plain HF folder
    ONNXRUNTIME = "onnxruntime"
    TENSORRT = "tensorrt"


class RefDtype(StrEnum):
    BF16 = "bf16"
    FP32 = "fp32"


@dataclass(frozen=True)
class VerifyConfig:
    """Options of ``fp8export verify REFERENCE CANDIDATE`` (DESIGN.md, CLI contract).

    ``samples``/``seq_len`` bound the data; ``fp8_mode`` picks the torch FP8 path
    ("auto": ``torch._scaled_mm`` on compute capability >= 8.9, emulation elsewhere).
    ``noise_floor`` also runs the reference in fp32 (noise_floor.py). ``ort_opt_level`` runs an
    ``.onnx`` candidate at that onnxruntime graph optimization level (disable, basic, extended,
    all); None: onnxruntime's own default, as ``InferenceSession(path)`` runs it.
    ``command_line`` is what the report shows as the command (the CLI fills it in).
    """

    reference: Path
    candidate: Path
    data: Path | None = None
    thresholds: str = "default"  # preset name or a .yaml/.yml/.json file
    report_dir: Path = Path("fp8export-report")
    backend: Backend = Backend.AUTO
    reference_dtype: RefDtype = RefDtype.BF16
    samples: int | None = None
    batch_size: int = 4
    seq_len: int | None = 128
    per_layer: bool = False
    # One more forward of the reference in fp32 on the same inputs: the bf16 noise floor that
    # FP8's loss is reported next to. On by default; it costs that forward and an fp32 copy
    # of the reference in memory (--no-noise-floor for models where that does not fit).
    noise_floor: bool = True
    device: Device = Device.AUTO
    # "0=70GiB,1=70GiB,cpu=100GiB": the reference and the candidate together (placement.py)
    max_memory: str | None = None
    offload: Offload = Offload.AUTO  # layer streaming (fp8export.streaming.plan)
    plan: bool = False  # print the plan and stop (fp8export.verify.run.plan_verify)
    fp8_mode: str = "auto"
    ort_opt_level: str | None = None  # None: onnxruntime's default (what users run)
    # FP8-folder candidates: their KV cache ("auto": as the folder declares it, "fp8", "none")
    # and attention ("bf16", "fp8"); "fp8" also measures the FP8-linears-only model beside it
    kv_cache: str = "auto"
    attention: str = "bf16"
    # Wall-clock limit of the whole run, every stage (_time_limit.py); None or 0: none, the
    # default: how long a model takes depends on its size, the data and the machine's load
    # (SmolLM2-135M: 909 s for 32 samples on a busy 2-core machine), so no fixed default fits,
    # and a graph that would never end (Loop, Scan, If) is refused before it runs.
    timeout: float | None = None
    write_reports: bool = True
    force: bool = False  # replace the report files an existing --report-dir already holds
    command_line: str | None = field(default=None, compare=False)  # as typed, for the report
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        for name in ("reference", "candidate", "report_dir"):
            object.__setattr__(self, name, Path(getattr(self, name)))
        if self.data is not None:
            object.__setattr__(self, "data", Path(self.data))
        for name, enum in (("backend", Backend), ("reference_dtype", RefDtype),
                           ("device", Device), ("offload", Offload)):
            object.__setattr__(self, name, enum.parse(getattr(self, name),
                                                      f"--{name.replace('_', '-')}"))
        for name in ("samples", "batch_size", "seq_len"):
            v = getattr(self, name)
            if v is not None and int(v) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}.")
        if self.timeout is not None and not float(self.timeout) >= 0:
            raise UsageError(f"--timeout must be >= 0 seconds (0: no limit), got "
                             f"{self.timeout}.")
        parse_max_memory(self.max_memory)  # a usage error before any model is loaded
        if self.ort_opt_level is not None:
            from fp8export.onnx.levels import level_name

            object.__setattr__(self, "ort_opt_level", level_name(self.ort_opt_level))
        if self.fp8_mode not in ("auto", "emulate", "scaled_mm"):
            raise UsageError(f"--fp8-mode {self.fp8_mode!r} is unknown; use auto, emulate "
                             "or scaled_mm.")
        if self.fp8_mode == "scaled_mm" and self.device is Device.CPU:
            raise UsageError("--fp8-mode scaled_mm runs torch._scaled_mm on a CUDA GPU; with "
                             "--device cpu use --fp8-mode emulate (or auto).")
        if self.kv_cache not in ("auto", "fp8", "none") or self.attention not in ("bf16", "fp8"):
            raise UsageError(f"--kv-cache {self.kv_cache!r} / --attention {self.attention!r}: "
                             "use --kv-cache auto|fp8|none and --attention bf16|fp8.")
        if self.attention == "fp8" and self.kv_cache == "none":
            raise UsageError("--attention fp8 reads an FP8 KV cache; drop --kv-cache none.")
        if not isinstance(self.thresholds, dict):
            check_spec(str(self.thresholds))  # a usage error before any model is loaded

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra", None)
        return {k: (str(v) if isinstance(v, (Path, Enum)) else v) for k, v in d.items()}
