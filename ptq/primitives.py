"""Tensor primitives: quantization parameters, quantize, dequantize, fake-quantize.

Pure functions over tensors; they follow their inputs' device. Conventions match
compressed-tensors so that what ptq writes dequantizes to the same bits in its reader:

- integers are signed: int4 in [-8, 7]; symmetric scale = absmax / ((qmax - qmin) / 2),
  asymmetric scale = (max - min) / (qmax - qmin) with an integer zero point;
- fp8 is e4m3 with scale = absmax / 448;
- scales are rounded to the checkpoint's scale dtype BEFORE quantizing, and dequantizing
  computes `(q - zero) * scale` in that dtype, as the reader does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ptq.schemes import QuantArgs

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized [out, in] weight: what every algorithm returns and the writer packs."""

    q: Tensor  # [out, in] int8 (int schemes) or float8_e4m3fn (float schemes)
    scale: Tensor  # [out, n_groups] in the checkpoint's scale dtype; [1, 1] per tensor
    zero: Tensor | None  # [out, n_groups] int8, asymmetric only
    g_idx: Tensor | None  # [in] int32, group of each input column (activation order "group")
    args: QuantArgs
    actorder: str | None = None

    def dequantize(self) -> Tensor:
        return dequantize(self.q, self.scale, self.zero, self.g_idx)

    def with_(self, **changes) -> QuantizedWeight:
        return replace(self, **changes)


def num_groups(in_features: int, args: QuantArgs) -> int:
    if args.strategy == "group":
        assert args.group_size is not None
        if in_features % args.group_size:
            raise ValueError(
                f"group_size {args.group_size} does not divide in_features {in_features}"
            )
        return in_features // args.group_size
    return 1


def _group_view(x: Tensor, args: QuantArgs) -> Tensor:
    """View x [rows, cols] as [rows or 1, groups, members] for reductions per quantization group."""
    rows, cols = x.shape
    if args.strategy == "tensor":
        return x.reshape(1, 1, rows * cols)
    if args.strategy in ("channel", "token"):
        return x.reshape(rows, 1, cols)
    return x.reshape(rows, num_groups(cols, args), cols // num_groups(cols, args))


def qparams_from_minmax(
    xmin: Tensor, xmax: Tensor, args: QuantArgs, scale_dtype: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """Scale (rounded to scale_dtype) and zero point (int8 or None) from ranges per group."""
    xmin = xmin.float().clamp(max=0)
    xmax = xmax.float().clamp(min=0)
    tiny = torch.finfo(scale_dtype).tiny
    if args.type == "float":
        scale = (torch.maximum(-xmin, xmax) / FP8_MAX).to(scale_dtype).clamp(min=tiny)
        return scale, None
    if args.symmetric:
        absmax = torch.maximum(-xmin, xmax)
        scale = (absmax / ((args.qmax - args.qmin) / 2)).to(scale_dtype).clamp(min=tiny)
        return scale, None
    scale = ((xmax - xmin) / (args.qmax - args.qmin)).to(scale_dtype).clamp(min=tiny)
    zero = torch.round(args.qmin - xmin / scale.float()).clamp(args.qmin, args.qmax)
    return scale, zero.to(torch.int8)


def compute_qparams(
    x: Tensor, args: QuantArgs, scale_dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor | None]:
    """Min-max quantization parameters of x [rows, cols]: scale and zero [rows or 1, groups]."""
    grouped = _group_view(x.float(), args)
    return qparams_from_minmax(
        grouped.amin(dim=-1), grouped.amax(dim=-1), args, scale_dtype or x.dtype
    )


def expand_groups(t: Tensor, in_features: int, g_idx: Tensor | None = None) -> Tensor:
    """Per-group values t [rows, groups] spread over the input columns: [rows, in]."""
    if g_idx is not None:
        return t[:, g_idx.long()]
    return t.repeat_interleave(in_features // t.shape[1], dim=1)


def quantize(
    x: Tensor, scale: Tensor, zero: Tensor | None, args: QuantArgs, g_idx: Tensor | None = None
) -> Tensor:
    """x [rows, cols] to int8 integers in [qmin, qmax], or to float8_e4m3fn for float schemes."""
    s = expand_groups(scale.float(), x.shape[1], g_idx)  # [rows, cols]
    scaled = x.float() / s
    if args.type == "float":
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    if zero is not None:
        scaled = scaled + expand_groups(zero.float(), x.shape[1], g_idx)
    return torch.round(scaled).clamp(args.qmin, args.qmax).to(torch.int8)


def dequantize(
    q: Tensor, scale: Tensor, zero: Tensor | None = None, g_idx: Tensor | None = None
) -> Tensor:
    """(q - zero) * scale, computed in the scale's dtype as compressed-tensors does: [rows, cols]."""
    values = q.to(scale.dtype)
    if zero is not None:
        values = values - expand_groups(zero, q.shape[1], g_idx).to(scale.dtype)
    return values * expand_groups(scale, q.shape[1], g_idx)


def fake_quantize(x: Tensor, args: QuantArgs, scale_dtype: torch.dtype | None = None) -> Tensor:
    """Quantize then dequantize x [rows, cols] with its own min-max parameters, in x's dtype."""
    scale, zero = compute_qparams(x, args, scale_dtype or torch.float32)
    return dequantize(quantize(x, scale, zero, args), scale, zero).to(x.dtype)
