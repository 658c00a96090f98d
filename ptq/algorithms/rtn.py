"""Round-to-nearest: parameters per group from the weights alone, then round. Needs no
calibration data."""

from __future__ import annotations

import torch
from torch import Tensor

from ptq.primitives import QuantizedWeight, compute_qparams, observer_used, quantize
from ptq.schemes import QuantArgs


def rtn(weight: Tensor, args: QuantArgs, scale_dtype: torch.dtype, observer: str = "minmax") -> QuantizedWeight:
    """Quantize weight [out, in] to args with min-max (or "mse": error-minimising) parameters
    per group."""
    scale, zero = compute_qparams(weight, args, scale_dtype, observer)  # [out, groups]
    qw = quantize(weight, scale, zero, args)
    return QuantizedWeight(qw, scale, zero, None, args, observer=observer_used(observer, args))
