"""Torch modules that compute what the supported Keras and keras_hub layers compute at inference.

Numerics follow the Keras 3 / keras_hub sources (torch backend), dropout off:

* ``LayerNormalization``: ``torch.nn.functional.layer_norm`` in float32 at least
  (``keras/src/ops/nn.py`` ``_layer_normalization``), then back to the activation dtype.
* Attention (``keras/src/layers/attention/multi_head_attention.py``): the query is multiplied by
  ``1/sqrt(head_dim)`` before ``q·kᵀ``; masked scores are *replaced* by -1e9 (-3e4 in float16,
  ``keras/src/layers/activations/softmax.py``), so a fully masked row attends uniformly, as in
  Keras; the softmax runs in float32 at least.
* keras_hub's ``TransformerDecoder`` masks causally (``i >= j``) merged with the padding mask;
  ``TransformerEncoder`` merges the padding mask of the keys with that of the queries (Keras's
  ``MultiHeadAttention`` reads the query's Keras mask). Both are post-norm unless
  ``normalize_first``.
* Activations: ``gelu`` is exact (erf), keras_hub's ``gelu_approximate`` the tanh form.

Every linear is a plain ``nn.Linear`` (weight ``[out, in]``) stored at the module path that
equals the Keras tensor prefix (``transformer_decoder.self_attention.query``), so an FP8 folder's
manifest names it, the FP8 runtime swaps it for an ``Fp8Linear`` and the ONNX exporter binds its
MatMul by provenance.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {
    "linear": lambda x: x,
    "relu": F.relu,
    "gelu": lambda x: F.gelu(x, approximate="none"),
    "gelu_approximate": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: torch.softmax(x, dim=-1),
}


def activate(name: str, x: torch.Tensor) -> torch.Tensor:
    return _ACTIVATIONS[name](x)


def frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


def linear(kernel_in_out: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding a Keras kernel ``[in, out]`` (stored transposed) and bias."""
    n_in, n_out = kernel_in_out.shape
    layer = nn.Linear(n_in, n_out, bias=bias is not None, device="meta")
    layer.weight = frozen(kernel_in_out.t())
    if bias is not None:
        layer.bias = frozen(bias)
    return layer


def _large_negative(dtype: torch.dtype) -> float:
    return -3e4 if dtype == torch.float16 else -1e9


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class Embedding(nn.Module):
    """``Embedding`` / ``ReversibleEmbedding`` (forward and, for the latter, reverse)."""

    def __init__(self, table: torch.Tensor, mask_zero: bool = False,
                 reverse_table: torch.Tensor | None = None, soft_cap: float | None = None):
        super().__init__()
        self.weight = frozen(table)  # [vocabulary, dim]
        self.reverse_weight = None if reverse_table is None else frozen(reverse_table)
        self.mask_zero, self.soft_cap = mask_zero, soft_cap

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def mask(self, ids: torch.Tensor) -> torch.Tensor | None:
        return ids != 0 if self.mask_zero else None

    def reverse(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.weight.t() if self.reverse_weight is None else self.reverse_weight
        logits = torch.matmul(x, kernel.to(x.dtype))
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return logits


class PositionEmbedding(nn.Module):
    """keras_hub ``PositionEmbedding``: the first ``T`` rows, broadcast to the input's shape."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.weight = frozen(table)  # [sequence_length, dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight[: x.shape[-2]].to(x.dtype).expand(x.shape)


class TokenAndPositionEmbedding(nn.Module):
    """keras_hub ``TokenAndPositionEmbedding``: token embedding plus position embedding."""

    def __init__(self, token_embedding: Embedding, position_embedding: PositionEmbedding):
        super().__init__()
        self.token_embedding = token_embedding
        self.position_embedding = position_embedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tokens = self.token_embedding(ids)
        return tokens + self.position_embedding(tokens)

    def mask(self, ids: torch.Tensor) -> torch.Tensor | None:
        return self.token_embedding.mask(ids)


class LayerNorm(nn.Module):
    def __init__(self, gamma: torch.Tensor | None, beta: torch.Tensor | None, epsilon: float):
        super().__init__()
        self.weight = None if gamma is None else frozen(gamma)
        self.bias = None if beta is None else frozen(beta)
        self.epsilon = epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _upcast(x)
        w = None if self.weight is None else self.weight.to(xf.dtype)
        b = None if self.bias is None else self.bias.to(xf.dtype)
        return F.layer_norm(xf, (xf.shape[-1],), w, b, self.epsilon).to(x.dtype)


class Attention(nn.Module):
    """Keras ``MultiHeadAttention`` over one sequence (self-attention), dropout off.

    ``names`` are the four projections' sublayer names (Keras: query, key, value,
    attention_output), which are also their attribute names here.
    """

    def __init__(self, projections: dict[str, nn.Linear], num_heads: int, head_dim: int):
        super().__init__()
        self.names = tuple(projections)
        for name, module in projections.items():
            self.add_module(name, module)
        self.num_heads, self.head_dim = num_heads, head_dim

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``x`` [B, T, D]; ``mask`` bool [B or 1, T, S] (True = attend) or None."""
        q_name, k_name, v_name, o_name = self.names
        b, t = x.shape[0], x.shape[1]
        heads = (b, t, self.num_heads, self.head_dim)
        # [B, H, T, hd]; MatMuls rather than Keras's einsums (same sums, TensorRT-friendly)
        q = getattr(self, q_name)(x).reshape(heads).transpose(1, 2) \
            * (1.0 / math.sqrt(self.head_dim))
        k = getattr(self, k_name)(x).reshape(heads).transpose(1, 2)
        v = getattr(self, v_name)(x).reshape(heads).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2))  # [B, H, T, S]
        if mask is not None:
            scores = torch.where(mask[:, None], scores, _large_negative(scores.dtype))
        probs = torch.softmax(_upcast(scores), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v).transpose(1, 2)  # [B, T, H, hd]
        return getattr(self, o_name)(out.reshape(b, t, self.num_heads * self.head_dim))


def causal_mask(t: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(t, device=device)
    return (i[:, None] >= i[None, :])[None]  # [1, T, S]


class TransformerBlock(nn.Module):
    """keras_hub ``TransformerEncoder`` / ``TransformerDecoder`` (self-attention only).

    ``parts`` maps the roles attention, attention_norm, ff_in, ff_out, ff_norm to
    ``(sublayer name, module)``; the names are Keras's (they differ between the two classes
    and across Keras versions), the roles are fixed.
    """

    def __init__(self, parts: dict[str, tuple[str, nn.Module]], *, decoder: bool,
                 activation: str, normalize_first: bool):
        super().__init__()
        self.roles = {}
        for role, (name, module) in parts.items():
            self.add_module(name, module)
            self.roles[role] = name
        self.decoder, self.activation, self.normalize_first = decoder, activation, \
            normalize_first

    def _part(self, role: str) -> nn.Module:
        return getattr(self, self.roles[role])

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None,
                use_causal_mask: bool = True) -> torch.Tensor:
        mask = None if padding is None else padding[:, None, :]  # keys [B, 1, S]
        if self.decoder and use_causal_mask:
            causal = causal_mask(x.shape[1], x.device)
            mask = causal if mask is None else mask & causal
        elif not self.decoder and padding is not None:
            mask = mask & padding[:, :, None]  # Keras MHA also masks by the query's mask
        residual = x
        if self.normalize_first:
            x = self._part("attention_norm")(x)
        x = self._part("attention")(x, mask) + residual
        if not self.normalize_first:
            x = self._part("attention_norm")(x)
        residual = x
        if self.normalize_first:
            x = self._part("ff_norm")(x)
        x = self._part("ff_out")(activate(self.activation, self._part("ff_in")(x))) + residual
        if not self.normalize_first:
            x = self._part("ff_norm")(x)
        return x
