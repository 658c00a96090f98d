"""The passes over bf16 weights around AWQ's grid and SmoothQuant on a CPU, through the
compiled smooth_weights.c (ptq.algorithms.compiled loads it), called with ctypes.

Each is one pass where torch takes three or four over the weights (a float32 copy, |W|, the
maxima, the quotient; widen, multiply, round), with the same float32 steps, so the same
bits; each returns None where it does not run (the library missing, no AVX-512, another
dtype or layout), and the caller takes torch's steps. They run on the calling thread: they
are bound by memory, and a second thread only added calls (0.62 against 0.41 ms for a
[3072, 576] pass on a 2-core Xeon).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ptq.algorithms import compiled


def smooth_weights_for(W: Tensor) -> bool:
    """Whether smooth_weights.c takes W (abs_over_max, scale_bf16): bf16 and contiguous on a
    CPU with AVX-512, rows of a multiple of 16 columns, the library built."""
    return (W.dtype == torch.bfloat16 and W.device.type == "cpu" and W.is_contiguous() and W.dim() == 2
            and W.shape[1] % 16 == 0 and compiled.library()[0] is not None and compiled.linalg_kind() == "AVX-512")


def abs_over_max(weights: list[Tensor], size: int) -> Tensor | None:
    """|W| / (max |W| of each group of `size` columns of a row + 1e-6) in float32, the
    weights' rows stacked [Σ rows, in]: awq.weight_mean's steps, the same bits, in one pass
    (smooth_weights.c); None where it does not run (smooth_weights_for each, size a multiple
    of 16)."""
    cols = weights[0].shape[1]
    if size % 16 or cols % size or not all(smooth_weights_for(w) and w.shape[1] == cols for w in weights):
        return None
    out = torch.empty(sum(w.shape[0] for w in weights), cols, dtype=torch.float32)
    first = 0
    for w in weights:  # on this thread: a second one adds nothing to a pass bound by memory
        if compiled.library()[0].ptq_abs_over_max(w.data_ptr(), w.shape[0], cols, size, out[first].data_ptr()):
            return None
        first += w.shape[0]
    return out


def scale_bf16(W: Tensor, factor: Tensor) -> Tensor | None:
    """W · factor rounded to bf16 (factor float32 [1, in] per column or [out, 1] per row),
    as torch multiplies a widened copy and rounds it, in one pass (smooth_weights.c): a new
    tensor, or None where it does not run (smooth_weights_for)."""
    if not smooth_weights_for(W) or factor.dtype != torch.float32 or factor.device.type != "cpu":
        return None
    rows, cols = W.shape
    per_row = factor.shape == (rows, 1)
    if factor.shape not in ((1, cols), (rows, 1)):
        return None
    factor, out = factor.contiguous(), torch.empty_like(W)  # on this thread, as abs_over_max
    failed = compiled.library()[0].ptq_scale_bf16(W.data_ptr(), rows, cols, factor.data_ptr(), int(per_row),
                                                  out.data_ptr())
    return None if failed else out
