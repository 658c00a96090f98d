"""Tensor primitives: quantization parameters, quantize, dequantize, fake-quantize.

Pure functions over tensors; they follow their inputs' device. Conventions match
compressed-tensors so that what ptq writes dequantizes to the same bits in its reader:

- integers are signed: int4 in [-8, 7]; symmetric scale = absmax / ((qmax - qmin) / 2),
  asymmetric scale = (max - min) / (qmax - qmin) with an integer zero point;
- fp8 is e4m3 with scale = absmax / 448;
- scales are rounded to the checkpoint's scale dtype BEFORE quantizing, and dequantizing
  computes `(q - zero) * scale` in that dtype, as the reader does.

Parameters come from each group's range: its min and max ("minmax"), or that range
shrunk by the factor that minimises the group's squared rounding error ("mse").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ptq.schemes import QuantArgs

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
OBSERVERS = ("minmax", "mse")
MSE_COARSE = tuple(1 - i / 50 for i in range(10))  # 1.00, 0.98, ..., 0.82 of the min-max range
MSE_FINE = 0.01  # then the factors beside the best coarse one


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized [out, in] weight: what every algorithm returns and the writer packs."""

    q: Tensor  # [out, in] int8 (int schemes) or float8_e4m3fn (float schemes)
    scale: Tensor  # [out, n_groups] in the checkpoint's scale dtype; [1, 1] per tensor
    zero: Tensor | None  # [out, n_groups] int8, asymmetric only
    g_idx: Tensor | None  # [in] int32, group of each input column (activation order "group")
    args: QuantArgs
    actorder: str | None = None
    observer: str = "minmax"  # how the scales were chosen (recorded in the checkpoint config)

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


def observer_used(observer: str, args: QuantArgs) -> str:
    """The observer that really sets args' scales: float (fp8) schemes are always min-max."""
    return observer if args.type == "int" else "minmax"


def qparams_mse(
    x: Tensor,
    args: QuantArgs,
    scale_dtype: torch.dtype,
    importance: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Parameters of the groups x [..., members]: for each group, its min-max range shrunk
    by the factor (1.00 down to 0.81, in steps of 0.01) that minimises
    Σ importance · (x - x̂)² over its members.

    The search is coarse to fine: every other factor (MSE_COARSE), then the two beside each
    group's best. importance: non-negative weights broadcastable to x (e.g. diag H of the
    input columns the members multiply); None weighs all members alike. Ties keep the wider
    range, so a group that rounds best unshrunk gets its min-max parameters. Float (fp8)
    schemes have no rounding grid to fit a range to: they get min-max parameters.
    """
    x = x.float()
    lo, hi = x.amin(dim=-1), x.amax(dim=-1)  # [...]
    if args.type == "float":
        return qparams_from_minmax(lo, hi, args, scale_dtype)

    def fit(shrink: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # shrink [...]: per group
        scale, zero = qparams_from_minmax(lo * shrink, hi * shrink, args, scale_dtype)
        return _rounding_error(x, scale, zero, args, importance), shrink, scale, zero

    best = fit(torch.full_like(lo, MSE_COARSE[0]))
    for shrink in MSE_COARSE[1:]:
        best = _lower_error(best, fit(torch.full_like(lo, shrink)))
    center = best[1]
    for step in (MSE_FINE, -MSE_FINE):
        best = _lower_error(best, fit((center + step).clamp(max=1.0)))
    return best[2], best[3]


def _lower_error(best: tuple, candidate: tuple) -> tuple:
    """Per group, the candidate's (error, ...) where its error is strictly lower, else best's."""
    take = candidate[0] < best[0]
    return tuple(None if b is None else torch.where(take, c, b) for b, c in zip(best, candidate))


def _rounding_error(
    x: Tensor, scale: Tensor, zero: Tensor | None, args: QuantArgs, importance: Tensor | None
) -> Tensor:
    """Σ importance · (x - dequantize(quantize(x)))² over the last dim of x [..., members]."""
    s = scale.float().unsqueeze(-1)  # [..., 1]
    t = x / s
    if zero is not None:
        t = t + zero.float().unsqueeze(-1)
    t = t.round_().clamp_(args.qmin, args.qmax)
    if zero is not None:
        t = t - zero.float().unsqueeze(-1)
    error = t.mul_(s).sub_(x).square_()  # [..., members]
    if importance is not None:
        error = error.mul_(importance)
    return error.sum(dim=-1)


def compute_qparams(
    x: Tensor, args: QuantArgs, scale_dtype: torch.dtype | None = None, observer: str = "minmax"
) -> tuple[Tensor, Tensor | None]:
    """Quantization parameters of x [rows, cols]: scale and zero [rows or 1, groups]."""
    grouped = _group_view(x.float(), args)
    if observer == "mse":
        return qparams_mse(grouped, args, scale_dtype or x.dtype)
    return qparams_from_minmax(
        grouped.amin(dim=-1), grouped.amax(dim=-1), args, scale_dtype or x.dtype
    )


def expand_groups(t: Tensor, in_features: int, g_idx: Tensor | None = None) -> Tensor:
    """Per-group values t [rows, groups] spread over the input columns: [rows, in]."""
    if g_idx is not None:
        return t[:, g_idx.long()]
    return t.repeat_interleave(in_features // t.shape[1], dim=1)


def _aligned(x: Tensor, t: Tensor, g_idx: Tensor | None) -> tuple[Tensor, Tensor]:
    """x [rows, cols] and per-group values t [rows or 1, groups], shaped to broadcast: for
    consecutive groups of each row, x as [rows, groups, members] and t as [rows, groups, 1]
    (no [rows, cols] copy of t); otherwise x as it is and t spread over the columns."""
    rows, cols = x.shape
    if g_idx is None and t.shape[0] == rows and cols % t.shape[1] == 0:
        return x.reshape(rows, t.shape[1], cols // t.shape[1]), t.unsqueeze(-1)
    return x, expand_groups(t, cols, g_idx)


def quantize(
    x: Tensor, scale: Tensor, zero: Tensor | None, args: QuantArgs, g_idx: Tensor | None = None
) -> Tensor:
    """x [rows, cols] to int8 integers in [qmin, qmax], or to float8_e4m3fn for float schemes."""
    xs, s = _aligned(x.float(), scale.float(), g_idx)
    scaled = xs / s
    if args.type == "float":
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(x.shape)
    if zero is not None:
        scaled += _aligned(x, zero.float(), g_idx)[1]
    return scaled.round_().clamp_(args.qmin, args.qmax).to(torch.int8).view(x.shape)


def dequantize(
    q: Tensor, scale: Tensor, zero: Tensor | None = None, g_idx: Tensor | None = None
) -> Tensor:
    """(q - zero) * scale, computed in the scale's dtype as compressed-tensors does: [rows, cols]."""
    values, s = _aligned(q.to(scale.dtype), scale, g_idx)
    if zero is not None:
        values = values - _aligned(q, zero, g_idx)[1].to(scale.dtype)
    return (values * s).view(q.shape)


def fake_quantize(x: Tensor, args: QuantArgs, scale_dtype: torch.dtype | None = None) -> Tensor:
    """Quantize then dequantize x [rows, cols] with its own min-max parameters, in x's dtype."""
    scale, zero = compute_qparams(x, args, scale_dtype or torch.float32)
    return dequantize(quantize(x, scale, zero, args), scale, zero).to(x.dtype)
