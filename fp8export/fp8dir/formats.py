"""The ``quantization_config`` dialects an FP8 folder can declare (``convert --format``).

Facts come from ``reference/fp8_checkpoint_formats.md``:
- compressed-tensors (default): ``format: float-quantized``, ``quantization_status:
  compressed``, per-tensor (or ``strategy: channel``, ``weight_scale [out, 1]``) float8
  weights, static per-tensor or dynamic activations, ``ignore``.
  Loaded by vLLM (``CompressedTensorsW8A8Fp8``) and by transformers with compressed-tensors.
- vllm: the native ``quant_method: fp8`` (AutoFP8 dialect): ``activation_scheme`` and
  ``ignored_layers``; one activation scheme for the whole model. **vLLM only**: transformers
  maps ``quant_method: fp8`` to its block-wise FineGrainedFP8 scheme (128x128 blocks, tensors
  ``weight_scale_inv`` / ``activation_scale``), so it ignores our per-tensor ``weight_scale`` /
  ``input_scale`` (it warns only that they are unexpected) and the model it builds is wrong: it
  computes wrong logits, or fails at the first forward (transformers 5.23 on CPU).
- modelopt: ``hf_quant_config.json`` (``quant_algo: FP8``, ``exclude_modules``) plus the same
  content in config.json as ModelOpt's ``convert_hf_config.py`` writes it; ModelOpt FP8 is
  static-only (vLLM's ModelOpt loader needs ``input_scale``) and scales are 0-dim.

Block-scaled weights (``--weight-granularity block``) in two dialects, both with activations
quantized dynamically per token group of ``bk``:
- compressed-tensors: weights ``strategy: block, block_structure: [bn, bk]``, inputs
  ``strategy: group, group_size: bk, dynamic: true`` (llm-compressor's FP8_BLOCK preset), scale
  tensor ``weight_scale [ceil(out/bn), ceil(in/bk)]``.
- vllm: the fine-grained dialect DeepSeek-V3 and the Qwen3-FP8 releases ship, ``quant_method:
  fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size: [bn, bk]``, scale tensor
  ``weight_scale_inv`` (a dequantization factor despite the name). vLLM and SGLang serve it and
  transformers loads it as ``FineGrainedFP8Config`` (it reads ``ignored_layers`` as
  ``modules_to_not_convert``).
"""

from __future__ import annotations

from typing import Any

from fp8export.config import OutputFormat
from fp8export.errors import Fp8ExportError

# Weight args of every group: per-tensor, symmetric, static float8 (compressed-tensors "FP8").
_CT_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
               "dynamic": False}
_CT_STATIC_INPUT = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                    "dynamic": False}
# Dynamic activations: compressed-tensors' FP8_DYNAMIC preset declares per-token dynamic input
# args, and that is what vLLM runs for any dynamic input with per-tensor weights:
# CompressedTensorsConfig._is_fp8_w8a8 returns True for any `input_quant.dynamic` once the
# weights are float/symmetric/static/tensor-or-channel ("Dynamic quantization is always
# supported if weights supported"), and CompressedTensorsW8A8Fp8 sets
# act_q_group_shape = PER_TOKEN when the input scheme is not static
# (vllm/model_executor/layers/quantization/compressed_tensors/{compressed_tensors.py,
# schemes/compressed_tensors_w8a8_fp8.py}). Declaring "token" (the default) says what the
# server runs; "tensor" (--dynamic-activations tensor) is what compressed-tensors' own forward
# then runs, vLLM still goes per token.
_CT_DYNAMIC_INPUT = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                     "dynamic": True}
_MODELOPT_ARGS = {"dynamic": False, "num_bits": 8, "type": "float"}
# FP8 KV cache, static per-tensor k_scale/v_scale per attention layer (compressed-tensors
# kv_cache_scheme with the tensor strategy; vLLM's fp8 dialect does not read the key, AutoFP8
# writes "static" as information; ModelOpt: kv_cache_quant_algo FP8).
_CT_KV = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
          "dynamic": False}


def kv_scale_names(fmt: OutputFormat, attention: str) -> tuple[str, str]:
    """Tensor names of an attention layer's ``k_scale``/``v_scale`` in ``fmt``: on the
    attention module (compressed-tensors, vLLM), or on k_proj/v_proj (ModelOpt)."""
    if fmt is OutputFormat.MODELOPT:
        return f"{attention}.k_proj.k_scale", f"{attention}.v_proj.v_scale"
    return f"{attention}.k_scale", f"{attention}.v_scale"


# Which runtimes load each dialect as what it is (reference/fp8_checkpoint_formats.md).
LOADED_BY: dict[OutputFormat, tuple[str, ...]] = {
    OutputFormat.COMPRESSED_TENSORS: ("vllm", "transformers (with compressed-tensors)"),
    OutputFormat.VLLM: ("vllm",),
    OutputFormat.MODELOPT: ("tensorrt-llm", "vllm"),
}
VLLM_ONLY = ("format vllm (quant_method fp8) is for vLLM only: transformers reads "
             "quant_method fp8 as its block-wise FP8 scheme and ignores these per-tensor scales, "
             "so the model it builds is wrong. For transformers (and vLLM) use the default "
             "--format compressed-tensors.")
# transformers (5.24) has no ModelOpt loader: an unknown quant_method is skipped with a warning
# and the E4M3 codes are loaded as if they were the weights. It raises only for a
# quantization_config without quant_method, and vLLM routes this layout by quant_method
# "modelopt" (config.json), so nothing in the folder can make transformers refuse it without
# hiding it from vLLM too: the folder says so instead.
MODELOPT_NOT_TRANSFORMERS = (
    "format modelopt (quant_method modelopt, hf_quant_config.json) is for TensorRT-LLM and vLLM "
    "only: transformers has no ModelOpt loader, skips the quantization_config with a warning and "
    "runs the E4M3 weights without their scales, so the model it builds is wrong. For "
    "transformers (and vLLM) use the default --format compressed-tensors.")


def loaded_by(fmt: OutputFormat, block: bool = False, keras: bool = False) -> list[str]:
    """Runtimes that load a folder of ``fmt`` (block-scaled or not) as what it is (``keras``:
    its config.json is a Keras model config, which only fp8export rebuilds)."""
    if keras:
        return list(KERAS_LOADERS)
    if block and fmt is OutputFormat.VLLM:
        return ["vllm", "sglang", "transformers (FineGrainedFP8)"]
    return list(LOADED_BY[fmt])


def weight_scale_name(fmt: OutputFormat, block: bool = False) -> str:
    """The suffix of a quantized module's weight scale tensor: ``weight_scale``, or the
    fine-grained dialect's ``weight_scale_inv`` for block-scaled ``--format vllm``."""
    return "weight_scale_inv" if block and fmt is OutputFormat.VLLM else "weight_scale"


def dialect_of(quantization_config: Any) -> str | None:
    """The dialect a config.json's ``quantization_config`` is written in, None if there is none.

    ``compressed-tensors``, ``vllm`` (``quant_method: fp8``), ``modelopt``, or
    ``other (<quant_method>)`` for anything else.
    """
    if not isinstance(quantization_config, dict) or not quantization_config:
        return None
    method = str(quantization_config.get("quant_method", "")).lower()
    known = {"compressed-tensors": OutputFormat.COMPRESSED_TENSORS, "fp8": OutputFormat.VLLM,
             "modelopt": OutputFormat.MODELOPT}
    return str(known[method]) if method in known else f"other ({method or 'no quant_method'})"


# A folder converted from Keras keeps the Keras model's config.json (no model_type): only
# fp8export's own runtimes rebuild that model, whatever the quantization_config dialect says.
KERAS_LOADERS = ("fp8export (verify, export-onnx)",)
KERAS_SOURCE = (
    "converted from Keras: config.json is the Keras model's config (no model_type), which "
    "transformers, vLLM and TensorRT-LLM cannot read; deploy it as an ONNX Q/DQ graph "
    "(fp8export export-onnx, for onnxruntime and TensorRT) and check the folder or the graph "
    "with fp8export verify against the .keras reference.")


def format_notes(fmt: OutputFormat, block: bool = False, keras: bool = False) -> list[str]:
    """What a user must know about the dialect they wrote (said by convert and the manifest,
    inspect and verify): which runtime would load it wrongly, or not at all. ``block``: block
    weight scales (the vllm dialect is then the fine-grained one transformers reads too);
    ``keras``: its config.json is a Keras model config."""
    if keras:
        return [KERAS_SOURCE]
    if fmt is OutputFormat.VLLM:
        return [] if block else [VLLM_ONLY]
    return [MODELOPT_NOT_TRANSFORMERS] if fmt is OutputFormat.MODELOPT else []


def scale_shape(fmt: OutputFormat) -> tuple[int, ...]:
    """Shape of every ``weight_scale`` / ``input_scale``: ``[1]``, or 0-dim for ModelOpt."""
    return () if fmt is OutputFormat.MODELOPT else (1,)


def activation_scheme(static: list[str], dynamic: list[str]) -> str:
    if static and dynamic:
        return "mixed"
    return "static" if static else "dynamic"


def _names(modules: list[str], limit: int = 5) -> str:
    more = f" and {len(modules) - limit} more" if len(modules) > limit else ""
    return ", ".join(modules[:limit]) + more


def check_supported(fmt: OutputFormat, static: list[str], dynamic: list[str],
                    per_channel: bool = False, block: tuple[int, int] | None = None) -> None:
    """Raise when ``fmt`` cannot express this mix of static and dynamic layers, per-channel
    weight scales (only compressed-tensors declares them: ``strategy: channel``), or block
    scales (compressed-tensors ``strategy: block``, vllm ``weight_block_size``)."""
    if block is not None and fmt is OutputFormat.MODELOPT:
        raise Fp8ExportError(
            "--format modelopt cannot hold block weight scales: ModelOpt's quant_algo FP8 is "
            "per-tensor with static inputs (0-dim scales). Use --format compressed-tensors "
            "(strategy: block) or --format vllm (weight_block_size, as DeepSeek-V3 ships).")
    if block is not None and static:
        raise Fp8ExportError(
            f"block weight scales run with dynamic per-token-group activations, but "
            f"{len(static)} layer(s) have static input scales ({_names(static)}).")
    if per_channel and fmt is not OutputFormat.COMPRESSED_TENSORS:
        why = ("vLLM's quant_method fp8 loader allocates one weight scale per shard "
               "(per-tensor) or a block grid" if fmt is OutputFormat.VLLM else
               "ModelOpt's quant_algo FP8 is per-tensor (0-dim scales)")
        raise Fp8ExportError(
            f"--format {fmt} cannot hold per-channel weight scales: {why}. Use --format "
            "compressed-tensors (strategy: channel, weight_scale [out, 1]) or "
            "--weight-granularity tensor.")
    if fmt is OutputFormat.MODELOPT and dynamic:
        raise Fp8ExportError(
            f"--format modelopt needs a static input scale for every quantized layer (ModelOpt "
            f"FP8 is static-only), but {len(dynamic)} layer(s) have no activation range: "
            f"{_names(dynamic)}. Give calibration data (--calib-data) or a checkpoint with FP8 "
            "training history, exclude those layers, or use --format compressed-tensors.")
    if fmt is OutputFormat.VLLM and static and dynamic:
        raise Fp8ExportError(
            f"--format vllm has one activation_scheme for the whole model, but {len(dynamic)} "
            f"layer(s) have no activation range ({_names(dynamic)}) while {len(static)} do. "
            "Use --format compressed-tensors (it records both groups), exclude those layers, "
            "or give calibration data that reaches them.")


def quantization_config(fmt: OutputFormat, *, static: list[str], dynamic: list[str],
                        ignore: list[str], tool_version: str, per_channel: bool = False,
                        kv_cache: bool = False, block: tuple[int, int] | None = None,
                        dynamic_strategy: str = "token", scale_fmt: str = "float"
                        ) -> dict[str, Any]:
    """The ``quantization_config`` object for config.json (sorted lists, no timestamps).
    ``dynamic_strategy``: how compressed-tensors' dynamic inputs are declared ("token" or
    "tensor"; block weights declare their own per-group inputs)."""
    check_supported(fmt, static, dynamic, per_channel, block)
    weights = dict(_CT_WEIGHTS, strategy="channel") if per_channel else dict(_CT_WEIGHTS)
    dynamic_input = dict(_CT_DYNAMIC_INPUT, strategy=dynamic_strategy)
    ignore = sorted(ignore)
    if block is not None:
        return _block_config(fmt, block, ignore, kv_cache, scale_fmt)
    if fmt is OutputFormat.VLLM:
        return {"quant_method": "fp8", "activation_scheme": activation_scheme(static, dynamic),
                "ignored_layers": ignore, **({"kv_cache_scheme": "static"} if kv_cache else {})}
    if fmt is OutputFormat.MODELOPT:
        return {"quant_method": "modelopt", "quant_algo": "FP8",
                "config_groups": {"group_0": {"input_activations": dict(_MODELOPT_ARGS),
                                              "weights": dict(_MODELOPT_ARGS),
                                              "targets": ["Linear"]}},
                "ignore": ignore, "producer": {"name": "fp8export", "version": tool_version},
                **({"kv_cache_scheme": dict(_MODELOPT_ARGS)} if kv_cache else {})}
    if static and dynamic:
        # One group per activation scheme, each with explicit module names (never "Linear" in
        # both: a module would match two groups). Fused siblings share an input scale, so they
        # always land in the same group — vLLM's fused-layer matching needs that.
        groups = {"group_0": _ct_group(sorted(static), _CT_STATIC_INPUT, weights),
                  "group_1": _ct_group(sorted(dynamic), dynamic_input, weights)}
    else:
        groups = {"group_0": _ct_group(["Linear"], _CT_STATIC_INPUT if static
                                       else dynamic_input, weights)}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "config_groups": groups, "ignore": ignore,
            "kv_cache_scheme": dict(_CT_KV) if kv_cache else None,
            "global_compression_ratio": None}


def _block_config(fmt: OutputFormat, block: tuple[int, int], ignore: list[str],
                  kv_cache: bool, scale_fmt: str = "float") -> dict[str, Any]:
    bn, bk = block
    if fmt is OutputFormat.VLLM:
        # DeepSeek-V3's config plus the ignore list (vLLM reads ignored_layers; transformers
        # takes it as modules_to_not_convert); scale_fmt ue8m0: F8_E8M0 scales
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [bn, bk], "ignored_layers": ignore,
                **({"scale_fmt": scale_fmt} if scale_fmt != "float" else {}),
                **({"kv_cache_scheme": "static"} if kv_cache else {})}
    weights = dict(_CT_WEIGHTS, strategy="block", block_structure=[bn, bk])
    inputs = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": bk,
              "symmetric": True, "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": _ct_group(["Linear"], inputs, weights)},
            "ignore": ignore, "kv_cache_scheme": dict(_CT_KV) if kv_cache else None,
            "global_compression_ratio": None}


def _ct_group(targets: list[str], input_args: dict[str, Any], weights: dict[str, Any],
              ) -> dict[str, Any]:
    return {"targets": targets, "weights": dict(weights),
            "input_activations": dict(input_args), "output_activations": None}


def extra_files(fmt: OutputFormat, *, ignore: list[str], tool_version: str,
                kv_cache: bool = False) -> dict[str, dict[str, Any]]:
    """Files besides config.json that the format needs (ModelOpt's ``hf_quant_config.json``)."""
    if fmt is not OutputFormat.MODELOPT:
        return {}
    return {"hf_quant_config.json": {
        "producer": {"name": "fp8export", "version": tool_version},
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" if kv_cache else None,
                         "exclude_modules": sorted(ignore)}}}


def declared_dynamic(quantization_config: Any) -> str | None:
    """How a folder's config.json says its dynamic inputs are quantized: "token" or "tensor"
    (compressed-tensors' ``strategy`` of a dynamic ``input_activations``), None when it does
    not say (other dialects, static inputs, or no config)."""
    if not isinstance(quantization_config, dict):
        return None
    groups = quantization_config.get("config_groups")
    if quantization_config.get("quant_method") != "compressed-tensors" \
            or not isinstance(groups, dict):
        return None
    for group in groups.values():
        args = group.get("input_activations") if isinstance(group, dict) else None
        if isinstance(args, dict) and args.get("dynamic") is True \
                and args.get("strategy") in ("token", "tensor"):
            return str(args["strategy"])
    return None


def loaded_scale_dtype(fmt: OutputFormat, config: dict[str, Any] | None,
                       keras: bool = False) -> str | None:
    """The dtype an engine holds this folder's weight and input scales in, where it is not
    float32: transformers' compressed-tensors loader allocates them in the model's dtype
    (``weight_scale``/``input_scale`` parameters of the weight's dtype, BF16 or F16), so an F32
    scale is rounded to it when it loads. vLLM keeps float32, as do transformers' fine-grained
    and the ModelOpt loaders: None for those dialects (and for Keras sources, which no
    transformers loader reads)."""
    if fmt is not OutputFormat.COMPRESSED_TENSORS or keras or not config:
        return None
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "").lower()
    return {"bfloat16": "BF16", "float16": "F16"}.get(dtype)


def as_loaded(scales: dict[str, Any], dtype: str | None) -> dict[str, Any]:
    """``scales`` (float32 numbers or arrays) rounded to the nearest value of ``dtype`` (round
    to nearest even, as the engine's cast does) and kept as float32: the scale a folder stores
    is then exactly the one every engine holds, and the codes are quantized with it. A value
    that would round to zero or overflow keeps its float32 value (no real scale does).
    ``"F8_E8M0"`` (UE8M0) rounds *up* to a power of two instead, as transformers' quantizer
    does (``2 ** ceil(log2(amax / 448))``): a smaller scale would clip the block's largest
    weights."""
    if dtype is None:
        return scales
    import ml_dtypes
    import numpy as np

    if dtype == "F8_E8M0":
        return {name: (np.exp2(np.ceil(np.log2(np.asarray(v, dtype=np.float32))))
                       .astype(np.float32)) for name, v in scales.items()}

    cast = ml_dtypes.bfloat16 if dtype == "BF16" else np.float16
    out = {}
    for name, value in scales.items():
        v = np.asarray(value, dtype=np.float32)
        with np.errstate(over="ignore"):
            r = v.astype(cast).astype(np.float32)
        r = np.where((r > 0) & np.isfinite(r), r, v).astype(np.float32)
        out[name] = r if np.ndim(value) else np.float32(r)
    return out
