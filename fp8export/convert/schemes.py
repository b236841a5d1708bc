"""Named schemes (``convert --scheme NAME``): the FP8 recipes other tools name, as convert options.

Each scheme stands for the options that give the same quantization in fp8export: weight
granularity, where activation scales come from and how dynamic inputs are quantized, the block
size. The names and meanings are the peers':

- llm-compressor / compressed-tensors presets (``quantization/quant_scheme.py``,
  ``PRESET_SCHEMES``): ``FP8`` (per-tensor weights, static per-tensor inputs from a min-max
  observer over calibration data), ``FP8_DYNAMIC`` (per-channel weights, inputs quantized per
  token at run time), ``FP8_BLOCK`` (128x128 weight blocks, inputs per token and group of 128
  at run time). A GPTQ variant is llm-compressor's ``GPTQModifier(scheme=...)``: the same
  scheme with ``--weight-rounding gptq``.
- ModelOpt ``hf_ptq.py --qformat``: ``fp8`` (``FP8_DEFAULT_CFG``: per-tensor weights and
  static inputs, max calibration) is ``FP8``; ``fp8_pc_pt`` (``FP8_PER_CHANNEL_PER_TOKEN_CFG``)
  is ``FP8_DYNAMIC``. ``fp8_pb_wo`` (128x128 blocks, inputs not quantized) is weight-only FP8,
  which convert does not write: the name is refused with the nearest scheme.

A scheme sets no output format: every scheme writes the default compressed-tensors dialect
(what llm-compressor writes), and ``--format`` picks another where it can hold the scheme.
Names are matched case-insensitively, as compressed-tensors does. Options given explicitly
refine a scheme (``fp8export.convert.recipe`` layers them); a combination that cannot work is
the usage error ``ConvertConfig`` raises for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from fp8export.errors import UsageError


@dataclass(frozen=True)
class Scheme:
    """One named scheme: the ``ConvertConfig`` options it stands for, and what it means."""

    name: str
    meaning: str  # one line
    peers: tuple[str, ...]  # the names other tools give it
    options: MappingProxyType  # ConvertConfig field -> value

    def flags(self) -> str:
        """The scheme as ``convert`` options, e.g. ``--weight-granularity channel ...``."""
        return option_flags(self.options)


def _scheme(name: str, meaning: str, peers: tuple[str, ...], **options: Any) -> Scheme:
    return Scheme(name, meaning, peers, MappingProxyType(options))


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    _scheme("FP8_DYNAMIC", "per-channel weights, inputs quantized per token at run time; no "
                           "data needed",
            ("llm-compressor FP8_DYNAMIC", "ModelOpt fp8_pc_pt"),
            weight_granularity="channel", dynamic_activations="token", scales="weights"),
    _scheme("FP8", "per-tensor weights, static per-tensor input scales calibrated (max) on "
                   "--calib-data (what TensorRT needs)",
            ("llm-compressor FP8", "ModelOpt fp8"),
            weight_granularity="tensor", scales="calibrate", calib_method="max"),
    _scheme("FP8_BLOCK", "128x128 weight blocks, inputs quantized per token and group of 128 at "
                         "run time; no data needed (DeepSeek-V3 / Qwen3-FP8 style)",
            ("llm-compressor FP8_BLOCK",),
            weight_granularity="block", block_size=(128, 128), dynamic_activations="group",
            scales="weights"),
)}

# Other tools' names for the same quantization.
ALIASES = {"FP8_PC_PT": "FP8_DYNAMIC"}

# Peer names convert knows but does not write, with the nearest scheme it does.
REFUSED = {
    "FP8_PB_WO": "ModelOpt's fp8_pb_wo is weight-only FP8 (128x128 weight blocks, inputs left "
                 "in 16 bits), which convert does not write (every FP8 layer it writes "
                 "quantizes its inputs too); --scheme FP8_BLOCK has the same weights with inputs "
                 "quantized per token group of 128 at run time.",
}


def scheme_named(name: str) -> Scheme:
    """The scheme ``name`` stands for (case-insensitive; the peers' aliases included), or a
    UsageError listing the names."""
    key = str(name).strip().upper().replace("-", "_")
    key = ALIASES.get(key, key)
    if key in SCHEMES:
        return SCHEMES[key]
    if key in REFUSED:
        raise UsageError(f"--scheme {name}: {REFUSED[key]}")
    raise UsageError(f"--scheme: unknown scheme {name!r}; known schemes: "
                     f"{', '.join(SCHEMES)} (and ModelOpt's fp8, fp8_pc_pt). "
                     "`fp8export convert --list-schemes` says what each one means.")


def option_flags(options: dict[str, Any]) -> str:
    """``{"weight_granularity": "channel", "block_size": (128, 128)}`` as the command line
    options ``--weight-granularity channel --block-size 128x128``."""
    parts = []
    for key, value in options.items():
        if value is None:  # an option left at its default
            continue
        if key == "block_size":
            value = "x".join(str(v) for v in value)
        parts.append(f"--{key.replace('_', '-')} {value}")
    return " ".join(parts)


def list_schemes() -> list[str]:
    """One line per scheme for ``convert --list-schemes``: name, options, meaning, peers'
    names."""
    width = max(len(n) for n in SCHEMES)
    lines = [f"{s.name:<{width}}  {s.flags()}: {s.meaning} [{'; '.join(s.peers)}]"
             for s in SCHEMES.values()]
    lines.append(f"{'':<{width}}  any scheme + --weight-rounding gptq --calib-data FILE: "
                 "GPTQ rounding on its grid [llm-compressor GPTQModifier(scheme=...)]")
    return lines


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value if value is None or isinstance(value, (bool, int, float)) else str(value)


def scheme_entry(cfg: Any) -> dict[str, Any] | None:
    """What the manifest and the summary say of ``cfg.scheme`` (a ``ConvertConfig``): its name,
    the peers' names, the options it stands for, and those the run set otherwise (explicit
    options refine a scheme); None without a scheme."""
    if getattr(cfg, "scheme", None) is None:
        return None
    scheme = scheme_named(cfg.scheme)
    options = {k: _plain(v) for k, v in scheme.options.items()}
    overridden = {k: _plain(getattr(cfg, k)) for k, v in options.items()
                  if _plain(getattr(cfg, k)) != v}
    return {"name": scheme.name, "peers": list(scheme.peers), "options": options,
            "overridden": overridden}


def scheme_line(entry: dict[str, Any]) -> str:
    """A manifest's ``scheme`` entry in one line: ``FP8_DYNAMIC = --weight-granularity ...``,
    and what explicit options changed."""
    line = f"{entry['name']} = {option_flags(entry['options'])}"
    if entry.get("overridden"):
        line += f"; refined by {option_flags(entry['overridden'])}"
    return line
