"""Build a transformers model (architecture from config.json, weights from our readers).

Used by calibration (observe the bf16 model), verify (the reference runner) and export-onnx.
Weights go through ``open_checkpoint`` so every source kind loads the same safe way
(safetensors, or ``torch.load(weights_only=True)``) — never ``from_pretrained`` on untrusted
pickles, never a hub download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fp8export.errors import Fp8ExportError

_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


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


def hf_config(config: dict[str, Any], source: Path):
    """A transformers PretrainedConfig from a config.json dict (quantization_config dropped)."""
    from transformers import AutoConfig

    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise Fp8ExportError(f"{source}: config.json has no 'model_type'; cannot build the model.")
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except (KeyError, ValueError) as exc:
        raise Fp8ExportError(
            f"{source}: transformers does not know model_type {model_type!r} ({exc}). "
            "Upgrade transformers or convert a supported architecture."
        ) from exc


def empty_model(config: dict[str, Any], source: Path, dtype: torch.dtype = torch.float32):
    """Instantiate the architecture of ``config`` with random weights (no download)."""
    import transformers

    task = task_of(config)
    auto = {
        "causal-lm": transformers.AutoModelForCausalLM,
        "masked-lm": transformers.AutoModelForMaskedLM,
        "seq-cls": transformers.AutoModelForSequenceClassification,
        "base": transformers.AutoModel,
    }[task]
    cfg = hf_config(config, source)
    try:
        try:
            model = auto.from_config(cfg, dtype=dtype)  # transformers >= 4.56 spelling
        except TypeError:
            model = auto.from_config(cfg, torch_dtype=dtype)
    except ValueError as exc:
        raise Fp8ExportError(f"{source}: cannot build {task} model from config ({exc}).") from exc
    return model.eval()


def _refuse_quantized(ckpt, path: Path) -> None:
    """A quantized folder loaded as a plain model would run its FP8 codes without their scales."""
    from fp8export.checkpoint.formats import dialect_of

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
        _refuse_quantized(ckpt, Path(path))
        model = empty_model(ckpt.config, Path(path), dtype=dtype)
        state = {}
        for info in ckpt.tensors():
            t = tensors[info.name] if tensors and info.name in tensors else ckpt.load(info.name)
            state[info.name] = t
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
    missing = [k for k in expected if k not in loadable]
    tied = set()
    if getattr(model.config, "tie_word_embeddings", False):
        tied = {k for k in missing if k.endswith("lm_head.weight") or k.endswith("decoder.weight")}
    # Non-persistent buffers (rotary inv_freq, position_ids) are rebuilt by the model itself.
    missing = [k for k in missing if k not in tied and not k.endswith(("inv_freq", "position_ids"))]
    if missing:
        raise Fp8ExportError(
            f"{path}: {len(missing)} weights the architecture needs are missing, e.g. "
            f"{missing[:3]}. The checkpoint does not match its config.json."
        )
    model.load_state_dict(loadable, strict=False)
    if tied:
        model.tie_weights()
    return model.to(device).eval(), config
