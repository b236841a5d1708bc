"""Projections that share an input and scales run as one FP8 GEMM, split after it.

q/k/v (gate/up) read the same activation, and a fused group's members share one weight scale and
one input scale (DESIGN.md "Fused groups"), so ``[x·Wq, x·Wk, x·Wv] = x·[Wq; Wk; Wv]``: one
input quantize and one GEMM on the concatenated weight instead of three of each, which is what
vLLM and TensorRT-LLM run. The architecture's own code still calls ``q_proj``, ``k_proj`` and
``v_proj`` one after the other, so each member becomes an :class:`Fp8LinearSlice`: the first
member called with an activation runs the group's GEMM and keeps the other members' column
slices; a member called with that same tensor object then returns its slice without any work.
A member called with another tensor (cross-attention, a probe) recomputes, so the result is
always the member's own ``x·W``. The slices keep their module names, so per-layer hooks and
``fp8_modules`` see the same layers as before.

The fused weight is one buffer of the group (registered on the parent as ``fused_<tag>``); the
members hold no copies, and ``model.to()`` moves it once.

The members' outputs are column slices of the group's ``[M, N]`` result: strided views. Under
``torch.compile`` that costs nothing (Inductor's kernels read any strides), but in eager the
consumers' elementwise kernels (SiLU and the product of gate and up) take PyTorch's
non-vectorized path on strided inputs: on an H100 that cost 0.8 ms per 2048 tokens of a 1.1 B
Llama (``bench/results/gpu_fp8.md``), more than the fused GEMM saves once the forward is bound by
device time rather than launches. So from ``SPLIT_M`` rows an eager group quantizes its input
once and runs one GEMM per member on the member's rows of the fused weight, each into a
contiguous output; below that (launch-bound), one GEMM.
"""

from __future__ import annotations

import torch
from torch import nn

from fp8export.runtime.fp8_gemm import quantized_matmul
from fp8export.runtime.fp8_linear import Fp8Linear, dynamic_scale
from fp8export.runtime.fp8_quant import quantize_input

SPLIT_M = 4096
"""Rows from which an eager group runs one GEMM per member (see the module docstring)."""


class Fp8FusedLinear(Fp8Linear):
    """One Fp8Linear over the row-concatenated weights of its members; ``splits`` their widths."""

    def __init__(self, members: list[Fp8Linear], names: list[str]):
        first = members[0]
        bias = None
        if any(m.bias is not None for m in members):
            bias = torch.cat([m.bias if m.bias is not None else
                              m.weight.new_zeros(m.out_features, dtype=first.out_dtype)
                              for m in members])
        super().__init__(torch.cat([m.weight for m in members]), first.weight_scale,
                         first.input_scale, bias, mode=first.mode, out_dtype=first.out_dtype)
        self.splits = [m.out_features for m in members]
        self.member_names = list(names)
        self.__dict__["_slot"] = _Pending()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, splits={self.splits}"

    def output_for(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s output ``x·W_index``: from the pending group result, else fresh."""
        slot = self._slot
        pending = slot.value
        if pending is not None and pending[0] is x and pending[2] >> index & 1:
            left = pending[2] & ~(1 << index)
            slot.value = (x, pending[1], left) if left else None
            return pending[1][index]
        if self._fast is not None and x.is_cuda and x.numel() >= SPLIT_M * self.in_features \
                and not torch.compiler.is_compiling():
            outputs = self.member_outputs(x)
        else:  # forward, not __call__: hooks belong on the members; once per group
            outputs = self.forward(x).split(self.splits, dim=-1)
        slot.value = (x, outputs, ((1 << len(outputs)) - 1) & ~(1 << index))
        return outputs[index]

    def member_outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every member's output in a tensor of its own: one input quantize for the group, then
        one GEMM per member on its rows of the fused weight (views: no copies)."""
        w, wt, w_scale, s_in, bias = self._fast
        x2 = x.reshape(-1, self.in_features)
        if s_in is None:
            s_in = dynamic_scale(x2)
        a = quantize_input(x2, s_in)
        outputs, start = [], 0
        for n in self.splits:
            b = None if bias is None else bias[start:start + n]
            y = quantized_matmul(a, wt[:, start:start + n], s_in, w_scale, b, self.out_dtype)
            outputs.append(y.view(*x.shape[:-1], n))
            start += n
        return tuple(outputs)


class _Pending:
    """A group's result waiting for the members that have not taken their slice yet.

    A plain object, not module state: storing into it is one attribute store, where a module
    attribute goes through ``nn.Module.__setattr__`` (twice per group per eager forward), and
    ``torch.compile`` replays the last store after every call of a compiled graph.
    """

    value: tuple | None = None


class Fp8LinearSlice(Fp8Linear):
    """Member ``index`` of an :class:`Fp8FusedLinear`: an Fp8Linear whose weight, scales and bias
    are views of the group's, and whose forward is the group's (see the module docstring)."""

    def __init__(self, group: Fp8FusedLinear, index: int, had_bias: bool):
        nn.Module.__init__(self)  # no buffers of its own: everything lives in the group
        self.__dict__["group"] = group  # not a submodule: the parent owns the group
        self.index = index
        self.start = sum(group.splits[:index])
        self.out_features = group.splits[index]
        self.in_features = group.in_features
        self.had_bias = had_bias
        self.mode = group.mode
        self.out_dtype = group.out_dtype
        self.fallback_reason = group.fallback_reason
        # the rest of Fp8Linear's state (print(model), the emulation, verify's layer check read
        # it): a group is per-tensor, so its members are too
        self.block, self.dynamic, self.group_size = group.block, group.dynamic, group.group_size

    @property
    def rowwise(self) -> bool:
        return self.group.rowwise

    @property
    def per_tensor(self) -> bool:
        return self.group.per_tensor

    @property
    def weight(self) -> torch.Tensor:
        return self.group.weight[self.start:self.start + self.out_features]

    @property
    def weight_scale(self) -> torch.Tensor:
        return self.group.weight_scale

    @property
    def input_scale(self) -> torch.Tensor | None:
        return self.group.input_scale

    @property
    def bias(self) -> torch.Tensor | None:
        if not self.had_bias:
            return None
        return self.group.bias[self.start:self.start + self.out_features]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, slice of {self.group.member_names}[{self.index}]"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output_for(self.index, x)


def fusable(members: list[nn.Module]) -> str | None:
    """Why ``members`` cannot run as one GEMM, or None when they can."""
    if len(members) < 2:
        return "fewer than two members"
    if not all(type(m) is Fp8Linear for m in members):
        return "not all members are FP8 linears"
    first = members[0]
    if any(m.in_features != first.in_features for m in members):
        return "members have different input widths"
    if any(m.fallback_reason for m in members):
        return "a member runs in emulation (shape not a multiple of 16)"
    if any(not m.per_tensor for m in members):
        return ("members scale per output channel, per block or per token (they run as "
                "separate GEMMs)")
    if any(not torch.equal(m.weight_scale, first.weight_scale) for m in members):
        return "members have different weight scales (converted without shared group scales)"
    static = [m.input_scale is not None for m in members]
    if any(s != static[0] for s in static) or (
            static[0] and any(not torch.equal(m.input_scale, first.input_scale) for m in members)):
        return "members have different input scales (converted without shared group scales)"
    if any((m.mode, m.out_dtype, m.weight.device) != (first.mode, first.out_dtype,
                                                      first.weight.device) for m in members):
        return "members differ in mode, dtype or device"
    return None


def fuse_projections(model: nn.Module, groups: dict[str, list[str]]) -> dict[str, str]:
    """Turn each group's member Fp8Linears into slices of one :class:`Fp8FusedLinear`.

    Args:
        model: a model whose quantized linears are already Fp8Linear.
        groups: fused group name (``<parent>.<tag>``, e.g. ``model.layers.0.self_attn.qkv``)
            → member module names, in the order their outputs are concatenated.

    Returns:
        ``{group: reason}`` for each group left unfused (mismatched scales, shapes...).
    """
    skipped: dict[str, str] = {}
    for group, names in groups.items():
        parent_name, _, tag = group.rpartition(".")
        members = [model.get_submodule(n) for n in names]
        reason = fusable(members)
        parent = model.get_submodule(parent_name) if parent_name else model
        attr = f"fused_{tag}"
        if reason is None and any(n.rpartition(".")[0] != parent_name for n in names):
            reason = "members are not siblings"
        if reason is None and hasattr(parent, attr):
            reason = f"{parent_name or 'the model'} already has an attribute {attr}"
        if reason is not None:
            skipped[group] = reason
            continue
        fused = Fp8FusedLinear(members, names)
        parent.add_module(attr, fused)
        for i, (name, member) in enumerate(zip(names, members)):
            setattr(parent, name.rpartition(".")[2],
                    Fp8LinearSlice(fused, i, member.bias is not None))
    return skipped
