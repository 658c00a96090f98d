"""Quantize and dequantize key/value states in the cache's storage layout (pure functions).

States are [batch, kv_heads, tokens, head_dim]. The layout is the one
ptq.kernels.kv_attention reads:
- fp8 / int8 (static): codes [B, H, T, D] (float8_e4m3fn or int8) and one float32 scale
  per kv head, x = code * scale[head] (a per-tensor scale is the same value for every head).
- int4 / int2 (kivi): unsigned codes packed along head_dim, low bits first (channel c in
  byte c // (8 // bits) at bit (c % (8 // bits)) * bits), uint8 [B, H, T, D * bits // 8];
  float16 scale and minimum per group, x = code * scale + minimum. Keys: groups of G
  tokens per channel, scale/min [B, H, T // G, D]. Values (and keys with keys: token):
  groups of G channels per token, scale/min [B, H, T, D // G].
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
INT8_MAX = 127.0
SCALE_DTYPE = torch.float16  # kivi's scales and minimums
TINY = float(torch.finfo(torch.float32).tiny)


def static_scale(absmax: Tensor, kind: str) -> Tensor:
    """The static scale that maps absmax to the largest code of the kind (fp8: 448, int8: 127)."""
    top = FP8_MAX if kind == "fp8" else INT8_MAX
    return (absmax.float() / top).clamp(min=TINY)


def quantize_static(x: Tensor, scale: Tensor, kind: str) -> Tensor:
    """Codes of x [B, H, T, D] with one scale per head [H] (float32 math)."""
    scaled = x.float() / scale.float().view(1, -1, 1, 1)
    if kind == "fp8":
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def dequantize_static(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (codes.float() * scale.float().view(1, -1, 1, 1)).to(dtype)


def pack(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes [..., D] (each < 2**bits) packed along the last dim, low bits first."""
    per_byte = 8 // bits
    grouped = codes.to(torch.uint8).unflatten(-1, (-1, per_byte))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (grouped << shifts).sum(-1, dtype=torch.uint8)


def unpack(packed: Tensor, bits: int) -> Tensor:
    """The inverse of pack: uint8 codes [..., D]."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def _minmax_codes(x: Tensor, bits: int, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric codes of x over `dim` (the group), and the float16 scale and minimum
    (keepdim) they are decoded with; the codes are computed from the stored float16 values."""
    x = x.float()
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    top = (1 << bits) - 1
    scale = ((high - low) / top).to(SCALE_DTYPE)
    minimum = low.to(SCALE_DTYPE)
    step = scale.float().masked_fill(scale == 0, 1.0)
    codes = ((x - minimum.float()) / step).round().clamp(0, top).to(torch.uint8)
    return codes, scale, minimum


def quantize_token_groups(x: Tensor, bits: int, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """x [B, H, T, D] per token over groups of `group` channels: packed codes
    [B, H, T, D * bits // 8], scale and minimum [B, H, T, D // group]."""
    grouped = x.unflatten(-1, (-1, group))
    codes, scale, minimum = _minmax_codes(grouped, bits, dim=-1)
    return pack(codes.flatten(-2), bits), scale.squeeze(-1), minimum.squeeze(-1)


def dequantize_token_groups(packed: Tensor, scale: Tensor, minimum: Tensor, bits: int, dtype: torch.dtype) -> Tensor:
    codes = unpack(packed, bits).float().unflatten(-1, (scale.shape[-1], -1))
    return (codes * scale.float().unsqueeze(-1) + minimum.float().unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_channel_groups(x: Tensor, bits: int, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """x [B, H, T, D] (T a multiple of `group`) per channel over groups of `group` tokens:
    packed codes [B, H, T, D * bits // 8], scale and minimum [B, H, T // group, D]."""
    grouped = x.unflatten(-2, (-1, group))  # [B, H, T/G, G, D]
    codes, scale, minimum = _minmax_codes(grouped, bits, dim=-2)
    return pack(codes.flatten(-3, -2), bits), scale.squeeze(-2), minimum.squeeze(-2)


def dequantize_channel_groups(packed: Tensor, scale: Tensor, minimum: Tensor, bits: int, dtype: torch.dtype) -> Tensor:
    codes = unpack(packed, bits).float().unflatten(-2, (scale.shape[-2], -1))  # [B, H, T/G, G, D]
    return (codes * scale.float().unsqueeze(-2) + minimum.float().unsqueeze(-2)).flatten(-3, -2).to(dtype)
