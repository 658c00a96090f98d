"""8-bit activation quantization for W8A8, int8 or fp8 e4m3: one row-wise kernel for both.

What it computes (x [..., K] fp16 / bf16 / fp32, read as [M, K])
    per token:  scale[m] = max_k |x[m, k]| / QMAX (fp32; 1.0 for an all-zero row)
    static:     one given per-tensor fp32 scale
    int8:       q[m, k] = clamp(round_half_even(x[m, k] / scale), -128, 127)      QMAX 127
    fp8 e4m3:   q[m, k] = e4m3(clamp(x[m, k] / scale, -448, 448)), nearest even   QMAX 448

Both match their torch references (int8_gemm.py, fp8_gemm.py) bit for bit: the division is
IEEE round-to-nearest (tl.math.div_rn, not the approximate `/`), and the rounding is done
here in fp32 so that the final cast is exact whatever rounding the backend's cast uses:
int8 adds and subtracts 1.5 * 2^23 (exact for |v| < 2^22; libdevice.rint would be the usual
call, but Triton 3.9's interpreter cannot run libdevice); fp8 adds and subtracts
1.5 * 2^(e + 20), where 2^(e - 3) is the e4m3 spacing at the value's exponent e (Triton
3.9's interpreter cast truncates and mishandles mantissa carries; the GPU cast rounds to
nearest even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INT8_MAX = tl.constexpr(127.0)
FP8_MAX = tl.constexpr(448.0)
FP8_DTYPE = torch.float8_e4m3fn
_RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: v + magic - magic rounds half to even, |v| < 2^22


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
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
                          FP8: tl.constexpr, STATIC: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per row: (1) absmax -> scale unless STATIC, (2) scale, clamp, round, store."""
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    qmax = FP8_MAX if FP8 else INT8_MAX
    if STATIC:
        scale = tl.load(s_ptr).to(tl.float32)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.max(amax, axis=0), qmax)
        scale = tl.where(scale == 0.0, 1.0, scale)
        tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, scale)
        if FP8:
            v = _round_to_e4m3_grid(tl.minimum(tl.maximum(v, -qmax), qmax))  # on the grid: the cast is exact
        else:
            v = tl.minimum(tl.maximum(v, -128.0), 127.0)  # clamping first is the same: bounds are integers
            v = (v + _RINT_MAGIC) - _RINT_MAGIC  # round half to even
        tl.store(q_ptr + row * stride_qm + offs, v.to(q_ptr.dtype.element_ty), mask=offs < K)


def true_divide(x, value: float):
    """x / value rounded as IEEE division, on any device. Torch on CUDA multiplies by the
    reciprocal when the divisor is a Python number (a bit off now and then: the first GPU
    run's fp32 scales differed from the kernel's div_rn); a divisor tensor on x's device
    takes the division itself. The references' per-token scales use this."""
    return x / torch.tensor(value, dtype=x.dtype, device=x.device)


def check_input(x) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")


def check_static_scale(scale, x):
    """One float value ([1] or scalar) -> fp32 [1] on x's device."""
    if scale.numel() != 1 or not scale.is_floating_point():
        raise ValueError(f"a static input scale must be one float value (shape [1]), got "
                         f"{scale.dtype} {list(scale.shape)}")
    return scale.reshape(1).to(device=x.device, dtype=torch.float32)


def quantize_rows(x, scale, dtype):
    """x [..., K] float (check_input's) -> (q [M, K] of `dtype`, torch.int8 or FP8_DTYPE, and its
    scale): scale None -> per token (computed here, fp32 [M, 1]), else the checked static [1]."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    q = torch.empty(M, K, device=x.device, dtype=dtype)
    static = scale is not None
    if not static:
        scale = torch.empty(M, 1, device=x.device, dtype=torch.float32)
    if M > 0:
        block_k = min(1024, triton.next_power_of_2(max(K, 16)))
        _quantize_rows_kernel[(M,)](x2, q, scale, K, x2.stride(0), q.stride(0),
                                    FP8=dtype == FP8_DTYPE, STATIC=static, BLOCK_K=block_k)
    return q, scale
