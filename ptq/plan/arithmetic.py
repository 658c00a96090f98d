"""Bytes and FLOPs of serving a decoder: pure arithmetic, no tensors.

Weight bytes follow ptq's checkpoint layout (ptq.modules.QuantLinear, compressed-tensors'
format) tensor by tensor, so that a plan's bytes equal the files ptq writes:
- pack-quantized (W4A16, W3A16, W8A16): weight_packed int32 [out, ceil(in * bits / 32)],
  weight_scale [out, groups] in the model dtype, weight_shape int64 [2], weight_zero_point
  int32 [ceil(out * bits / 32), groups] when asymmetric, weight_g_idx int32 [in] with
  activation order "group";
- int-/float-quantized (W8A8, FP8): weight int8 / fp8 [out, in], weight_scale [out, 1]
  (per channel) or [1] (per tensor), input_scale [1] for static activations;
- a bias, and every tensor that is not a quantized Linear's weight, in the model dtype.

KV cache bytes follow ptq.kv (ptq.kv.cache.QuantizedKVLayer holds exactly these): per layer
and kv head, 16-bit caches hold K and V as 2 bytes per channel per token; fp8 / int8 one
byte (scales are per layer, shared by all requests); kivi (int4, int2) keeps the newest
tokens in 16 bits (the window: `residual` tokens and up to group_size - 1 more) and the older
ones as packed codes, with a float16 scale and minimum per group (keys per channel over
groups of G tokens, values per token over groups of G channels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ptq.kv.scheme import KVCacheScheme
from ptq.schemes import Scheme

INT32, INT64, SCALE16 = 4, 8, 2  # bytes: packed words and g_idx, weight_shape, kivi scales (float16)


def linear_bytes(out_features: int, in_features: int, scheme: Scheme | None, *, dtype_bytes: int = 2,
                 bias: bool = False, g_idx: bool = False) -> int:
    """Bytes a Linear [out, in] takes in a checkpoint (and in memory) under `scheme` (None: 16-bit)."""
    total = out_features * dtype_bytes if bias else 0
    if scheme is None:
        return total + out_features * in_features * dtype_bytes
    args = scheme.weights
    groups = in_features // args.group_size if args.strategy == "group" else 1
    total += dtype_bytes * (1 if args.strategy == "tensor" else out_features * groups)  # weight_scale
    if scheme.format == "pack-quantized":
        total += out_features * math.ceil(in_features * args.num_bits / 32) * INT32 + 2 * INT64
        if not args.symmetric:
            total += math.ceil(out_features * args.num_bits / 32) * groups * INT32
    else:
        total += out_features * in_features  # one byte per weight (int8 or fp8)
    if g_idx:
        total += in_features * INT32
    acts = scheme.input_activations
    if acts is not None and not acts.dynamic:
        total += dtype_bytes  # input_scale [1]
    return total


def matmul_kind(scheme: Scheme | None) -> str:
    """Which tensor-core rate a scheme's matmuls run at: weight-only schemes compute in bf16."""
    if scheme is None or scheme.input_activations is None:
        return "bf16"
    return "fp8" if scheme.weights.type == "float" else "int8"


@dataclass(frozen=True)
class Attention:
    """The decoder's attention shape: what the KV cache and the attention FLOPs depend on."""

    layers: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int


def kv_bytes(attention: Attention, tokens: int, spec: KVCacheScheme | None, *, dtype_bytes: int = 2) -> int:
    """Bytes of one request's KV cache holding `tokens` tokens (all layers, all kv heads)."""
    per_head = _kv_bytes_per_head(attention.head_dim, tokens, spec, dtype_bytes)
    return attention.layers * attention.kv_heads * per_head


def _kv_bytes_per_head(d: int, tokens: int, spec: KVCacheScheme | None, dtype_bytes: int) -> int:
    if spec is None:
        return 2 * tokens * d * dtype_bytes
    if spec.static:
        return 2 * tokens * d  # one byte per channel, K and V
    g = spec.group_size
    quantized = max(0, (tokens - spec.residual) // g * g)
    window = tokens - quantized
    codes = 2 * quantized * d * spec.bits // 8
    key_groups = quantized // g * d if spec.keys == "channel" else quantized * (d // g)
    value_groups = quantized * (d // g)
    return 2 * window * d * 2 + codes + 2 * SCALE16 * (key_groups + value_groups)  # window: 16 bits


def kv_scale_bytes(attention: Attention, spec: KVCacheScheme | None, dtype_bytes: int = 2) -> int:
    """Bytes of the static k_scale / v_scale tensors a checkpoint stores (FP8: compressed-tensors)."""
    if spec is None or spec.scheme != "FP8":
        return 0
    per_layer = attention.kv_heads if spec.strategy == "head" else 1
    return 2 * attention.layers * per_layer * dtype_bytes


def prefill_attention_flops(attention: Attention, tokens: int) -> int:
    """QK^T and PV of a causal prefill of `tokens` tokens: 2 matmuls x 2 FLOPs x d per (query, key) pair."""
    pairs = tokens * (tokens + 1) // 2
    return 4 * attention.layers * attention.heads * attention.head_dim * pairs


def decode_attention_flops(attention: Attention, context: int) -> int:
    """QK^T and PV of one new token against `context` cached ones."""
    return 4 * attention.layers * attention.heads * attention.head_dim * context
