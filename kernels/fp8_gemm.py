"""FP8 (e4m3) W8A8: activation quantization kernel + fp8 GEMM with scales.

What it computes
    quantize_per_token_fp8(x) -> (x_q, x_scale)
        x_scale[m] = max_k |x[m, k]| / 448 (fp32; 1.0 for an all-zero row),
        x_q[m, k]  = e4m3(clamp(x[m, k] / x_scale[m], -448, 448))      round to nearest even
    quantize_static_fp8(x, scale): the same with one given per-tensor fp32 scale.
    fp8_matmul(x_q, x_scale, w, w_scale, bias)
        y[m, n] = (sum_k x_q[m, k] * w[n, k], fp32) * x_scale[m] * w_scale[n] (+ bias[n])
    w8a8_fp8_linear(x, w, w_scale, bias, input_scale): quantize x (per token when input_scale
        is None, else static per tensor), then fp8_matmul; y in x.dtype.

Data layout it reads (the compressed-tensors "float-quantized" format)
    w        float8_e4m3fn [N, K] (out, in), row-major (K-major, as Hopper's fp8 MMA wants it).
    w_scale  float [N, 1] (FP8_DYNAMIC: per channel) or [1] (FP8: per tensor).
    x_scale / input_scale  float32 [M, 1] (per token) or [1] (static per tensor).

The GEMM is the shared 8-bit kernel of int8_gemm.py (scaled_mm) run on fp8 operands with an
fp32 accumulator; the quantization kernel is act_quant.py's, shared with int8 and bit-exact to
the torch reference here (it rounds onto the e4m3 grid itself, so the cast to fp8 is exact).

Where it runs
    fp8 tl.dot needs an NVIDIA GPU with compute capability >= 8.9 (Ada, Hopper and newer);
    is_supported(device) says whether the kernels can run there. Under TRITON_INTERPRET=1 the
    interpreter runs both kernels on the CPU (it upcasts fp8 to fp16 for the dot), so the CPU
    tests exercise the real kernels. Everywhere else (older GPUs, CPU without the interpreter)
    every public function here falls back to its torch *_reference, which dequantizes and
    multiplies in fp32: same numbers, no speed. The module imports cleanly everywhere.
"""

from __future__ import annotations

import os

import torch
import triton.language as tl

from .act_quant import FP8_DTYPE, FP8_MAX, check_input, check_static_scale, quantize_rows, true_divide
from .int8_gemm import check_scaled_mm_inputs, scaled_mm

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def is_supported(device=None) -> bool:
    """True when the fp8 Triton kernels can run for tensors on `device` (default: cuda if present)."""
    if _INTERPRET:
        return True
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


# ----------------------------------------------------------------------------- quantization


def quantize_per_token_fp8(x):
    """Dynamic per-token fp8 quantization: x [..., K] -> (float8_e4m3fn [M, K], fp32 scale [M, 1])."""
    check_input(x)
    if not is_supported(x.device):
        return quantize_per_token_fp8_reference(x)
    return quantize_rows(x, None, FP8_DTYPE)


def quantize_static_fp8(x, scale):
    """Static per-tensor fp8 quantization with a given scale ([1] or scalar): -> float8_e4m3fn [M, K]."""
    check_input(x)
    scale = check_static_scale(scale, x)
    if not is_supported(x.device):
        return quantize_static_fp8_reference(x, scale)
    return quantize_rows(x, scale, FP8_DTYPE)[0]


def quantize_per_token_fp8_reference(x):
    x = x.reshape(-1, x.shape[-1]).float()  # [M, K]
    scale = true_divide(x.abs().amax(dim=1, keepdim=True), FP8_MAX.value)  # [M, 1]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (x / scale).clamp(-FP8_MAX.value, FP8_MAX.value).to(FP8_DTYPE), scale


def quantize_static_fp8_reference(x, scale):
    x = x.reshape(-1, x.shape[-1]).float()
    return (x / scale.reshape(1).float()).clamp(-FP8_MAX.value, FP8_MAX.value).to(FP8_DTYPE)


# ----------------------------------------------------------------------------- GEMM and linear


def fp8_matmul(x_q, x_scale, w, w_scale, bias=None, out_dtype=torch.bfloat16):
    """y [M, N] = (x_q [M, K] @ w [N, K]^T, fp32) * x_scale[m] * w_scale[n] + bias, in out_dtype.

    x_q, w: float8_e4m3fn; x_scale: [M, 1] or [1]; w_scale: [N, 1] or [1]; bias: [N] or None.
    """
    check_scaled_mm_inputs(x_q, x_scale, w, w_scale, bias, FP8_DTYPE)
    if not is_supported(x_q.device):
        return fp8_matmul_reference(x_q, x_scale, w, w_scale, bias, out_dtype)
    return scaled_mm(x_q, x_scale, w, w_scale, bias, out_dtype, tl.float32)


def fp8_matmul_reference(x_q, x_scale, w, w_scale, bias=None, out_dtype=torch.bfloat16):
    """Plain torch: fp8 x fp8 products are exact in fp32; sums in fp32."""
    (xs, _), (ws, _) = check_scaled_mm_inputs(x_q, x_scale, w, w_scale, bias, FP8_DTYPE)
    y = (x_q.float() @ w.float().T) * xs.float()[:, None] * ws.float()[None, :]  # [M, N]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def w8a8_fp8_linear(x, w, w_scale, bias=None, input_scale=None):
    """x [..., K] float -> [..., N] in x.dtype; per-token dynamic, or static when input_scale is given."""
    if input_scale is None:
        x_q, x_scale = quantize_per_token_fp8(x)
    else:
        x_scale = check_static_scale(input_scale, x)
        x_q = quantize_static_fp8(x, x_scale)
    y = fp8_matmul(x_q, x_scale, w, w_scale, bias=bias, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


def w8a8_fp8_linear_reference(x, w, w_scale, bias=None, input_scale=None):
    check_input(x)
    if input_scale is None:
        x_q, x_scale = quantize_per_token_fp8_reference(x)
    else:
        x_scale = check_static_scale(input_scale, x)
        x_q = quantize_static_fp8_reference(x, x_scale)
    y = fp8_matmul_reference(x_q, x_scale, w, w_scale, bias=bias, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])
