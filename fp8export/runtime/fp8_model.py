"""Build a runnable torch model from an FP8 folder (docs/fp8-folder.md).

The folder is opened by the one reader (``fp8dir.reader.read_fp8_folder``): one written by
``fp8export convert``, or one another tool wrote (compressed-tensors, fine-grained ``quant_method
fp8``, ModelOpt), described the same way. The architecture comes from the folder's
``config.json`` (``quantization_config`` dropped), the high-precision tensors are loaded as they
are, and every module the manifest lists under ``quantized`` is replaced by
:class:`~fp8export.runtime.fp8_linear.Fp8Linear` holding its E4M3 weight and scales (per tensor,
per channel or per block) and its activation mode (static, or dynamic per tensor, token, token
group, or none). GPT-2 style ``in_out`` weights are transposed to ``[out, in]`` once, at load.
Members of a fused group (the manifest's ``fused_group``: q/k/v, gate/up) that share their
scales then run as one GEMM (``fp8_fused.py``).

MoE experts: transformers' fused 3-D experts modules are first replaced by one linear per
expert (:func:`fp8export.moe.unfuse_experts`), named as the folder names them after
transformers' key renamings (Mixtral's ``block_sparse_moe`` is ``mlp`` in the model), so every
quantized expert projection runs as its own ``Fp8Linear`` (gate/up of one expert as one GEMM when
they share scales); ``info["moe"]`` says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fp8export.errors import Fp8ExportError
from fp8export.fp8dir.reader import read_fp8_folder
from fp8export.runtime.fp8_fused import Fp8FusedLinear, fuse_projections
from fp8export.runtime.fp8_linear import DYNAMIC, MODES, Fp8Linear, scaled_mm_available


def resolve_mode(mode: str, device: torch.device) -> str:
    """"auto" → "scaled_mm" where the GPU has FP8 GEMMs, else "emulate"; checks explicit modes."""
    if mode not in MODES:
        raise Fp8ExportError(f"FP8 runtime mode {mode!r} is unknown; valid: {', '.join(MODES)}.")
    if mode == "scaled_mm" and not scaled_mm_available(device):
        raise Fp8ExportError(
            f"FP8 runtime mode 'scaled_mm' needs a CUDA GPU with compute capability >= 8.9 "
            f"(Ada/Hopper/Blackwell); device {device} has none. Use mode 'emulate' or 'auto'."
        )
    if mode == "auto":
        return "scaled_mm" if scaled_mm_available(device) else "emulate"
    return mode


def make_fp8_linear(name: str, entry: dict[str, Any], tensors: dict[str, torch.Tensor], *,
                    mode: str, dtype: torch.dtype, where: Path,
                    bias: torch.Tensor | None = None, dynamic: str = "tensor") -> Fp8Linear:
    """One Fp8Linear from the manifest entry of module ``name`` and the folder's tensors
    (``bias``: the bias to use instead of the folder's ``<name>.bias``)."""
    wname = entry.get("weight", f"{name}.weight")
    try:
        w = tensors[wname]
        ws = tensors[entry.get("weight_scale_tensor") or f"{name}.weight_scale"]
    except KeyError as exc:
        raise Fp8ExportError(f"{where}: the manifest lists {name} as quantized but tensor "
                             f"{exc.args[0]} is missing. Re-run `fp8export convert`.") from None
    if w.dtype != torch.float8_e4m3fn:
        raise Fp8ExportError(f"{where}: {wname} is {w.dtype}, expected F8_E4M3.")
    if entry.get("layout", "out_in") == "in_out":
        w = w.t().contiguous()
    bias = tensors.get(f"{name}.bias") if bias is None else bias
    iname = entry.get("input_scale_tensor", f"{name}.input_scale")
    block, group = entry.get("block_size"), entry.get("group_size")
    if block:  # a side longer than the weight's is one tile (the reader's rule)
        block = (min(block[0], w.shape[0]), min(block[1], w.shape[1]))
        group = min(group, w.shape[1]) if group else group
    return Fp8Linear(w, ws, tensors.get(iname) if iname else None, bias, mode=mode,
                     out_dtype=dtype, dynamic=entry.get("dynamic") or dynamic,
                     block=tuple(block) if block else None, group_size=group)


KV_CACHE = ("auto", "fp8", "none")
ATTENTION = ("bf16", "fp8")


def load_fp8_model(fp8_dir: str | Path, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.bfloat16, mode: str = "auto", fuse: bool = True,
                   budgets: dict[int | str, int] | None = None, kv_cache: str = "auto",
                   attention: str = "bf16"):
    """Build the FP8 folder's model with quantized linears as :class:`Fp8Linear`.

    Args:
        fp8_dir: folder written by ``fp8export convert`` (has ``fp8export.json``).
        device: where to run.
        dtype: dtype of everything left in high precision and of each Fp8Linear's output.
        mode: "auto" (``torch._scaled_mm`` on CC >= 8.9, emulation elsewhere), "emulate" or
            "scaled_mm".
        fuse: run each fused group (q/k/v, gate/up) whose members share scales as one GEMM.
        budgets: spread the model over these devices (``fp8export.placement``); ``device`` is
            then only where the FP8 path is decided (the first GPU).
        kv_cache: "auto" (the FP8 KV cache where the folder has k/v scales), "fp8" (required:
            an error without them) or "none" (16-bit keys and values).
        attention: "bf16", or "fp8" (FP8 attention on the FP8 KV cache; needs its scales):
            ``runtime/attention.py``.

    Returns:
        ``(model, config, manifest, info)``; ``info`` says which path ran and which layers fell
        back to emulation, and why (JSON-serialisable); spread, ``info["placement"]`` is the
        :class:`~fp8export.placement.Placement` (its ``describe()`` for reports).
    """
    from fp8export.keras_model.config import is_keras_config

    where = Path(fp8_dir)
    dev = torch.device(device)
    resolved = resolve_mode(mode, dev)
    folder = read_fp8_folder(where)  # validated: weights, scales, block grids, modes
    manifest, config, fmt = folder.manifest, folder.config, folder.format
    if is_keras_config(config):
        folder.close()
        return _load_keras_fp8(where, dev, dtype, resolved)
    from fp8export.models import empty_model, model_key, weight_conversions
    from fp8export.moe import expert_summary, unfuse_experts

    if budgets is not None:
        from fp8export.placement import need_accelerate

        need_accelerate(str(where))
    quantized = manifest.get("quantized") or {}
    with folder.tensors as tensors:
        model = empty_model(config, where, dtype=dtype, shapes=tensors.shapes(),
                            empty=budgets is not None)
        renamings = weight_conversions(model)[0]
        stored_fused = [n for n in tensors.shapes() if model_key(model, n, renamings).endswith(
            (".experts.gate_up_proj", ".experts.down_proj"))]
        if not stored_fused:  # per-expert tensors: one linear per expert projection
            unfuse_experts(model)
        names = {m: model_key(model, f"{m}.weight", renamings).removesuffix(".weight")
                 for m in quantized}
        fallbacks = swap_fp8_linears(model, quantized, tensors, mode=resolved, dtype=dtype,
                                     where=where, dynamic=dynamic_of(manifest, where, config),
                                     names=names)
        state = model.state_dict()
        loadable = {}
        for name, shape in tensors.shapes().items():
            if name.rpartition(".")[0] in quantized:
                continue  # weight, scales and bias already inside the Fp8Linear
            key = model_key(model, name, renamings)
            if key in state:
                if tuple(state[key].shape) != shape:
                    raise Fp8ExportError(f"{where}: tensor {key} has shape {shape} but the "
                                         f"architecture expects {tuple(state[key].shape)}.")
                t = tensors[name]
                loadable[key] = t.to(dtype) if t.is_floating_point() else t
    swapped = set(names.values())
    missing = [k for k in state if k not in loadable and k.rpartition(".")[0] not in swapped]
    tied = set()
    if getattr(model.config, "tie_word_embeddings", False):
        tied = {k for k in missing if k.endswith(("lm_head.weight", "decoder.weight",
                                                    "proj_out.weight"))}
    missing = [k for k in missing if k not in tied
               and not k.endswith(("inv_freq", "position_ids", "original_inv_freq"))]
    if missing:
        raise Fp8ExportError(f"{where}: {len(missing)} tensors the architecture needs are "
                             f"missing, e.g. {missing[:3]}. Re-run `fp8export convert`.")
    if budgets is None:
        model.load_state_dict(loadable, strict=False)
    else:  # parameters are on the meta device: load them (host memory, as read) one by one
        from fp8export.placement import fill

        fill(model, {"": "cpu"}, loadable.items())
    if tied:
        model.tie_weights()
    if budgets is None:
        model = model.to(dev)
        from fp8export.cpu_gemm import fp32_linears

        fp32_linears(model, dev)  # the 16-bit layers kept beside the FP8 ones
    model.eval()
    groups = fused_groups(quantized, config, names) if fuse else {}
    unfused = fuse_projections(model, groups)
    kv = emulate_kv_cache(model, manifest, tensors, where, kv_cache, attention)
    info = {"mode": resolved, "quantized_layers": len(quantized), "fallbacks": fallbacks,
            "activation_scheme": manifest.get("activation_scheme"),
            "weight_granularity": fmt.granularity, "block_size": fmt.to_dict()["block_size"],
            "dynamic_activations": fmt.dynamic or dynamic_of(manifest, where, config),
            "folder_format": fmt.describe(),
            "fused_groups": len(groups) - len(unfused), "unfused_groups": unfused,
            "kv_cache": kv, "moe": expert_summary(model) or _fused_experts(stored_fused)}
    if budgets is not None:  # planned after fusing: the fused weights are what gets placed
        from fp8export import placement
        from fp8export.cpu_gemm import fp32_linears

        fp32_linears(model)  # before accelerate's hooks wrap the forwards; decided per call

        placement.check_loaded(model, str(where))
        info["placement"] = placement.dispatch(model, placement.plan(model, budgets, dtype))
    return model, config, manifest, info


def emulate_kv_cache(model, manifest: dict[str, Any], tensors: dict[str, torch.Tensor],
                     where: Path, kv_cache: str = "auto", attention: str = "bf16") -> str | None:
    """A folder converted with ``--kv-cache fp8`` runs with its keys and values E4M3 with its own
    ``k_scale``/``v_scale`` tensors (per tensor, or one per KV head), as vLLM runs it with
    ``kv_cache_dtype="fp8"``; ``attention="fp8"`` runs FP8 attention on them. Returns the
    line ``info["kv_cache"]`` says, or None (16-bit cache)."""
    if kv_cache not in KV_CACHE or attention not in ATTENTION:
        raise Fp8ExportError(f"kv_cache must be one of {KV_CACHE} and attention one of "
                             f"{ATTENTION}; got {kv_cache!r}, {attention!r}.")
    entry = manifest.get("kv_cache")
    has = isinstance(entry, dict) and isinstance(entry.get("layers"), dict)
    if not has and (kv_cache == "fp8" or attention == "fp8"):
        raise Fp8ExportError(f"{where} has no k_scale/v_scale: an FP8 KV cache and FP8 "
                             "attention need them. Convert with `fp8export convert --kv-cache "
                             "fp8 --calib-data ...`.")
    if not has or (kv_cache == "none" and attention != "fp8"):
        return None
    from fp8export.runtime import attention as fp8_attention

    scales = {}
    for attn, layer in entry["layers"].items():
        try:
            k = tensors[str(layer["k_scale_tensor"])]
            v = tensors[str(layer["v_scale_tensor"])]
        except (KeyError, TypeError):
            raise Fp8ExportError(f"{where}: fp8export.json declares an FP8 KV cache for {attn} "
                                 "but its k_scale/v_scale tensor is missing. Re-run `fp8export "
                                 "convert --kv-cache fp8`.") from None
        scales[attn] = (k.float().reshape(-1), v.float().reshape(-1))
    per_head = any(k.numel() > 1 for k, _ in scales.values())
    fp8_attention.install(model, scales, mode="fp8" if attention == "fp8" else "kv")
    what = "per KV head" if per_head else "per tensor"
    if attention == "fp8":
        return (f"fp8 (E4M3 keys after RoPE and values, k_scale/v_scale {what}); FP8 attention "
                "(E4M3 Q·Kᵀ, fp32 softmax, P in bf16 · E4M3 V)")
    return (f"fp8 (E4M3 keys after RoPE and values, k_scale/v_scale {what}); attention in 16 "
            "bits on the dequantized cache")


def _fused_experts(names: list[str]) -> dict[str, Any] | None:
    """The MoE facts of a folder that stores its experts fused (3-D, kept in high precision)."""
    if not names:
        return None
    return {"moe_layers": len({n.rpartition(".")[0] for n in names}), "expert_gemms": {},
            "note": "experts stored fused (3-D) in the folder: kept in high precision and run "
                    "by transformers' own experts module, not in FP8"}


def dynamic_of(manifest: dict[str, Any], where: Path, config: dict[str, Any] | None = None
               ) -> str:
    """How the folder's dynamic layers scale their input: what its config.json declares
    (compressed-tensors' input strategy: what engines run), else the manifest's record, else
    "tensor" (folders written before either existed)."""
    from fp8export.fp8dir.formats import declared_dynamic

    declared = declared_dynamic((config or {}).get("quantization_config"))
    if declared is not None:
        return declared
    value = manifest.get("dynamic_activations", "tensor")
    if value not in DYNAMIC and value != "mixed":
        raise Fp8ExportError(f"{where}: fp8export.json has dynamic_activations {str(value)[:20]!r}"
                             f"; expected one of {', '.join(DYNAMIC)}. Re-run `fp8export convert`.")
    return value


def fused_groups(quantized: dict[str, Any], config: dict[str, Any] | None = None,
                 names: dict[str, str] | None = None) -> dict[str, list[str]]:
    """Fused group → its quantized members, from the manifest's ``fused_group`` fields; members
    in the family's order (q, k, v) where the family is known. ``names``: folder module name →
    the model's (after transformers' renamings); groups and members are given in model names."""
    from fp8export.scales.families import family_of, fused_group_of

    family = family_of(config)
    groups: dict[str, list[str]] = {}
    for name, entry in quantized.items():
        if entry.get("fused_group"):
            groups.setdefault(entry["fused_group"], []).append(name)
    ordered = {}
    for g, members in groups.items():
        known = fused_group_of(members[0], family)
        order = known[1] if known and known[0] == g else ()
        ordered[g] = sorted(members, key=lambda n: order.index(n) if n in order else len(order))
    if names:
        def rename(n: str) -> str:
            return names.get(n, n)

        def rename_group(g: str, members: list[str]) -> str:
            parent, _, tag = g.rpartition(".")
            new_parent = rename(members[0]).rpartition(".")[0]
            return f"{new_parent}.{tag}" if parent else g

        ordered = {rename_group(g, ms): [rename(m) for m in ms] for g, ms in ordered.items()}
    return {g: members for g, members in ordered.items() if len(members) > 1}


def swap_fp8_linears(model: torch.nn.Module, quantized: dict[str, Any],
                     tensors: dict[str, torch.Tensor], *, mode: str, dtype: torch.dtype,
                     where: Path, keep_bias: bool = False, dynamic: str = "tensor",
                     names: dict[str, str] | None = None) -> dict[str, str]:
    """Replace every manifest-listed module of ``model`` by its Fp8Linear; returns fallbacks.

    ``keep_bias``: the new layer takes the replaced module's bias (already loaded) rather than
    the folder's tensor. ``names``: folder module name → the model's, where they differ.
    """
    fallbacks = {}
    for folder_name, entry in quantized.items():
        name = (names or {}).get(folder_name, folder_name)
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise Fp8ExportError(f"{where}: the manifest quantizes {folder_name}, which the "
                                 "architecture in config.json does not have.") from None
        bias = getattr(old, "bias", None) if keep_bias else None
        new = make_fp8_linear(folder_name, entry, tensors, mode=mode, dtype=dtype, where=where,
                              bias=None if bias is None else bias.detach(), dynamic=dynamic)
        expected = _linear_shape(old)
        if expected is not None and expected != (new.out_features, new.in_features):
            raise Fp8ExportError(f"{where}: {name}.weight is {new.out_features}x{new.in_features}"
                                 f" but the architecture expects {expected[0]}x{expected[1]}.")
        if new.fallback_reason and mode == "scaled_mm":
            fallbacks[folder_name] = new.fallback_reason
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return fallbacks


def _load_keras_fp8(where: Path, device: torch.device, dtype: torch.dtype, mode: str):
    """An FP8 folder converted from Keras: the model rebuilt from its config (no Keras)."""
    from fp8export.keras_model.build import keras_model_from_folder
    from fp8export.keras_model.weights import read_folder

    with read_folder(where) as folder:
        model = keras_model_from_folder(folder, dtype)
        quantized = folder.manifest.get("quantized") or {}
        # the rebuilt layers hold the biases as the Keras layers compute with them
        fallbacks = swap_fp8_linears(model, quantized, folder.tensors, mode=mode, dtype=dtype,
                                     where=where, keep_bias=True,
                                     dynamic=dynamic_of(folder.manifest, where,
                                                        folder.config))
    info = {"mode": mode, "quantized_layers": len(quantized), "fallbacks": fallbacks,
            "activation_scheme": folder.manifest.get("activation_scheme"),
            "fused_groups": 0, "unfused_groups": {}}  # Keras runs q, k, v as separate GEMMs
    return model.to(device).eval(), folder.config, folder.manifest, info


def fp8_modules(model: torch.nn.Module) -> dict[str, Fp8Linear]:
    """The model's quantized linears by name (members of a fused group, not the group)."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, Fp8Linear) and not isinstance(m, Fp8FusedLinear)}


def _linear_shape(module: torch.nn.Module) -> tuple[int, int] | None:
    w = getattr(module, "weight", None)
    if w is None or w.dim() != 2:
        return None
    if type(module).__name__ == "Conv1D":  # GPT-2: weight [in, out]
        return (w.shape[1], w.shape[0])
    return (w.shape[0], w.shape[1])
