"""Mixture-of-experts layers as one linear module per expert.

transformers 5 runs the experts of an MoE layer as one module holding 3-D parameters
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), built at load time from the per-expert
tensors a checkpoint stores (:func:`fp8export.models.hf_state`). An FP8 checkpoint keeps one
linear per expert (``experts.N.w1/w3/w2``, ``experts.N.gate_proj/up_proj/down_proj``: the names
vLLM and TensorRT-LLM read, each with its own ``weight_scale``), so whatever works per linear
layer (calibration observers, the FP8 runtime's ``Fp8Linear``, the ONNX Q/DQ rewrite) needs the
experts as modules of their own. :func:`unfuse_experts` replaces each fused experts module by
:class:`ExpertLinears`, whose experts hold ``nn.Linear`` views of the 3-D weights under the
checkpoint's leaf names (read from transformers' own weight converters), and which computes
what transformers' eager experts compute:

* ``routed`` (default): each expert on the tokens routed to it, outputs weighted by the router
  and summed (transformers' eager loop, one GEMM per projection per hit expert);
* ``all`` (calibration): every expert on every token, so each expert's input ranges are
  observed on all calibration tokens (llm-compressor's "calibrate all experts"); the layer's
  output still takes only the routed tokens' rows, so the model computes exactly what it
  computes routed and later layers see unchanged inputs;
* ``dense`` (ONNX export): every expert on every token, weighted by the router's weights (zero
  for an expert a token was not routed to), with no data-dependent control flow, so the graph
  traces with dynamic shapes; E / top-k times the expert FLOPs of routed execution.

Each module counts the tokens routed to each expert (when ``token_counts`` is set) and the
GEMMs its experts ran by weight dtype (``gemms``), which is how verify proves expert GEMMs ran
in FP8.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from fp8export.errors import Fp8ExportError

MODES = ("routed", "all", "dense")
_LEAF = re.compile(r"experts\.\*\.(\w+)\.weight$")


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers experts module with 3-D ``gate_up_proj`` and ``down_proj`` parameters."""
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor)
            and gu.dim() == 3 and down.dim() == 3 and hasattr(module, "num_experts"))


def expert_leaves(converters: list) -> tuple[str, str, str] | None:
    """``(gate, up, down)`` leaf names of one expert on disk, from transformers' converters
    (Mixtral: w1, w3, w2; Qwen-MoE: gate_proj, up_proj, down_proj); None if they do not say."""
    gate_up = down = None
    for conv in converters:
        leaves = [m.group(1) for p in conv.source_patterns for m in [_LEAF.search(p)] if m]
        target = conv.target_patterns[0] if conv.target_patterns else ""
        if target.endswith("experts.gate_up_proj") and len(leaves) == 2:
            gate_up = tuple(leaves)
        elif target.endswith("experts.down_proj") and len(leaves) == 1:
            down = leaves[0]
    return (*gate_up, down) if gate_up and down else None


class Expert(nn.Module):
    """One expert: its gate, up and down projections under the checkpoint's leaf names."""

    def __init__(self, leaves: tuple[str, str, str], gate: nn.Module, up: nn.Module,
                 down: nn.Module):
        super().__init__()
        self.leaves = leaves
        for name, mod in zip(leaves, (gate, up, down)):
            self.add_module(name, mod)

    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        return tuple(getattr(self, n) for n in self.leaves)


def _linear(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta",
                    dtype=weight.dtype)
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)  # a view: no copy
    return lin


class ExpertLinears(nn.Module):
    """The experts of one MoE layer, one :class:`Expert` per index (see the module docstring).

    Called as transformers calls its experts module: ``(hidden_states [T, H], top_k_index
    [T, k], top_k_weights [T, k]) -> [T, H]``.
    """

    def __init__(self, fused: nn.Module, leaves: tuple[str, str, str], mode: str = "routed"):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.num_experts = int(fused.num_experts)
        self.act_fn = fused.act_fn
        self.leaves = leaves
        self.mode = mode
        gu, down = fused.gate_up_proj, fused.down_proj
        inter = gu.shape[1] // 2
        for e in range(self.num_experts):
            self.add_module(str(e), Expert(leaves, _linear(gu[e, :inter]),
                                           _linear(gu[e, inter:]), _linear(down[e])))
        self.token_counts: torch.Tensor | None = None  # int64 [E]; set to count
        self.count_rows: torch.Tensor | None = None  # rows that count (padding excluded)
        self.gemms: dict[str, int] = {}  # weight dtype -> GEMMs run

    def expert(self, e: int) -> Expert:
        return getattr(self, str(e))

    def _run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.expert(e).projections()
        h = self.act_fn(gate(x)) * up(x)
        y = down(h)
        if not torch.compiler.is_compiling():  # counted eagerly; the ONNX trace skips it
            for mod in (gate, up, down):
                key = str(mod.weight.dtype).removeprefix("torch.")
                self.gemms[key] = self.gemms.get(key, 0) + 1
        return y

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.token_counts is not None:
            idx = top_k_index if self.count_rows is None else top_k_index[self.count_rows]
            self.token_counts += torch.bincount(idx.reshape(-1).to(torch.int64).cpu(),
                                                minlength=self.num_experts)[:self.num_experts]
        if self.mode == "dense":
            return self._dense(hidden_states, top_k_index, top_k_weights)
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            mask = mask.permute(2, 1, 0)  # [E + 1, k, T]
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        experts = range(self.num_experts) if self.mode == "all" else \
            [int(i) for i in hit[:, 0] if int(i) < self.num_experts]
        for e in experts:
            pos, tok = torch.where(mask[e])
            if self.mode == "all":
                y = self._run(e, hidden_states)[tok]  # every token observed, routed rows kept
            elif tok.numel():
                y = self._run(e, hidden_states[tok])
            else:
                continue
            y = y * top_k_weights[tok, pos, None]
            final.index_add_(0, tok, y.to(final.dtype))
        return final

    def _dense(self, x: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(self.num_experts, device=x.device)
        onehot = (top_k_index.unsqueeze(-1) == ids).to(top_k_weights.dtype)  # [T, k, E]
        weights = (top_k_weights.unsqueeze(-1) * onehot).sum(dim=1)  # [T, E], 0 if not routed
        out = None
        for e in range(self.num_experts):
            y = self._run(e, x).to(torch.float32) * weights[:, e:e + 1].to(torch.float32)
            out = y if out is None else out + y
        return out.to(x.dtype)


def stores_fused_experts(names) -> bool:
    """Whether tensor ``names`` hold an experts layer as 3-D tensors (gpt-oss, Llama 4,
    Qwen3-VL-MoE checkpoints): those experts stay in high precision (``scales/select.py``)
    and run as transformers' own module, so the model keeps it fused."""
    return any(n.endswith((".experts.gate_up_proj", ".experts.down_proj")) for n in names)


def moe_modules(model: nn.Module) -> dict[str, ExpertLinears]:
    """The model's :class:`ExpertLinears` by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, ExpertLinears)}


def unfuse_experts(model: nn.Module, mode: str = "routed",
                   leaves: tuple[str, str, str] | None = None) -> dict[str, ExpertLinears]:
    """Replace every fused experts module of ``model`` by :class:`ExpertLinears` (weights are
    views of the 3-D parameters: no copy); returns them by module name (none: a dense model).
    ``leaves``: the experts' leaf names (:func:`model_leaves`), for a part of a model (one
    decoder layer) that cannot ask transformers itself.

    Raises Fp8ExportError for an experts layout this does not compute (biases, transposed or
    interleaved weights, experts without a gate): naming the class.
    """
    fused = {n: m for n, m in model.named_modules() if is_fused_experts(m)}
    if not fused:
        return {}
    leaves = leaves or model_leaves(model)
    out = {}
    for name, mod in fused.items():
        odd = [a for a, bad in (("has_bias", True), ("is_transposed", True),
                                ("has_gate", False), ("is_concatenated", False),
                                ("has_post_expert_norm", True))
               if getattr(mod, a, not bad) == bad]
        if odd:
            raise Fp8ExportError(
                f"{name}: {type(mod).__name__} experts ({', '.join(odd)}) are not supported by "
                "fp8export's per-expert runtime (it computes gate/up concatenated, untransposed, "
                "without biases). Convert with --exclude '*experts*' to keep them in high "
                "precision, or serve the folder with vLLM.")
        new = ExpertLinears(mod, leaves, mode)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        out[name] = new
    return out


def model_leaves(model: nn.Module) -> tuple[str, str, str]:
    """The (gate, up, down) leaf names a transformers model's experts have on disk."""
    from fp8export.models import weight_conversions

    return expert_leaves(weight_conversions(model)[1]) or ("gate_proj", "up_proj", "down_proj")


def expert_summary(model: nn.Module) -> dict[str, Any] | None:
    """JSON facts of the model's MoE layers: layers, experts, GEMMs run by weight dtype."""
    mods = moe_modules(model)
    if not mods:
        return None
    gemms: dict[str, int] = {}
    for m in mods.values():
        for k, v in m.gemms.items():
            gemms[k] = gemms.get(k, 0) + v
    first = next(iter(mods.values()))
    weights = sorted({str(p.weight.dtype).removeprefix("torch.") for m in mods.values()
                      for e in range(m.num_experts) for p in m.expert(e).projections()})
    return {"moe_layers": len(mods), "experts_per_layer": first.num_experts,
            "expert_weight_dtypes": weights, "expert_gemms": gemms}
