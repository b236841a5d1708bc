"""Build a transformers model (architecture from config.json, weights from our readers).

Used by calibration (observe the bf16 model), verify (the reference runner) and export-onnx.
Weights go through ``open_checkpoint`` so every source kind loads the same safe way
(safetensors, or ``torch.load(weights_only=True)``) — never ``from_pretrained`` on untrusted
pickles, never a hub download.

Untrusted configs: transformers is always called with ``trust_remote_code=False``, and a
config whose ``auto_map`` names code that transformers has no built-in class for is refused
with a message naming the entry (an ``auto_map`` that a built-in class covers is ignored, as
``trust_remote_code=False`` does). The architecture is first built on the meta device (no
memory) and every parameter shape is compared with the checkpoint's tensors; only then is the
model built for real, so a config that lies about its sizes costs nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch

from fp8export._progress import info
from fp8export.checkpoint.model_config import remote_code_entries, validate_config
from fp8export.errors import Fp8ExportError

_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_AUTO_CLASSES = {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
                 "seq-cls": "AutoModelForSequenceClassification", "base": "AutoModel"}
# A ``...ForConditionalGeneration`` is a causal LM over text (and images or audio): the auto
# class that maps its config to the class ``architectures`` names is the one to build with
# (AutoModelForCausalLM maps Mllama and Llama 4 to their text-only classes, whose module
# names differ from the checkpoint's).
_GENERATIVE_AUTOS = ("AutoModelForCausalLM", "AutoModelForImageTextToText",
                     "AutoModelForSpeechSeq2Seq")
# Keys transformers would act on that a checkpoint must not choose for us: which code to import
# and from where, and an attention kernel that may not be installed (we pick sdpa/eager).
_DROPPED_KEYS = ("quantization_config", "auto_map", "_name_or_path", "name_or_path",
                 "attn_implementation", "_attn_implementation", "custom_pipelines")
# Buffers the model makes itself (rotary tables, position ids): not in any checkpoint.
REBUILT_BUFFERS = ("inv_freq", "position_ids", "original_inv_freq")
# Non-parameter memory the architecture may allocate from config values alone (position id
# tables, masks); real models need megabytes.
MAX_BUFFER_BYTES = 4 << 30
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def task_of(config: dict[str, Any]) -> str:
    """"causal-lm", "masked-lm", "seq-cls" or "base" from ``architectures``."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch.endswith(_CAUSAL_SUFFIXES):
        return "causal-lm"
    if arch.endswith("ForMaskedLM"):
        return "masked-lm"
    if arch.endswith("ForSequenceClassification"):
        return "seq-cls"
    return "base"


def max_positions(config: dict[str, Any]) -> int | None:
    """The longest input the model's positions allow, None if the config does not say."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = config.get(key)
        if isinstance(v, int) and v > 0:
            return v
    return None


def vocab_size(config: dict[str, Any]) -> int | None:
    """The embedding rows of the model (token ids must stay below), None if not said."""
    for cfg in (config, config.get("text_config") or {}):
        v = cfg.get("vocab_size") if isinstance(cfg, dict) else None
        if isinstance(v, int) and v > 0:
            return v
    return None


def config_file(source: Path) -> Path:
    """The config.json that describes ``source`` (a folder, or a weights file beside one)."""
    source = Path(source)
    return source / "config.json" if source.is_dir() else source.parent / "config.json"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def hf_config(config: dict[str, Any], source: Path):
    """A transformers PretrainedConfig from a config.json dict (see ``_DROPPED_KEYS``)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    where = config_file(source)
    validate_config(config, where)
    for key in ("attn_implementation", "_attn_implementation"):
        chosen = config.get(key)
        if chosen not in (None, "eager", "sdpa"):
            hub = isinstance(chosen, str) and "/" in chosen
            info(f"Note: {where}: {key} {str(chosen)[:80]!r} ignored"
                 + (" (a Hub kernel: code downloaded and run at load time)" if hub else "")
                 + "; the model runs with transformers' built-in attention.")
    cfg = {k: v for k, v in config.items() if k not in _DROPPED_KEYS}
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise Fp8ExportError(f"{source}: config.json has no 'model_type'; cannot build the model.")
    if model_type not in CONFIG_MAPPING_NAMES:
        _refuse_remote_code(config, where, ("AutoConfig",), f"model_type {model_type!r}")
        raise Fp8ExportError(
            f"{source}: transformers does not know model_type {model_type!r}. "
            "Upgrade transformers or convert a supported architecture.")
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except Exception as exc:  # config classes raise any type for values they do not accept
        raise Fp8ExportError(f"{where}: transformers does not accept this {model_type} config "
                             f"({_first_line(exc)}). Restore the model's config.json.") from exc


def _refuse_remote_code(config: dict[str, Any], where: Path, entries: tuple[str, ...],
                        what: str) -> None:
    for rc in remote_code_entries(config, where):
        if rc.entry in entries:
            raise Fp8ExportError(
                f"{rc.describe()}: {what} needs this custom code from the checkpoint, and "
                "fp8export never runs code from a checkpoint (trust_remote_code=False). Use a "
                "checkpoint of an architecture transformers implements itself.")


def _check_counts(config: dict[str, Any], names: list[str], where: Path) -> None:
    """Layer and expert counts of the config against the tensor names, before any build (a
    config claiming a million layers would take hours to build even on the meta device)."""
    for keys, pattern, what in ((("num_hidden_layers", "n_layer", "num_layers"), _LAYER_INDEX,
                                 "layers"),
                                (("num_local_experts", "num_experts", "n_routed_experts"),
                                 _EXPERT_INDEX, "experts")):
        found = {int(m.group(1)) for n in names for m in [pattern.search(n)] if m}
        if not found:
            continue
        for key in keys:
            v = config.get(key)
            if isinstance(v, int) and v > max(found) + 1:
                raise Fp8ExportError(
                    f"{where}: {key!r} is {v} but the weights hold {what} 0..{max(found)} only. "
                    "The config does not describe these weights; restore the model's config.json.")


def _dtype_kwarg() -> str:
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def _build(auto, cfg, dtype: torch.dtype, where: Path, arch: str, *, meta: bool,
           empty: bool = False):
    kwargs = {_dtype_kwarg(): dtype}
    try:
        if meta:
            with torch.device("meta"):
                return auto.from_config(cfg, trust_remote_code=False, **kwargs)
        if empty:
            from fp8export.placement import empty_weights

            with empty_weights():
                return auto.from_config(cfg, trust_remote_code=False, **kwargs)
        return auto.from_config(cfg, trust_remote_code=False, **kwargs)
    except Fp8ExportError:
        raise
    except Exception as exc:  # bad config values surface as any exception inside transformers
        raise Fp8ExportError(f"{where}: transformers cannot build {arch} from this config "
                             f"({_first_line(exc)}). Fix the values in config.json.") from exc


def missing_tensors(model, present) -> list[str]:
    """Names of ``model``'s state dict that ``present`` lacks and the model cannot do without:
    buffers it rebuilds itself and tied parameters whose alias is present are not missing."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    alias_of = {n: names for names in aliases.values() for n in names}
    tie = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    return [name for name in model.state_dict()
            if name not in present and not name.endswith(REBUILT_BUFFERS)
            and not any(a in present for a in alias_of.get(name, ()))
            and not (tie and name.endswith(("lm_head.weight", "decoder.weight",
                                                      "proj_out.weight")))]


def weight_conversions(model) -> tuple[list, list]:
    """transformers' key renamings and weight converters for ``model`` (its
    ``conversion_mapping.py`` entries, e.g. Mixtral's per-expert w1/w3 -> ``gate_up_proj``):
    ``(renamings, converters)``; none before transformers 5 (which loads checkpoints by their
    names as they are)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []

    mapping = get_model_conversion_mapping(model, add_legacy=True)
    return ([m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)])


def model_key(model, name: str, renamings: list | None = None) -> str:
    """The name checkpoint tensor ``name`` has in ``model`` after transformers' renamings only
    (no converter: a per-expert weight keeps its expert index)."""
    if renamings is None:
        renamings = weight_conversions(model)[0]
    for renaming in renamings:  # each rule in turn, as transformers applies them at load
        name, _ = renaming.rename_source_key(name)
    return name


def module_names(model, modules) -> dict[str, str]:
    """Checkpoint module name -> the model's (:func:`model_key` of its ``.weight``)."""
    renamings = weight_conversions(model)[0]
    return {m: model_key(model, f"{m}.weight", renamings).removesuffix(".weight")
            for m in modules}


def loader_linear_names(config: dict[str, Any], source: Path, modules) -> dict[str, str]:
    """Checkpoint module name -> the name of the ``nn.Linear`` transformers builds for it, for
    those of ``modules`` that transformers renames when it loads the folder.

    Composite models only (a ``text_config`` / ``vision_config`` / ``audio_config``):
    transformers 5 builds Qwen2.5-VL's ``visual.*`` as ``model.visual.*`` and LLaVA's
    ``vision_tower.*`` and ``language_model.model.*`` as ``model.vision_tower.*`` and
    ``model.language_model.*``, and compressed-tensors matches a config's ``ignore`` and
    ``targets`` against those names. A config that names checkpoint modules only (as
    llm-compressor 0.14 writes it) makes transformers quantize the kept vision tower from
    bf16 weights with no scales. Empty when transformers cannot build the architecture (then
    it cannot load the folder either)."""
    if not any(k in config for k in ("text_config", "vision_config", "audio_config")):
        return {}
    try:
        model = empty_model(config, source, meta=True)
    except Fp8ExportError:
        return {}
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return {m: n for m, n in module_names(model, modules).items() if n != m and n in linears}


def hf_state(model, tensors: Mapping[str, Any], where: Path, *, lazy: bool = False
             ) -> dict[str, Any]:
    """Checkpoint tensors by name -> the model's state dict keys, converted as transformers
    converts them at load time (renamed; per-expert weights stacked into 3-D parameters).

    ``tensors`` values are tensors (meta tensors give the shapes without any memory) or
    zero-argument callables that load one. Names no rule touches pass through unchanged (so
    missing or unexpected names are reported as before). ``lazy``: the values are callables,
    each reading (and converting) only its own tensors when called, so a caller that streams
    the state holds one expert group at a time.
    """
    renamings, converters = weight_conversions(model)
    if not renamings and not converters:  # transformers 4: names load as they are
        return _materialize(dict(tensors), lazy)
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    out: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    for name in sorted(tensors, key=dot_natural_key):  # experts 0, 1, ..., 10 in order
        target, pattern = rename_source_key(name, renamings, converters, prefix, meta)
        if target not in meta and name in meta:
            target, pattern = name, None
        if pattern is None or target not in meta:
            out[target if target in meta else name] = tensors[name]
            continue
        if target not in groups:
            groups[target] = _Group(deepcopy(by_pattern[pattern]), target, model, where)
            out[target] = groups[target].tensor
        groups[target].converter.add_tensor(target, name, pattern, tensors[name])
    return _materialize(out, lazy)


def _materialize(out: dict[str, Any], lazy: bool) -> dict[str, Any]:
    if lazy:
        return {k: (v if callable(v) else (lambda v=v: v)) for k, v in out.items()}
    return {k: (v() if callable(v) else v) for k, v in out.items()}


class _Group:
    """One transformers WeightConverter collecting a parameter's checkpoint tensors."""

    def __init__(self, converter, target: str, model, where: Path):
        self.converter, self.target, self.model, self.where = converter, target, model, where

    def tensor(self):
        try:
            result = self.converter.convert(self.target, model=self.model,
                                            config=self.model.config)
        except Exception as exc:  # stacking tensors of different shapes, a missing member
            raise Fp8ExportError(
                f"{self.where}: the tensors transformers merges into {self.target} do not fit "
                f"together ({_first_line(exc)}). The checkpoint does not match its "
                "config.json.") from exc
        if set(result) != {self.target}:
            raise Fp8ExportError(f"{self.where}: transformers converts the tensors of "
                                 f"{self.target} into {sorted(result)[:3]}, which fp8export does "
                                 "not load. Convert a checkpoint of a supported layout.")
        value = result[self.target]
        return value[0] if isinstance(value, list) else value


def converted_shapes(model, shapes: Mapping[str, tuple[int, ...]], where: Path
                     ) -> dict[str, tuple[int, ...]]:
    """``shapes`` (checkpoint names) as the model's parameters will have them after
    :func:`hf_state`: computed on meta tensors, so nothing is allocated."""
    metas = {k: torch.empty(tuple(v), device="meta") for k, v in shapes.items()}
    return {k: tuple(t.shape) for k, t in hf_state(model, metas, where).items()}


def check_shapes(model, shapes: Mapping[str, tuple[int, ...]], source: Path) -> None:
    """Every parameter and stored buffer of ``model`` (built on the meta device) against the
    checkpoint's tensor shapes; raise on a mismatch, a missing tensor, or huge buffers."""
    expected = model.state_dict()
    for name, t in expected.items():
        got = shapes.get(name)
        if got is not None and tuple(got) != tuple(t.shape):
            raise Fp8ExportError(
                f"{source}: tensor {name} has shape {tuple(got)} but the architecture in "
                f"config.json expects {tuple(t.shape)}. The checkpoint does not match its "
                "config.json.")
    missing = missing_tensors(model, shapes)
    if missing:
        raise Fp8ExportError(
            f"{source}: {len(missing)} weights the architecture needs are missing, e.g. "
            f"{missing[:3]}. The checkpoint does not match its config.json.")
    buffers = [(n, b) for n, b in model.named_buffers() if n not in expected]
    total = sum(b.numel() * b.element_size() for _, b in buffers)
    if total > MAX_BUFFER_BYTES:
        name, big = max(buffers, key=lambda nb: nb[1].numel())
        raise Fp8ExportError(
            f"{config_file(source)}: the architecture would allocate {total / 2**30:.1f} GiB of "
            f"buffers from config values alone (e.g. {name} {tuple(big.shape)}); a size in "
            "config.json (max_position_embeddings?) is absurd. Restore the model's config.json.")


def empty_model(config: dict[str, Any], source: Path, dtype: torch.dtype = torch.float32, *,
                shapes: Mapping[str, tuple[int, ...]] | None = None, empty: bool = False,
                meta: bool = False):
    """Instantiate the architecture of ``config`` with random weights (no download).

    ``empty``: parameters stay on the meta device (buffers are real), to be loaded onto the
    devices of a plan (``fp8export.placement``). ``meta``: everything on the meta device (for
    its module names and shapes only; nothing allocated).

    With ``shapes`` (tensor name → shape of the checkpoint that will be loaded into it) the
    architecture is first built on the meta device and checked against them
    (:func:`check_shapes`), so nothing is allocated for a config that does not fit the weights.
    """
    import transformers

    where = config_file(source)
    task = task_of(config)
    auto_name = _AUTO_CLASSES[task]
    if shapes is not None:
        _check_counts(config, list(shapes), where)
    cfg = hf_config(config, source)
    if task == "causal-lm":
        auto_name = _generative_auto(cfg, (config.get("architectures") or [""])[0])
    auto = getattr(transformers, auto_name)
    if type(cfg) not in auto._model_mapping:
        _refuse_remote_code(config, where, (auto_name,),
                            f"building {config.get('model_type')} as {auto_name}")
        raise Fp8ExportError(f"{source}: transformers has no {task} class for model_type "
                             f"{config.get('model_type')!r}. Check 'architectures' in config.json.")
    if any(rc.entry in (auto_name, "AutoConfig") for rc in remote_code_entries(config, where)):
        info(f"Note: {where}: 'auto_map' ignored; transformers' own "
             f"{type(cfg).__name__.removesuffix('Config')} implementation is used "
             "(trust_remote_code=False).")
    arch = (config.get("architectures") or [config.get("model_type")])[0]
    if not meta:  # names and shapes need no forward
        _refuse_broken_forward(arch, where)
    if shapes is not None or meta:
        on_meta = _build(auto, cfg, dtype, where, arch, meta=True)
        if shapes is not None:
            check_shapes(on_meta, converted_shapes(on_meta, shapes, source), source)
        if meta:
            return on_meta.eval()
    return _build(auto, cfg, dtype, where, arch, meta=False, empty=empty).eval()


def _refuse_broken_forward(arch: str, where: Path) -> None:
    """Architectures whose forward this transformers cannot run: one line instead of a
    traceback. Llama 4's ``ForConditionalGeneration.forward`` (transformers 5.2x) builds its
    output from a field its language model never returns (``image_outputs``)."""
    if arch != "Llama4ForConditionalGeneration":
        return
    import inspect

    import transformers
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast
    from transformers.models.llama4 import modeling_llama4

    source = inspect.getsource(modeling_llama4.Llama4ForConditionalGeneration.forward)
    if "outputs.image_outputs" in source and \
            "image_outputs" not in MoeCausalLMOutputWithPast.__dataclass_fields__:
        raise Fp8ExportError(
            f"{where}: transformers {transformers.__version__} cannot run "
            "Llama4ForConditionalGeneration (its forward reads 'image_outputs', which its "
            "language model does not return), and calibrate, verify and export-onnx run the "
            "model through transformers. Convert with --scales weights (no forward needed) and "
            "verify with a transformers release whose Llama 4 forward runs.")


def _generative_auto(cfg, arch: str) -> str:
    """The auto class of ``_GENERATIVE_AUTOS`` that builds ``arch`` for ``cfg`` (else the
    first that knows the config; AutoModelForCausalLM when none does)."""
    import transformers

    known = []
    for name in _GENERATIVE_AUTOS:
        auto = getattr(transformers, name, None)
        if auto is None or type(cfg) not in auto._model_mapping:
            continue
        built = auto._model_mapping[type(cfg)]
        if any(c.__name__ == arch for c in (built if isinstance(built, (list, tuple))
                                            else (built,))):
            return name
        known.append(name)
    return known[0] if known else _AUTO_CLASSES["causal-lm"]


def model_inputs(model, ids, mask, extras, device) -> dict[str, Any]:
    """The forward's keyword arguments for one batch: the tokens, and the tensors the model's
    processor made (pixels, audio features). An encoder-decoder (Whisper) reads the tokens as
    its decoder's and needs its encoder's input from the data."""
    dtype = getattr(model, "dtype", None)
    extras = {k: (v.to(device, dtype=dtype if v.is_floating_point() and dtype else v.dtype)
                  if isinstance(v, torch.Tensor) else v) for k, v in (extras or {}).items()}
    cfg = getattr(model, "config", None)
    if not getattr(cfg, "is_encoder_decoder", False):
        return {"input_ids": ids, "attention_mask": mask, **extras}
    main = getattr(model, "main_input_name", "input_ids")
    if main != "input_ids" and main not in extras:
        arch = type(model).__name__
        what = "audio" if main == "input_features" else main
        raise Fp8ExportError(
            f"{arch} is an encoder-decoder whose encoder reads {what}, and the data holds text "
            "only. Give the data as .jsonl lines with an 'audio' path (relative to the data "
            "file) and the transcript as 'text', e.g. {\"audio\": \"clip.wav\", \"text\": "
            "\"...\"}.")
    return {**extras, "decoder_input_ids": ids, "decoder_attention_mask": mask}


def refuse_quantized(ckpt, path: Path) -> None:
    """A quantized folder loaded as a plain model would run its FP8 codes without their scales."""
    from fp8export.fp8dir.formats import dialect_of

    dialect = dialect_of(ckpt.config.get("quantization_config"))
    fp8 = [t.name for t in ckpt.tensors() if t.dtype.startswith("F8")]
    if dialect is None and not fp8:
        return
    what = f"its config.json declares {dialect} quantization" if dialect else \
        f"it holds FP8 tensors ({fp8[0]}, ...)"
    raise Fp8ExportError(
        f"{path}: a quantized checkpoint ({what}); it cannot serve as the high-precision model "
        "here. Give the original bf16/fp32 checkpoint it was converted from (an FP8 folder is "
        "a verify CANDIDATE, not a REFERENCE).")


def load_model(path: str | Path, *, dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "cpu", tensors: dict[str, torch.Tensor] | None = None):
    """Build the model of the checkpoint at ``path`` and load its weights.

    Args:
        path: a checkpoint any reader opens, with a config.json.
        dtype: parameter dtype (bfloat16 reference by default).
        device: where to put the model.
        tensors: optional replacement weights by name (e.g. dequantized FP8 weights).

    Returns:
        ``(model, config_dict)``, the model in eval mode.
    """
    from fp8export.checkpoint.source import open_checkpoint

    with open_checkpoint(path) as ckpt:
        if not ckpt.config:
            raise Fp8ExportError(
                f"{path}: no config.json beside the weights, so the architecture is unknown. "
                "Put the model's config.json in the folder."
            )
        refuse_quantized(ckpt, Path(path))
        shapes = {i.name: tuple(i.shape) for i in ckpt.tensors()}
        if tensors:
            shapes.update({k: tuple(t.shape) for k, t in tensors.items() if k in shapes})
        model = empty_model(ckpt.config, Path(path), dtype=dtype, shapes=shapes)
        given = tensors or {}
        state = hf_state(model, {i.name: _loader(ckpt, i.name, given, dtype)
                                 for i in ckpt.tensors()}, Path(path))
        config = dict(ckpt.config)
    expected = model.state_dict()
    loadable = {}
    for name, t in state.items():
        if name in expected:
            if tuple(expected[name].shape) != tuple(t.shape):
                raise Fp8ExportError(
                    f"{path}: tensor {name} has shape {tuple(t.shape)} but the architecture in "
                    f"config.json expects {tuple(expected[name].shape)}."
                )
            loadable[name] = t.to(dtype) if t.is_floating_point() else t
    missing = missing_tensors(model, loadable)
    if missing:
        raise Fp8ExportError(
            f"{path}: {len(missing)} weights the architecture needs are missing, e.g. "
            f"{missing[:3]}. The checkpoint does not match its config.json."
        )
    model.load_state_dict(loadable, strict=False)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    from fp8export.cpu_gemm import fp32_linears

    return fp32_linears(model.to(device).eval(), device), config


def _loader(ckpt, name: str, given: Mapping[str, torch.Tensor], dtype: torch.dtype):
    """A callable reading tensor ``name`` (from ``given`` if there), floating ones in ``dtype``."""
    def load():
        t = given[name] if name in given else ckpt.load(name)
        return t.to(dtype) if t.is_floating_point() else t
    return load


def checkpoint_bytes(path: str | Path, itemsize: int | None) -> int:
    """Bytes of the checkpoint's tensors loaded with floating tensors at ``itemsize`` bytes
    (None: as stored; an FP8 folder keeps its E4M3 weights)."""
    from fp8export.checkpoint.source import open_checkpoint

    sizes = {"F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "F32": 4, "F64": 8}
    with open_checkpoint(path) as ckpt:
        return sum(t.numel * (itemsize if itemsize and t.dtype in ("BF16", "F16", "F32", "F64")
                              else sizes.get(t.dtype, 4)) for t in ckpt.tensors())


def load_model_spread(path: str | Path, budgets: dict[int | str, int], *,
                      dtype: torch.dtype = torch.bfloat16):
    """:func:`load_model` spread over the devices of ``budgets`` (``fp8export.placement``):
    built on the meta device, each weight read once and put straight onto its device.

    Returns ``(model, config_dict, placement)``.
    """
    from fp8export import placement
    from fp8export.checkpoint.source import open_checkpoint

    placement.need_accelerate(str(path))
    with open_checkpoint(path) as ckpt:
        if not ckpt.config:
            raise Fp8ExportError(f"{path}: no config.json beside the weights, so the "
                                 "architecture is unknown. Put the model's config.json in the "
                                 "folder.")
        refuse_quantized(ckpt, Path(path))
        shapes = {i.name: tuple(i.shape) for i in ckpt.tensors()}
        model = empty_model(ckpt.config, Path(path), dtype=dtype, shapes=shapes, empty=True)
        expected = set(model.state_dict())
        device_map = placement.plan(model, budgets, dtype)
        state = hf_state(model, {i.name: _loader(ckpt, i.name, {}, dtype)
                                 for i in ckpt.tensors()}, Path(path), lazy=True)
        placement.fill(model, device_map, ((k, load()) for k, load in state.items()
                                           if k in expected), dtype=dtype)
        config = dict(ckpt.config)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    placement.check_loaded(model, str(path))
    from fp8export.cpu_gemm import fp32_linears

    fp32_linears(model)  # before accelerate's hooks wrap the forwards; decided per call
    return model.eval(), config, placement.dispatch(model, device_map)


def load_model_placed(path: str | Path, device: str,
                      max_memory: dict[int | str, int] | None = None, *,
                      dtype: torch.dtype = torch.bfloat16):
    """:func:`load_model` on ``device``, or :func:`load_model_spread` over several devices when
    ``max_memory`` is given, or when the model does not fit one GPU and several are visible
    (:func:`fp8export.placement.budgets`).

    Returns ``(model, config_dict, placement)``; ``placement`` is None on one device, else the
    caller closes it when done.
    """
    from fp8export import placement

    weight_bytes = checkpoint_bytes(path, dtype.itemsize) if device == "cuda" else 0
    spread = placement.budgets(device, weight_bytes, max_memory)
    if spread is None:
        model, config = load_model(path, dtype=dtype, device=device)
        return model, config, None
    return load_model_spread(path, spread, dtype=dtype)
