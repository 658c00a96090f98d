"""A quantized key/value cache for transformers models: `Cache` layers that hold low-bit bytes.

QuantizedKVCache plugs into transformers' Cache API (model(..., cache=...), generate with
greedy or sampled decoding, padded batches, beam reordering). Each layer stores the codes
in ptq.kv.quant's layout (int4 two per byte, int2 four per byte, fp8 as float8_e4m3fn)
in buffers that grow by whole blocks of tokens, so the bytes counted by stored_bytes()
are the bytes really held: codes, scales, minimums and the 16-bit residual window.

How attention reads it: by default `update` returns the dequantized keys and values and
the model's own attention runs on them (the torch reference, any device). With
fused=True (on CUDA, where the Triton kernel runs, and the model's attention set to
ATTENTION), a one-token decoding step instead hands the layer to the attention function,
which runs ptq.kernels' decode-attention kernel on the stored bytes directly, merged
with attention over the 16-bit window; prefill steps still use the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from ptq.kv import quant
from ptq.kv.scheme import KVCacheScheme

BLOCK_TOKENS = 256  # static schemes' buffers grow by this many tokens
ATTENTION = "ptq_kv"  # the attention implementation that reads the cache's bytes on decode steps


class _Buffer:
    """A tensor that grows along one dim by whole blocks; `data` is the valid part."""

    def __init__(self, block: int, dim: int):
        self.block, self.dim = block, dim
        self.storage: Tensor | None = None
        self.size = 0

    def append(self, x: Tensor) -> None:
        need = self.size + x.shape[self.dim]
        if self.storage is None or need > self.storage.shape[self.dim]:
            shape = list(x.shape)
            shape[self.dim] = -(-need // self.block) * self.block
            grown = x.new_empty(shape)
            if self.storage is not None:
                grown.narrow(self.dim, 0, self.size).copy_(self.data)
            self.storage = grown
        self.storage.narrow(self.dim, self.size, x.shape[self.dim]).copy_(x)
        self.size = need

    @property
    def data(self) -> Tensor | None:
        return None if self.storage is None else self.storage.narrow(self.dim, 0, self.size)

    def select_batch(self, index: Tensor) -> None:
        if self.storage is not None:
            self.storage = self.storage.index_select(0, index.to(self.storage.device))

    def repeat_batch(self, repeats: int) -> None:
        if self.storage is not None:
            self.storage = self.storage.repeat_interleave(repeats, dim=0)

    @property
    def nbytes(self) -> int:
        return 0 if self.storage is None else self.storage.numel() * self.storage.element_size()


class QuantizedKVLayer(DynamicLayer):
    """One attention layer's cache. Static kinds (fp8, int8) quantize every token with the
    calibrated per-head scales; kivi (int4, int2) keeps the newest tokens in 16 bits
    (self.keys / self.values) and quantizes the older ones group by group."""

    is_croppable = False

    def __init__(self, spec: KVCacheScheme, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                 fused: bool = False):
        super().__init__()
        if spec.static and (k_scale is None or v_scale is None):
            raise ValueError(f"kv_cache {spec.describe()} needs calibrated k and v scales")
        self.spec, self.fused = spec, fused
        self.k_scale = None if k_scale is None else k_scale.float()
        self.v_scale = None if v_scale is None else v_scale.float()
        self.cumulative_length = 0
        self._new_buffers()

    def _new_buffers(self) -> None:
        spec = self.spec
        if spec.static:
            self.k_codes, self.v_codes = _Buffer(BLOCK_TOKENS, 2), _Buffer(BLOCK_TOKENS, 2)
            self.buffers = [self.k_codes, self.v_codes]
            return
        # kivi's store grows by whole groups as they leave the 16-bit window: no spare capacity
        g = spec.group_size
        self.k_codes, self.v_codes = _Buffer(g, 2), _Buffer(g, 2)
        key_block = 1 if spec.keys == "channel" else g  # key scales per token group
        self.k_scales, self.k_mins = _Buffer(key_block, 2), _Buffer(key_block, 2)
        self.v_scales, self.v_mins = _Buffer(g, 2), _Buffer(g, 2)
        self.buffers = [self.k_codes, self.v_codes, self.k_scales, self.k_mins, self.v_scales, self.v_mins]

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype
        # kivi's window is kept in 16 bits whatever the compute dtype (float32 on some CPUs)
        self.window_dtype = self.dtype if self.dtype.itemsize == 2 else torch.bfloat16
        batch, heads, _, dim = key_states.shape
        self.keys = key_states.new_empty(batch, heads, 0, dim, dtype=self.window_dtype)
        self.values = value_states.new_empty(batch, heads, 0, value_states.shape[-1], dtype=self.window_dtype)
        if self.k_scale is not None:
            self.k_scale, self.v_scale = self.k_scale.to(self.device), self.v_scale.to(self.device)

    @property
    def quantized_length(self) -> int:
        """Tokens held in low-bit form (the rest, kivi's window, in 16 bits)."""
        return self.k_codes.size

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        if self.spec.static:
            self.k_codes.append(quant.quantize_static(key_states, self.k_scale, self.spec.kind))
            self.v_codes.append(quant.quantize_static(value_states, self.v_scale, self.spec.kind))
        else:
            self._append_kivi(key_states, value_states)
        attention_kwargs = kwargs.get("kwargs")
        if self.fused and key_states.shape[-2] == 1 and isinstance(attention_kwargs, dict):
            attention_kwargs["ptq_kv_layer"] = self  # the attention reads the stored bytes itself
            return key_states, value_states
        return self.dequantized()

    def _append_kivi(self, key_states: Tensor, value_states: Tensor) -> None:
        """Add the new tokens to the 16-bit window; move whole groups older than the newest
        `residual` tokens into the quantized store."""
        spec = self.spec
        self.keys = torch.cat([self.keys, key_states.to(self.window_dtype)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.window_dtype)], dim=-2)
        window = self.keys.shape[-2]
        flush = (window - spec.residual) // spec.group_size * spec.group_size
        if flush <= 0:
            return
        old_k, old_v = self.keys[..., :flush, :], self.values[..., :flush, :]
        if spec.keys == "channel":
            k = quant.quantize_channel_groups(old_k, spec.bits, spec.group_size)
        else:
            k = quant.quantize_token_groups(old_k, spec.bits, spec.group_size)
        v = quant.quantize_token_groups(old_v, spec.bits, spec.group_size)
        for buffer, tensor in zip(self.buffers, (k[0], v[0], k[1], k[2], v[1], v[2])):
            buffer.append(tensor)
        self.keys = self.keys[..., flush:, :].contiguous()
        self.values = self.values[..., flush:, :].contiguous()

    def dequantized(self) -> tuple[Tensor, Tensor]:
        """Every cached key and value, decoded, in the model's dtype (oldest first)."""
        spec, dtype = self.spec, self.dtype
        if spec.static:
            return (quant.dequantize_static(self.k_codes.data, self.k_scale, dtype),
                    quant.dequantize_static(self.v_codes.data, self.v_scale, dtype))
        if self.quantized_length == 0:
            return self.keys.to(dtype), self.values.to(dtype)
        if spec.keys == "channel":
            k = quant.dequantize_channel_groups(self.k_codes.data, self.k_scales.data, self.k_mins.data, spec.bits, dtype)
        else:
            k = quant.dequantize_token_groups(self.k_codes.data, self.k_scales.data, self.k_mins.data, spec.bits, dtype)
        v = quant.dequantize_token_groups(self.v_codes.data, self.v_scales.data, self.v_mins.data, spec.bits, dtype)
        return torch.cat([k, self.keys.to(dtype)], dim=-2), torch.cat([v, self.values.to(dtype)], dim=-2)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self._new_buffers()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        if not self.is_initialized:
            return
        for buffer in self.buffers:
            buffer.select_batch(indices)
        self.keys = self.keys[indices.to(self.keys.device)]
        self.values = self.values[indices.to(self.values.device)]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.is_initialized:
            return
        for buffer in self.buffers:
            buffer.repeat_batch(repeats)
        self.keys = self.keys.repeat_interleave(repeats, dim=0)
        self.values = self.values.repeat_interleave(repeats, dim=0)

    def offload(self):  # the quantized buffers stay where they are
        pass

    def prefetch(self):
        pass

    def stored_bytes(self) -> int:
        """Bytes this layer holds: allocated code and scale buffers, static scales, 16-bit window."""
        total = sum(buffer.nbytes for buffer in self.buffers)
        for tensor in (self.k_scale, self.v_scale, self.keys, self.values):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
        return total

    def storage(self):
        """The quantized part as ptq.kernels.kv_attention.QuantizedKV (for the decode kernel)."""
        from ptq.kernels.kv_layout import QuantizedKV

        if self.spec.static:
            return QuantizedKV(kind=self.spec.kind, k=self.k_codes.data, v=self.v_codes.data,
                               k_scale=self.k_scale, v_scale=self.v_scale, length=self.quantized_length)
        return QuantizedKV(kind=self.spec.kind, k=self.k_codes.data, v=self.v_codes.data,
                           k_scale=self.k_scales.data, v_scale=self.v_scales.data, k_zero=self.k_mins.data,
                           v_zero=self.v_mins.data, group_size=self.spec.group_size, length=self.quantized_length)


class QuantizedKVCache(Cache):
    """One QuantizedKVLayer per decoder layer. k_scales / v_scales: per layer, one float32
    scale per kv head (static schemes)."""

    def __init__(self, spec: KVCacheScheme, num_layers: int, k_scales: list[Tensor] | None = None,
                 v_scales: list[Tensor] | None = None, fused: bool = False):
        if spec.static and (k_scales is None or len(k_scales) != num_layers or len(v_scales) != num_layers):
            raise ValueError(f"kv_cache {spec.describe()}: give k and v scales for each of the {num_layers} layers")
        layers = [
            QuantizedKVLayer(spec, k_scales[i] if spec.static else None, v_scales[i] if spec.static else None, fused)
            for i in range(num_layers)
        ]
        super().__init__(layers=layers)
        self.spec = spec

    def stored_bytes(self) -> int:
        return sum(layer.stored_bytes() for layer in self.layers)


def dense_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """Bytes a 16-bit cache holds per token: 2 (K and V) x layers x kv heads x head_dim x 2."""
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * dtype_bytes
