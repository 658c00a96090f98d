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
fp32 accumulator. The quantization kernel is bit-exact to its torch reference: it divides with
IEEE round-to-nearest (div_rn), then rounds the fp32 value onto the e4m3 grid itself (add and
subtract 1.5 * 2^(e + 20), where 2^(e-3) is the e4m3 spacing at the value's exponent e) so
that the final cast to fp8 is exact whatever rounding the backend's cast uses. Triton 3.9's
interpreter cast truncates and mishandles mantissa carries; the GPU cast rounds to nearest even.

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
import triton
import triton.language as tl

from .int8_gemm import check_scaled_mm_inputs, scaled_mm

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = tl.constexpr(448.0)


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


# ----------------------------------------------------------------------------- quantization kernel


@triton.jit
def _round_to_e4m3_grid(v):
    """Round fp32 v (|v| <= 448) to the nearest e4m3 value, ties to even; returns fp32."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127  # unbiased exponent of v
    e = tl.maximum(e, -6)  # below 2^-6 e4m3 is subnormal with fixed spacing 2^-9
    # magic = 1.5 * 2^(e + 20): an fp32 number whose spacing is 2^(e - 3), e4m3's spacing at v
    magic = (((e + 20 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    r = ((v + magic) - magic).to(tl.int32, bitcast=True)
    return (r | (bits & -2147483648)).to(tl.float32, bitcast=True)  # keep the sign of -0.0


@triton.jit
def _quantize_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
                         STATIC: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per row: (1) absmax -> scale unless STATIC, (2) scale, clamp, round, store."""
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(s_ptr).to(tl.float32)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX)
        scale = tl.where(scale == 0.0, 1.0, scale)
        tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        q = _round_to_e4m3_grid(v).to(q_ptr.dtype.element_ty)  # exact: v is on the grid
        tl.store(q_ptr + row * stride_qm + offs, q, mask=offs < K)


def _launch_quantize(x, scale):
    """x [..., K] float -> (x_q fp8 [M, K], scale); scale None -> per token (computed here)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    q = torch.empty(M, K, device=x.device, dtype=FP8_DTYPE)
    static = scale is not None
    if not static:
        scale = torch.empty(M, 1, device=x.device, dtype=torch.float32)
    if M > 0:
        block_k = min(1024, triton.next_power_of_2(max(K, 16)))
        _quantize_fp8_kernel[(M,)](x2, q, scale, K, x2.stride(0), q.stride(0), STATIC=static, BLOCK_K=block_k)
    return q, scale


def _check_x(x):
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")


def _check_static_scale(scale, x):
    if scale.numel() != 1 or not scale.is_floating_point():
        raise ValueError(f"a static input scale must be one float value (shape [1]), got "
                         f"{scale.dtype} {list(scale.shape)}")
    return scale.reshape(1).to(device=x.device, dtype=torch.float32)


def quantize_per_token_fp8(x):
    """Dynamic per-token fp8 quantization: x [..., K] -> (float8_e4m3fn [M, K], fp32 scale [M, 1])."""
    _check_x(x)
    if not is_supported(x.device):
        return quantize_per_token_fp8_reference(x)
    return _launch_quantize(x, None)


def quantize_static_fp8(x, scale):
    """Static per-tensor fp8 quantization with a given scale ([1] or scalar): -> float8_e4m3fn [M, K]."""
    _check_x(x)
    scale = _check_static_scale(scale, x)
    if not is_supported(x.device):
        return quantize_static_fp8_reference(x, scale)
    return _launch_quantize(x, scale)[0]


def quantize_per_token_fp8_reference(x):
    x = x.reshape(-1, x.shape[-1]).float()  # [M, K]
    scale = x.abs().amax(dim=1, keepdim=True) / FP8_MAX.value  # [M, 1]
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
        x_scale = _check_static_scale(input_scale, x)
        x_q = quantize_static_fp8(x, x_scale)
    y = fp8_matmul(x_q, x_scale, w, w_scale, bias=bias, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


def w8a8_fp8_linear_reference(x, w, w_scale, bias=None, input_scale=None):
    _check_x(x)
    if input_scale is None:
        x_q, x_scale = quantize_per_token_fp8_reference(x)
    else:
        x_scale = _check_static_scale(input_scale, x)
        x_q = quantize_static_fp8_reference(x, x_scale)
    y = fp8_matmul_reference(x_q, x_scale, w, w_scale, bias=bias, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])
