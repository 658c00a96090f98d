"""Round-to-nearest: min-max parameters per group, then round. Needs no calibration data."""

from __future__ import annotations

import torch
from torch import Tensor

from ptq.primitives import QuantizedWeight, compute_qparams, quantize
from ptq.schemes import QuantArgs


def rtn(weight: Tensor, args: QuantArgs, scale_dtype: torch.dtype) -> QuantizedWeight:
    """Quantize weight [out, in] to args with min-max parameters per group."""
    scale, zero = compute_qparams(weight, args, scale_dtype)  # [out, groups]
    return QuantizedWeight(quantize(weight, scale, zero, args), scale, zero, None, args)
