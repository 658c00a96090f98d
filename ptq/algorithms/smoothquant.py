"""SmoothQuant: move activation outliers into the weights with an exact per-channel rescaling.

For a previous op P feeding Linears W_i (y_i = W_i x, x = P(...)), and scales s > 0 over
x's channels: x' = x / s and W_i' = W_i · diag(s) give W_i' x' = W_i x exactly. Dividing x
by s is folded into P (a norm's weight and bias, or a Linear's rows and bias), so the
model computes the same function with activations that are easier to quantize.

    s_j = max|X_j|^α / max_i,k |W_i[k, j]|^(1−α)          (Xiao et al., 2022, eq. 4)

Search and apply are separate steps (as mit-han-lab/smoothquant `get_act_scales` then
`smooth_lm`): `smoothquant_scales` makes plain data from statistics, `apply_smoothing_`
folds it into the modules; AWQ applies its scales with the same function.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ptq.algorithms import smooth_compiled

MIN_SCALE = 1e-5


def smoothquant_scales(act_absmax: Tensor, weights: Sequence[Tensor], alpha: float = 0.5) -> Tensor:
    """Per-channel smoothing scales s [in], float32, from max|x| [in] and weights [out_i, in].

    The weight statistic is the max |w| of each input column over all balance Linears.
    Both statistics are clamped to ≥ 1e-5 (a dead channel or column gives no 0 or inf),
    as is s; a non-finite s (an activation statistic that overflowed) is replaced by 1.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    x_max = act_absmax.float().clamp(min=MIN_SCALE)  # [in]
    w_max = torch.cat([w.detach().abs().float().to(x_max.device) for w in weights]).amax(dim=0)  # [in]
    if w_max.shape != x_max.shape:
        raise ValueError(
            f"activation statistic has {x_max.numel()} channels, weights have {w_max.numel()} columns"
        )
    scales = x_max.pow(alpha) / w_max.clamp(min=MIN_SCALE).pow(1.0 - alpha)  # [in]
    scales = torch.where(torch.isfinite(scales), scales, torch.ones_like(scales))
    return scales.clamp(min=MIN_SCALE)


@torch.no_grad()
def apply_smoothing_(
    smooth: nn.Module,
    balance: Sequence[nn.Linear],
    scales: Tensor,
    *,
    rows: slice | None = None,
    weight_offset: float = 0.0,
) -> None:
    """Fold scales s [in] into the model, in place: smooth's output / s, balance columns · s.

    smooth is an nn.Linear (its rows and bias are divided: all of them, or `rows` when it
    is a fused Linear whose part the balance Linears read) or a norm whose output is its
    1-D weight (plus bias) times a normalized input, as LayerNorm and RMSNorm (both are
    divided). A norm computing x̂·(1 + w) (Gemma) takes weight_offset=1: (1 + w) is divided,
    w' = (1 + w) / s − 1. The arithmetic runs in float32 and is rounded once to each
    tensor's dtype.
    """
    channels = scales.numel()
    inverse = 1.0 / scales.float()  # [in]
    for linear in balance:
        if linear.in_features != channels:
            raise ValueError(f"a balance Linear reads {linear.in_features} channels, scales have {channels}")
    if isinstance(smooth, nn.Linear):
        weight = smooth.weight if rows is None else smooth.weight[rows]  # [out or part, in]: a view
        if weight.shape[0] != channels:
            raise ValueError(f"smooth Linear has {weight.shape[0]} outputs to divide, scales have {channels}")
        _scale_(weight, inverse.view(-1, 1))  # rows: [out, 1]
    else:
        weight = getattr(smooth, "weight", None)
        if rows is not None or not isinstance(weight, Tensor) or weight.shape != (channels,):
            raise ValueError(
                f"{type(smooth).__name__} has no weight of shape [{channels}] to fold scales into"
            )
        _scale_(weight, inverse, weight_offset)
    bias = getattr(smooth, "bias", None)
    if isinstance(bias, Tensor):
        _scale_(bias if rows is None else bias[rows], inverse)
    for linear in balance:
        _scale_(linear.weight, scales.float().view(1, -1))  # columns: [1, in]


def _scale_(param: Tensor, factor: Tensor, offset: float = 0.0) -> None:
    """param ← (param + offset) · factor − offset, in float32, rounded once to param's dtype."""
    scaled = None if offset else smooth_compiled.scale_bf16(param, factor)  # bf16 on a CPU: one pass, same bits
    if scaled is None:
        value = param.float()
        if offset:
            value = (value + offset) * factor.to(param.device) - offset
        else:
            value = value * factor.to(param.device)
        scaled = value.to(param.dtype)
    replace_(param, scaled)


def replace_(param: Tensor, value: Tensor) -> None:
    """Give param (a whole parameter, or a view into one) value's values. A whole one takes
    value's memory: writing into a model loaded from safetensors instead copies each page
    of the mapped file on first write, 7x the time of the arithmetic."""
    if param._base is None:
        param.data = value
    else:
        param.copy_(value)
