"""How the engines an FP8 folder's config names would read it, and which of them run it right.

A folder is read the way its ``quantization_config`` makes the serving stacks read it
(``reference/fp8_checkpoint_formats.md``; the rules below were checked against vLLM's
``CompressedTensorsConfig`` / ``Fp8Config`` / ModelOpt loaders, transformers 5.24's
``CompressedTensorsHfQuantizer`` / ``FineGrainedFP8HfQuantizer`` and compressed-tensors'
``match_targets``):

* **which modules are FP8**: compressed-tensors quantizes a module one of its ``config_groups``
  targets (an exact name, a ``re:`` regular expression matched from the start, or a class name:
  ``Linear`` matches linear layers) unless an ``ignore`` entry matches it the same way; the most
  specific target wins (exact name, then expression, then class). ``quant_method: fp8`` quantizes
  every linear layer its ``ignored_layers`` / ``modules_to_not_convert`` do not name (vLLM: the
  exact name; transformers: a prefix ending at a module boundary, an expression with that
  boundary, or a suffix). ModelOpt skips what ``exclude_modules`` (``hf_quant_config.json``) or
  ``ignore`` (config.json) name (exact, a prefix, or a ``*`` wildcard);
* **which tensors hold the scales**: compressed-tensors and ModelOpt read ``weight_scale`` and
  ``input_scale``; fine-grained ``quant_method: fp8`` (``weight_block_size``) reads
  ``weight_scale_inv``; per-tensor ``quant_method: fp8`` reads ``weight_scale`` / ``input_scale``
  in vLLM, while transformers reads ``weight_scale_inv`` / ``activation_scale`` and only when
  the config says ``weight_block_size: null`` (without the key it assumes 128x128 blocks);
* **their shapes**: what the declared strategy allocates: one value (tensor), ``[out, 1]``
  (channel), ``[ceil(out/bn), ceil(in/bk)]`` (block).

:func:`judge_layers` holds every FP8 tensor of a folder to that reading and raises
``Fp8ExportError`` naming the layer and the fix wherever config and tensors disagree (an FP8
layer the config leaves in high precision, a scale under a name its loaders do not read or a
second scale beside the one they do, a scale of another strategy's shape, an input scale the
config does not declare, an FP8 embedding or MoE router, which every engine runs in high
precision): an engine would load such a layer's E4M3 codes unscaled, scaled by the wrong
tensor, or fail. :func:`loaders` then says which engines run the folder as what it is and why
the others do not (partial blocks, lm_head in FP8, GPT-2 Conv1D, expert input scales).

Regular expressions from the config are evaluated with the ``regex`` package under a time limit
(a hostile pattern cannot hang the reader); nothing else from the folder is executed.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8export.errors import Fp8ExportError

VLLM = "vllm"
SGLANG = "sglang"
TRTLLM = "tensorrt-llm"
TRANSFORMERS_CT = "transformers (with compressed-tensors)"
TRANSFORMERS_FG = "transformers (FineGrainedFP8)"
FP8EXPORT_ONLY = "fp8export (verify, export-onnx)"

SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale", "activation_scale")
SCALE_DTYPES = ("F32", "F16", "BF16", "F8_E8M0")
MAX_PATTERNS = 1024  # regular expressions / wildcards in one config's targets and ignore lists
_MATCH_SECONDS = 0.05  # one pattern against one name
_TOTAL_SECONDS = 10.0  # every pattern against every name of one folder
# Mixtral's loaders read its experts as w1 (gate), w3 (up), w2 (down): vLLM's
# FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="w1", ...) and transformers'
# "mixtral" weight converter (".experts.*.w1.weight" ...). llm-compressor 0.14 writes the
# linearized names instead.
_EXPERT_LEAVES = {"mixtral": ("w1", "w3", "w2"), "minimax": ("w1", "w3", "w2")}


@dataclass(frozen=True)
class Scheme:
    """What a folder's config declares for one FP8 module."""

    strategy: str  # weights: "tensor" | "channel" | "block"
    block: tuple[int, int] | None = None
    inputs: str = "static"  # "static" | dynamic "tensor" | "token" | "group" | "none"
    group_size: int | None = None


@dataclass(frozen=True)
class _Group:
    name: str
    targets: tuple[str, ...]
    scheme: Scheme


class _Matcher:
    """Config patterns against module names, under a time limit (see the module docstring)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.deadline = time.monotonic() + _TOTAL_SECONDS
        self.cache: dict[tuple[str, str], bool] = {}

    def regex(self, pattern: str, name: str, where: str) -> bool:
        key = (pattern, name)
        if key in self.cache:
            return self.cache[key]
        import regex

        if time.monotonic() > self.deadline:
            raise Fp8ExportError(f"{self.folder}: the regular expressions of the quantization "
                                 f"config's {where} take too long to match the module names; "
                                 "simplify them (or list the modules by name).")
        try:
            found = regex.match(pattern, name, timeout=_MATCH_SECONDS) is not None
        except TimeoutError:
            raise Fp8ExportError(f"{self.folder}: the regular expression {pattern[:60]!r} in the "
                                 f"quantization config's {where} takes too long to match a "
                                 "module name; simplify it.") from None
        except (regex.error, OverflowError, RecursionError) as exc:
            raise Fp8ExportError(f"{self.folder}: {pattern[:60]!r} in the quantization config's "
                                 f"{where} is not a valid regular expression ({exc}).") from None
        self.cache[key] = found
        return found


def _classes(kind: str | None) -> tuple[str, ...]:
    """Class names a module of this kind has in the engines (compressed-tensors matches a
    target against every class in the module's MRO; vLLM's LinearBase matches "Linear")."""
    if kind == "embedding":
        return ("Embedding", "Module")
    if kind == "router":
        return ("Module",)  # transformers 5's routers are not nn.Linear; vLLM's are unquantized
    return ("Linear", "Module")


@dataclass(frozen=True)
class Reading:
    """How the engines named by one folder's config read it (see the module docstring)."""

    dialect: str  # "compressed-tensors" | "vllm" (quant_method fp8) | "modelopt"
    producer: str
    engines: tuple[str, ...]  # who loads this dialect at all
    weight_scale: str  # the tensor suffix those engines load as the weight scale
    input_scale: str  # ... and as the static input scale
    kv: bool = False  # the config declares an FP8 KV cache
    groups: tuple[_Group, ...] = ()  # compressed-tensors
    default: Scheme | None = None  # quant_method fp8 / modelopt: one scheme for every module
    ignore: tuple[str, ...] = ()
    ignore_rule: str = "compressed-tensors"  # | "fine-grained" | "modelopt"
    ignore_key: str = "ignore"
    scale_fmt: str = "float"  # "ue8m0": power-of-two scales (transformers' scale_fmt)
    notes: tuple[str, ...] = field(default_factory=tuple)

    def scheme(self, name: str, kind: str | None, matcher: _Matcher) -> Scheme | None:
        """The module's scheme, or None when the config leaves it in high precision."""
        if self.default is not None:
            return self.default
        classes = _classes(kind)
        ranked: list[tuple[int, _Group]] = []
        for group in self.groups:
            ranks = []
            for t in group.targets:
                if t == name:
                    ranks.append(0)
                elif t.startswith("re:") and matcher.regex(t[3:], name, "targets"):
                    ranks.append(1)
                elif t in classes:
                    ranks.append(2)
            if ranks:
                ranked.append((min(ranks), group))
        if not ranked:
            return None
        best = min(r for r, _ in ranked)
        schemes = {g.scheme for r, g in ranked if r == best}
        if len(schemes) > 1:
            names = sorted(g.name for r, g in ranked if r == best)
            raise Fp8ExportError(
                f"layer {name}: config groups {names} target it equally specifically with "
                "different schemes, so which one an engine applies is undefined. Give it one "
                "group (target it by its exact name).")
        return schemes.pop()

    def ignored_by(self, name: str, kind: str | None, matcher: _Matcher) -> str | None:
        """The ignore entry that leaves ``name`` in high precision, or None."""
        for entry in self.ignore:
            if self.ignore_rule == "compressed-tensors":
                hit = entry == name or entry in _classes(kind) or (
                    entry.startswith("re:") and matcher.regex(entry[3:], name, self.ignore_key))
            elif self.ignore_rule == "modelopt":
                hit = entry == name or name.startswith(entry + ".") or (
                    ("*" in entry or "?" in entry) and fnmatch.fnmatchcase(name, entry))
            else:  # transformers' should_convert_module; vLLM's exact name is a special case
                hit = entry == name or name.endswith(entry) or (
                    matcher.regex(rf"(?:{entry})(?:(?<=\.)|(?=\.|$))", name, self.ignore_key))
            if hit:
                return entry
        return None


def _bad(folder: Path, what: str) -> Fp8ExportError:
    return Fp8ExportError(f"{folder}: {what}")


def _block_of(value: Any) -> tuple[int, int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 16 for v in value):
        return int(value[0]), int(value[1])
    return None


def _strs(value: Any, folder: Path, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad(folder, f"quantization_config {key} is not a list of module names.")
    patterns = [v for v in value if v.startswith("re:") or "*" in v or "?" in v]
    if len(patterns) > MAX_PATTERNS:
        raise _bad(folder, f"quantization_config {key} holds {len(patterns)} patterns; "
                           f"fp8export evaluates at most {MAX_PATTERNS}.")
    return tuple(value)


def _producer(value: Any, default: str) -> str:
    if isinstance(value, dict):
        name = str(value.get("name") or default)[:40]
        version = str(value.get("version") or "")[:20]
        return f"{name} {version}".strip()
    return default


SUPPORTED = ("compressed-tensors with 8-bit float weights (llm-compressor's FP8, FP8_DYNAMIC, "
             "FP8_BLOCK), quant_method fp8 (AutoFP8, DeepSeek-V3/Qwen3 fine-grained "
             "weight_block_size), ModelOpt quant_algo FP8")


def modelopt_facts(qc: dict[str, Any] | None, hf: dict[str, Any] | None
                   ) -> dict[str, Any] | None:
    """ModelOpt's facts (``quant_algo``, ``kv_cache_quant_algo``, ``producer``, the excluded
    modules of both files) from either file, or None when neither declares ModelOpt."""
    ignore = list(qc.get("ignore") or []) if isinstance(qc, dict) and \
        str(qc.get("quant_method", "")).lower() == "modelopt" else []
    if isinstance(hf, dict) and isinstance(hf.get("quantization"), dict):
        q = hf["quantization"]
        return {**q, "producer": hf.get("producer"),
                "exclude": [*(q.get("exclude_modules") or []), *ignore]}
    if isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "modelopt":
        kv = qc.get("kv_cache_scheme")
        return {"quant_algo": qc.get("quant_algo"), "producer": qc.get("producer"),
                "kv_cache_quant_algo": "FP8" if isinstance(kv, dict) else None,
                "exclude": ignore}
    return None


def ct_fp8_groups(qc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """compressed-tensors config groups with 8-bit float weights, by name."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict):
        return []
    out = []
    for name, g in groups.items():
        w = g.get("weights") if isinstance(g, dict) else None
        if isinstance(w, dict) and w.get("type") == "float" and w.get("num_bits") == 8:
            out.append((str(name), g))
    return out


def reading_of(folder: Path, qc: dict[str, Any], hf: dict[str, Any] | None,
               weight_scales: set[str]) -> Reading:
    """The :class:`Reading` of a folder's config (``hf``: ModelOpt's hf_quant_config.json).
    ``weight_scales``: the suffixes of the weight scales stored beside its FP8 weights (a
    per-tensor ``quant_method: fp8`` folder is vLLM's or transformers' by its names)."""
    mo = modelopt_facts(qc or None, hf)
    if mo is not None:
        if str(mo.get("quant_algo", "")).upper() != "FP8":
            raise _bad(folder, f"ModelOpt quant_algo {str(mo.get('quant_algo'))[:30]!r} is not "
                               f"FP8; fp8export reads {SUPPORTED}.")
        return Reading(
            "modelopt", _producer(mo.get("producer"), "modelopt"), (TRTLLM, VLLM),
            "weight_scale", "input_scale",
            kv=str(mo.get("kv_cache_quant_algo") or "").upper() == "FP8",
            default=Scheme("tensor"), ignore=_strs(mo.get("exclude"), folder, "exclude_modules"),
            ignore_rule="modelopt", ignore_key="exclude_modules")
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return _fp8_reading(folder, qc, weight_scales)
    if method == "compressed-tensors" and ct_fp8_groups(qc):
        return _ct_reading(folder, qc)
    raise _bad(folder, f"quantization_config quant_method {method or None!r} is not an FP8 "
                       f"dialect fp8export reads ({SUPPORTED}).")


def _fp8_reading(folder: Path, qc: dict[str, Any], weight_scales: set[str]) -> Reading:
    scheme = str(qc.get("activation_scheme", "")).lower()
    if scheme not in ("static", "dynamic"):
        raise _bad(folder, f"quantization_config activation_scheme is {scheme or None!r}; quant_"
                           "method fp8 needs 'static' or 'dynamic'.")
    raw = qc.get("weight_block_size")
    block = _block_of(raw)
    if raw is not None and block is None:
        raise _bad(folder, f"quantization_config weight_block_size is {str(raw)[:40]!r}, not two "
                           "positive integers.")
    fmt = str(qc.get("scale_fmt") or "float").lower()
    if fmt not in ("float", "ue8m0"):
        raise _bad(folder, f"quantization_config scale_fmt is {fmt[:20]!r}; engines read "
                           "'float' or 'ue8m0'.")
    ignore = qc.get("ignored_layers", qc.get("modules_to_not_convert"))
    ignore = _strs(ignore, folder, "ignored_layers")
    kv = qc.get("kv_cache_scheme") is not None
    if block is not None:
        if scheme != "dynamic":
            raise _bad(folder, "weight_block_size needs activation_scheme dynamic (vLLM and "
                               "transformers run block-scaled FP8 with dynamic activations).")
        return Reading("vllm", "quant_method fp8, fine-grained (DeepSeek-V3 style)",
                       (VLLM, SGLANG, TRANSFORMERS_FG), "weight_scale_inv", "input_scale", kv=kv,
                       default=Scheme("block", block, "group", block[1]), ignore=ignore,
                       ignore_rule="fine-grained", ignore_key="ignored_layers", scale_fmt=fmt)
    inputs = "static" if scheme == "static" else "tensor"
    if "weight_block_size" in qc and weight_scales == {"weight_scale_inv"}:
        # transformers' own per-tensor form (weight_block_size: null): weight_scale_inv and
        # activation_scale, which vLLM's fp8 loader does not read
        return Reading("vllm", "quant_method fp8, per-tensor (transformers FineGrainedFP8)",
                       (TRANSFORMERS_FG,), "weight_scale_inv", "activation_scale", kv=kv,
                       default=Scheme("tensor", None, inputs), ignore=ignore,
                       ignore_rule="fine-grained", ignore_key="ignored_layers")
    return Reading("vllm", "quant_method fp8 (AutoFP8 / vLLM)", (VLLM,), "weight_scale",
                   "input_scale", kv=kv, default=Scheme("tensor", None, inputs), ignore=ignore,
                   ignore_rule="fine-grained", ignore_key="ignored_layers")


def _ct_reading(folder: Path, qc: dict[str, Any]) -> Reading:
    groups = []
    for gname, g in ct_fp8_groups(qc):
        w = g["weights"]
        strategy = str(w.get("strategy", "tensor"))
        block = None
        if strategy not in ("tensor", "channel", "block"):
            raise _bad(folder, f"compressed-tensors weight strategy {strategy[:20]!r} is not one "
                               "fp8export reads (tensor, channel, block).")
        if strategy == "block":
            block = _block_of(w.get("block_structure"))
            if block is None:
                raise _bad(folder, "compressed-tensors block strategy without a valid "
                                   "block_structure.")
        targets = _strs(g.get("targets") or [], folder, f"config_groups.{gname}.targets")
        inp = g.get("input_activations")
        if inp is None:
            scheme = Scheme(strategy, block, "none")
        elif not isinstance(inp, dict) or inp.get("type") != "float" or inp.get("num_bits") != 8:
            raise _bad(folder, "compressed-tensors input activations that are not 8-bit float; "
                               "fp8export reads FP8 (W8A8) and weight-only FP8.")
        elif not inp.get("dynamic"):
            scheme = Scheme(strategy, block, "static")
        else:
            mode = str(inp.get("strategy", "tensor"))
            size = inp.get("group_size")
            if mode not in ("tensor", "token", "group") or (
                    mode == "group" and not (isinstance(size, int) and 0 < size <= 1 << 16)):
                raise _bad(folder, f"compressed-tensors dynamic input strategy {mode[:20]!r} "
                                   f"(group_size {size!r}) is not one fp8export runs (tensor, "
                                   "token, group with a group_size).")
            scheme = Scheme(strategy, block, mode, size if mode == "group" else None)
        groups.append(_Group(gname, targets, scheme))
    producer = f"compressed-tensors {str(qc.get('version') or '')[:20]}".strip()
    return Reading("compressed-tensors", producer, (VLLM, TRANSFORMERS_CT), "weight_scale",
                   "input_scale", kv=isinstance(qc.get("kv_cache_scheme"), dict),
                   groups=tuple(groups), ignore=_strs(qc.get("ignore"), folder, "ignore"))


# ------------------------------------------------------------------------------ judging


@dataclass(frozen=True)
class LayerReading:
    """One FP8 layer as the folder's engines read it."""

    name: str
    shape: tuple[int, int]  # stored
    layout: str  # "out_in" | "in_out"
    scheme: Scheme
    weight_scale_tensor: str
    input_scale_tensor: str | None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def judge_layers(folder: Path, reading: Reading, infos: Mapping[str, Any],
                 config: Mapping[str, Any], layouts: Mapping[str, str] | None = None
                 ) -> dict[str, LayerReading]:
    """Every FP8 weight of the folder (``infos``: tensor name -> info with ``dtype`` and
    ``shape``) as :class:`LayerReading`, in name order; raises where the folder's engines would
    misread it (see the module docstring). ``layouts``: the stored layout of layers that are
    not ``out_in`` (GPT-2's Conv1D)."""
    from fp8export.numerics.block import grid_shape
    from fp8export.scales.families import module_kind

    matcher = _Matcher(folder)
    fp8 = sorted(n for n, i in infos.items() if str(i.dtype).startswith("F8_E"))
    fp8 = [n for n in fp8 if str(infos[n].dtype) in ("F8_E4M3", "F8_E5M2")]
    odd = [n for n in fp8 if infos[n].dtype != "F8_E4M3" or not n.endswith(".weight")
           or len(infos[n].shape) != 2]
    if odd:
        i = infos[odd[0]]
        raise _bad(folder, f"{odd[0]} is {i.dtype} {list(i.shape)}; fp8export reads FP8 (E4M3) "
                           f"linear weights stored 2-D as <module>.weight ({len(odd)} tensor(s) "
                           "are not).")
    experts = _EXPERT_LEAVES.get(str(config.get("model_type", "")).lower())
    engines = " and ".join(reading.engines)
    out: dict[str, LayerReading] = {}
    for wname in fp8:
        name = wname[: -len(".weight")]
        shape = tuple(int(d) for d in infos[wname].shape)
        kind = module_kind(name)
        if kind in ("embedding", "router", "norm"):
            what = {"embedding": "an embedding", "router": "an MoE router",
                    "norm": "a normalization"}[kind]
            raise _bad(folder, f"{wname} is FP8, but {name} is {what}, which the engines run in "
                               f"high precision ({engines}: the {reading.dialect} config "
                               "quantizes linear layers only), so they would use its E4M3 codes "
                               "as weights without their scale. Quantize the model again with "
                               f"{name} left out (llm-compressor: add it to ignore), or "
                               "dequantize it.")
        leaf = name.rsplit(".", 1)[-1]
        if experts and ".experts." in name and leaf not in experts and leaf in (
                "gate_proj", "up_proj", "down_proj"):
            family = config.get("model_type")
            names = "/".join(experts)
            raise _bad(folder, f"{wname}: this {family} folder names its experts gate_proj/"
                               f"up_proj/down_proj, but {family}'s loaders read experts.N."
                               f"{names} (vLLM's FusedMoE.make_expert_params_mapping, "
                               "transformers' weight converter), so neither would load these "
                               "experts. Rename each expert's gate_proj/up_proj/down_proj "
                               f"tensors to {names} (its scales with them).")
        ignored = reading.ignored_by(name, kind, matcher)
        scheme = None if ignored else reading.scheme(name, kind, matcher)
        if scheme is None:
            why = (f"its {reading.ignore_key} entry {ignored!r} names it" if ignored else
                   "no config group targets it")
            raise _bad(folder, f"layer {name} is stored in FP8, but the {reading.dialect} config "
                               f"leaves it in high precision ({why}), so {engines} would load its "
                               "E4M3 codes as plain weights. Fix the config (quantize it, or "
                               "store the layer in high precision).")
        present = {s for s in SCALE_SUFFIXES if f"{name}.{s}" in infos}
        wscale = f"{name}.{reading.weight_scale}"
        if wscale not in infos:
            other = sorted(present & {"weight_scale", "weight_scale_inv"})
            raise _bad(folder, f"layer {name}: {engines} read its weight scale from "
                               f"{wscale}, which is missing"
                               + (f" (the folder stores {name}.{other[0]}: with this config "
                                  "the engines would not find it and use the E4M3 codes "
                                  f"unscaled). Rename it to {reading.weight_scale}, or fix the "
                                  "config." if other else ". The folder is incomplete."))
        wanted = {reading.weight_scale}
        if scheme.inputs == "static":
            wanted.add(reading.input_scale)
        stray = sorted(present - wanted)
        if stray:
            extra = f"{name}.{stray[0]}"
            why = ("the config declares dynamic inputs" if "input" in stray[0] or
                   "activation" in stray[0] else f"they read {wscale}")
            raise _bad(folder, f"layer {name}: {extra} is stored but {engines} do not read it "
                               f"({why}); a tool that reads it would compute another model than "
                               "the engines. Remove it, or fix the config.")
        iscale = f"{name}.{reading.input_scale}" if scheme.inputs == "static" else None
        if iscale is not None and iscale not in infos:
            raise _bad(folder, f"layer {name} has no {reading.input_scale}, but the "
                               f"{reading.dialect} config declares static activations for it. "
                               "The folder is incomplete.")
        for t in (wscale, iscale):
            if t is not None and str(infos[t].dtype) not in SCALE_DTYPES:
                raise _bad(folder, f"{t} is {infos[t].dtype}; engines read a scale as a float "
                                   "(F32, F16, BF16) or as UE8M0 powers of two (F8_E8M0), so "
                                   "this one would be misread. Store it as F32.")
        layout = (layouts or {}).get(name, "out_in")
        out_in = (shape[1], shape[0]) if layout == "in_out" else shape
        sshape = tuple(int(d) for d in infos[wscale].shape)
        if scheme.strategy == "tensor":
            ok = _numel(sshape) == 1 and len(sshape) <= 2
            want = "one value"
        elif scheme.strategy == "channel":
            ok = sshape in ((out_in[0], 1), (out_in[0],))
            want = f"[{out_in[0]}, 1] (one per output channel)"
        else:
            ok = layout == "out_in" and sshape == grid_shape(out_in, scheme.block)
            want = (f"the {list(grid_shape(out_in, scheme.block))} grid of "
                    f"{scheme.block[0]}x{scheme.block[1]} blocks")
        if not ok:
            raise _bad(folder, f"{wscale} has shape {list(sshape)}, but the {reading.dialect} "
                               f"config declares {scheme.strategy} weight scales for {name}, "
                               f"which {engines} allocate as {want}: they would refuse the "
                               "folder or read the scales wrongly. Fix the config to declare "
                               "what the tensors hold, or re-quantize.")
        out[name] = LayerReading(name, shape, layout, scheme, wscale, iscale)
    return out


# ------------------------------------------------------------------------------ loaders


@dataclass(frozen=True)
class Loaders:
    """Which engines load a folder as what it is (``ok``: their names, with what they leave
    out), and why the others named by its dialect do not (``not_ok``)."""

    ok: tuple[str, ...]
    not_ok: dict[str, str]

    def label(self) -> str:
        """``loads in vllm and transformers (...)`` or ``no engine loads it as written``."""
        if not self.ok:
            return "no engine loads it as written"
        only = "" if any(n.startswith("transformers") for n in self.ok) else " only"
        return f"loads in {' and '.join(self.ok)}{only}"

    def notes(self) -> list[str]:
        return [f"{engine} does not load it as written: {why}"
                for engine, why in self.not_ok.items()]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": list(self.ok), "not_ok": dict(self.not_ok)}


def _listed(names: list[str], limit: int = 3) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def loaders(reading: Reading, layers: Mapping[str, LayerReading], config: Mapping[str, Any],
            scale_dtypes: Mapping[str, str] | None = None) -> Loaders:
    """Which of ``reading.engines`` run the folder as what it is (see the module docstring)."""
    from fp8export.scales.families import family_of, fused_group_of, module_kind

    # the dialects' own limits (per-tensor quant_method fp8 is vLLM's only, ModelOpt has no
    # transformers loader) are in reading.engines and said by formats.format_notes
    engines = list(reading.engines)
    why: dict[str, str] = {}
    if reading.engines == (TRANSFORMERS_FG,):
        why[VLLM] = ("vLLM's fp8 loader reads weight_scale / input_scale, not transformers' "
                     "weight_scale_inv / activation_scale")
        engines.insert(0, VLLM)
    family = family_of(dict(config))
    heads = [n for n in layers if module_kind(n) == "head"]
    if heads:
        why.setdefault(VLLM, f"{_listed(heads)} in FP8: vLLM's output head (ParallelLMHead) is "
                             "no linear layer and is never quantized, so it would use the E4M3 "
                             "codes unscaled")
        if reading.dialect == "modelopt":
            why.setdefault(TRTLLM, f"{_listed(heads)} in FP8 (ModelOpt keeps lm_head in high "
                                   "precision)")
    conv1d = [n for n, lr in layers.items() if lr.layout == "in_out"]
    if conv1d:
        why.setdefault(TRANSFORMERS_CT, f"{_listed(conv1d)} are GPT-2 Conv1D layers, not "
                                        "nn.Linear, so its compressed-tensors 'Linear' target "
                                        "leaves their E4M3 codes unscaled")
    block = [lr for lr in layers.values() if lr.scheme.block]
    partial = sorted(lr.name for lr in block if lr.shape[0] % lr.scheme.block[0]
                     or lr.shape[1] % lr.scheme.block[1])
    if partial:
        why.setdefault(TRANSFORMERS_FG if reading.dialect == "vllm" else TRANSFORMERS_CT,
                       f"{len(partial)} layer(s) have partial edge blocks ({_listed(partial)}): "
                       "transformers needs every dimension a multiple of the block (it fails "
                       "at the first forward)")
    ragged = sorted(lr.name for lr in block if lr.shape[0] % lr.scheme.block[0]
                    and fused_group_of(lr.name, family))
    if ragged:
        for engine in (VLLM, SGLANG):
            why.setdefault(engine, f"fused members whose rows are not a multiple of the block "
                                   f"({_listed(ragged)}): vLLM merges q/k/v and gate/up and "
                                   "refuses such block scales (validate_fp8_block_shape)")
    if scale_dtypes and "F8_E8M0" in set(scale_dtypes.values()):
        for engine in (VLLM, SGLANG):
            why.setdefault(engine, "its UE8M0 (F8_E8M0) scale tensors are read by transformers' "
                                   "FineGrainedFP8 (scale_fmt ue8m0); fp8export has not verified "
                                   "that vLLM/SGLang load that dtype")
    experts = sorted(lr.name for lr in layers.values()
                     if ".experts." in lr.name and lr.input_scale_tensor)
    caveat = {}
    if experts and reading.dialect == "compressed-tensors":
        caveat[TRANSFORMERS_CT] = ("transformers (with compressed-tensors; it drops the "
                                   f"{len(experts)} expert input_scale tensors as UNEXPECTED "
                                   "and runs the experts without static input quantization)")
    ok = tuple(caveat.get(e, e) for e in engines if e not in why)
    return Loaders(ok, {e: why[e] for e in engines if e in why})


@dataclass(frozen=True)
class _Info:
    dtype: str
    shape: tuple[int, ...]


def planned_loaders(config: Mapping[str, Any] | None, qc: dict[str, Any],
                    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
                    layouts: Mapping[str, str], keras: bool = False) -> Loaders:
    """:func:`loaders` of a folder convert is about to write (``tensors``: every planned
    tensor's dtype and shape; ``layouts``: the quantized layers' stored layouts), judged by
    :func:`judge_layers` first, so convert never writes what its engines would misread."""
    if keras:
        return Loaders((FP8EXPORT_ONLY,), {})
    if not config:
        return Loaders((), {"any engine": "the source has no config.json, so the folder names "
                                          "no architecture to load"})
    infos = {n: _Info(d, tuple(s)) for n, (d, s) in tensors.items()}
    fp8 = [n[: -len(".weight")] for n, i in infos.items() if i.dtype == "F8_E4M3"]
    suffixes = {s for m in fp8 for s in ("weight_scale", "weight_scale_inv")
                if f"{m}.{s}" in infos}
    where = Path("(output)")
    reading = reading_of(where, qc, None, suffixes)
    layers = judge_layers(where, reading, infos, config, layouts)
    return loaders(reading, layers, config,
                   {r.weight_scale_tensor: infos[r.weight_scale_tensor].dtype
                    for r in layers.values()})
