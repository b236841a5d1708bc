"""The FP8 KV cache: keys and values stored in E4M3, half the memory of a 16-bit cache.

``Fp8StaticCache`` is transformers' ``StaticCache`` (preallocated, updated in place, so a decode
step compiles and runs in a CUDA graph) with E4M3 storage, as vLLM stores its cache with
``kv_cache_dtype="fp8"``: each new key and value is divided by its layer's static ``k_scale``/
``v_scale`` (per tensor, or per KV head), clamped to ±448 and rounded to nearest even
(``fp8_attention.kv_write``: one launch per layer and step on the GPU). Keys are stored
``[B, Hkv, T, D]``; values transposed, ``[B, Hkv, D, T]``, so that P·V reads them K-major (what
Hopper's FP8 tensor cores take); the layer's ``values`` is the ``[B, Hkv, T, D]`` view of them.

The cache hands the attention its E4M3 tensors; the model must run the FP8 attention function
(``attention.install``, mode "kv" or "fp8"), which reads them with the same scales. Sliding-window
layers are stored at full length (the kernel masks the window), so the cache holds
``max_cache_len`` positions on every layer.
"""

from __future__ import annotations

import torch

from fp8export.errors import Fp8ExportError
from fp8export.numerics.fp8 import E4M3_DTYPE
from fp8export.runtime.fp8_attention import kv_write


def _static_layer():
    from transformers.cache_utils import StaticLayer

    class Fp8StaticLayer(StaticLayer):
        """One layer's E4M3 keys and (transposed) values, written at ``cumulative_length``."""

        values_t: torch.Tensor | None = None

        @property
        def values(self) -> torch.Tensor | None:
            """``[B, Hkv, T, D]`` view of the transposed storage, made where it is read: kept as
            an attribute, a compiled step would take it as one more input aliasing
            ``values_t``, and AOTAutograd's synthetic base for two aliased inputs, one of
            them mutated, is not a static input: Inductor then skips the CUDA graph ("mutated
            inputs")."""
            return None if self.values_t is None else self.values_t.transpose(2, 3)

        @values.setter
        def values(self, value) -> None:
            if value is not None:  # the base class sets None; the storage is values_t
                raise AttributeError("the FP8 cache stores its values in values_t")

        def __init__(self, max_cache_len: int, k_scale: torch.Tensor, v_scale: torch.Tensor):
            super().__init__(max_cache_len=max_cache_len)
            self.k_scale, self.v_scale = k_scale, v_scale

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor
                                ) -> None:
            from transformers.utils import is_torchdynamo_compiling

            self.dtype, self.device = key_states.dtype, key_states.device
            self.batch_size, self.num_heads = key_states.shape[:2]
            self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
            if self.k_scale.numel() != self.num_heads:
                raise Fp8ExportError(f"the FP8 KV cache has {self.k_scale.numel()} key scales "
                                     f"for {self.num_heads} KV heads")
            shape = (self.batch_size, self.num_heads)
            self.keys = torch.zeros((*shape, self.max_cache_len, self.k_head_dim),
                                    dtype=E4M3_DTYPE, device=self.device)
            self.values_t = torch.zeros((*shape, self.v_head_dim, self.max_cache_len),
                                        dtype=E4M3_DTYPE, device=self.device)
            self.k_scale = self.k_scale.to(self.device)
            self.v_scale = self.v_scale.to(self.device)
            self.cumulative_length = self.cumulative_length.to(self.device)
            if not is_torchdynamo_compiling():
                for t in (self.keys, self.values_t, self.cumulative_length):
                    torch._dynamo.mark_static_address(t)
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
                   **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            kv_write(key_states, value_states, self.k_scale, self.v_scale, self.keys,
                     self.values_t, self.cumulative_length)
            self.cumulative_length.add_(key_states.shape[-2])
            return self.keys, self.values

        def reset(self) -> None:
            if self.is_initialized:
                self.keys.zero_()
                self.values_t.zero_()
            self.cumulative_length.zero_()

        def nbytes(self) -> int:
            """Bytes of keys and values held (0 before the first update)."""
            if not self.is_initialized:
                return 0
            return self.keys.nbytes + self.values_t.nbytes

    return Fp8StaticLayer


def fp8_static_cache(model: torch.nn.Module, max_cache_len: int):
    """A ``transformers.Cache`` of one :class:`Fp8StaticLayer` per attention layer of
    ``model``, with the scales ``attention.install`` gave it; pass it as
    ``past_key_values``. Holds ``max_cache_len`` positions per sequence."""
    from transformers.cache_utils import Cache

    from fp8export.runtime.attention import layer_scales

    layer = _static_layer()
    scales = layer_scales(model)
    cache = Cache(layers=[layer(max_cache_len, ks, vs) for ks, vs in scales])
    return cache


def cache_bytes(cache) -> int:
    """Bytes of keys and values a (static) cache holds: ours or transformers' 16-bit one."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "nbytes"):
            total += layer.nbytes()
        elif getattr(layer, "is_initialized", False):
            total += layer.keys.nbytes + layer.values.nbytes
    return total
