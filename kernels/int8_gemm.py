"""W8A8 int8: activation quantization + int8 GEMM with int32 accumulation.

What it computes
    quantize_per_token_int8(x) -> (x_q, x_scale)
        x_scale[m] = max_k |x[m, k]| / 127 (fp32; 1.0 for an all-zero row),
        x_q[m, k]  = clamp(round_half_even(x[m, k] / x_scale[m]), -128, 127)   int8
    quantize_static_int8(x, scale): the same with one given per-tensor fp32 scale.
    int8_matmul(x_q, x_scale, w_q, w_scale, bias)
        acc[m, n] = sum_k x_q[m, k] * w_q[n, k]                                 exact, int32
        y[m, n]   = acc[m, n] * x_scale[m] * w_scale[n] (+ bias[n])             fp32, then out_dtype
        The GEMM kernel (scaled_mm) also serves fp8_gemm.py: same tiles, fp8 operands, fp32 acc.
    w8a8_int8_linear(x, w_q, w_scale, bias, input_scale): quantize x (per token when
        input_scale is None, else static per tensor), then int8_matmul; y in x.dtype.

Data layout it reads (the compressed-tensors "int-quantized" format)
    w_q      int8 [N, K] (out, in), row-major: the B tile [BLOCK_K, BLOCK_N] is read K-major.
    w_scale  float [N, 1] (per channel) or [1] (per tensor).
    x_scale  float32 [M, 1] (per token) or [1] (per tensor).
    x        [..., K] fp16 / bf16 / fp32; x_q int8 [M, K].

The quantization kernel (act_quant.py, shared with fp8_gemm.py) matches the torch reference
bit for bit.
The GEMM is autotuned over Hopper configs on CUDA (PTQ_KERNEL_AUTOTUNE=0, read at import, keeps
the first one only); the interpreter uses one small config.
K may be any size: loads past K are masked. On a CPU tensor without TRITON_INTERPRET=1 the
wrappers raise; the *_reference functions run anywhere.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .act_quant import INT8_MAX, check_input, check_static_scale, quantize_rows, true_divide
from .tiles import grouped_tile

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_AUTOTUNE = os.environ.get("PTQ_KERNEL_AUTOTUNE", "1") != "0"


# ----------------------------------------------------------------------------- quantization


def _check_device(t, name):
    if not (t.is_cuda or _INTERPRET):
        raise RuntimeError(f"{name} runs Triton kernels and needs a CUDA tensor (got one on {t.device}); "
                           "set TRITON_INTERPRET=1 before importing ptq.kernels to emulate on CPU, "
                           "or call the matching *_reference function")


def _launch_quantize(x, scale):
    check_input(x)
    _check_device(x, "int8 activation quantization")
    return quantize_rows(x, scale, torch.int8)


def quantize_per_token_int8(x):
    """Dynamic symmetric per-token quantization: x [..., K] -> (int8 [M, K], fp32 scale [M, 1])."""
    return _launch_quantize(x, None)


def quantize_static_int8(x, scale):
    """Static per-tensor quantization with a given scale ([1] or scalar): x [..., K] -> int8 [M, K]."""
    return _launch_quantize(x, check_static_scale(scale, x))[0]


def quantize_per_token_int8_reference(x):
    x = x.reshape(-1, x.shape[-1]).float()  # [M, K]
    scale = true_divide(x.abs().amax(dim=1, keepdim=True), INT8_MAX.value)  # [M, 1]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(x / scale).clamp(-128, 127).to(torch.int8), scale


def quantize_static_int8_reference(x, scale):
    x = x.reshape(-1, x.shape[-1]).float()
    return torch.round(x / scale.reshape(1).float()).clamp(-128, 127).to(torch.int8)


# ----------------------------------------------------------------------------- GEMM kernel


@triton.jit
def _scaled_mm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, c_ptr,
    M, N, K,
    M_BUCKET,  # autotune key only (next power of two of M); the kernel does not read it
    stride_am, stride_ak, stride_bn, stride_bk, stride_as, stride_bs, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C[M, N] = (A[M, K] @ B[N, K]^T in ACC_DTYPE) * a_scale[M] * b_scale[N] + bias[N].

    A and B are int8 (ACC_DTYPE int32, exact) or fp8 e4m3 (ACC_DTYPE fp32).
    """
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K  # `other` is written 0.0: the interpreter cannot cast an int 0 to fp8
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK] 8-bit
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN] 8-bit
        acc = tl.dot(a, b, acc, out_dtype=ACC_DTYPE)

    a_scale = tl.load(as_ptr + offs_m * stride_as, mask=m_mask, other=0.0).to(tl.float32)  # [BM]
    b_scale = tl.load(bs_ptr + offs_n * stride_bs, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
    y = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _gemm_configs():
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2}, num_warps=1)]
    # Hopper (H100 / H200) 8-bit tensor cores; small BLOCK_M for decode, big tiles for prefill.
    # The first entry is the default when autotuning is off.
    shapes = [(128, 128, 128, 4, 8), (16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 256, 3, 4),
              (64, 128, 128, 4, 4), (64, 256, 128, 3, 8), (128, 256, 128, 3, 8)]
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=st, num_warps=w)
               for bm, bn, bk, st, w in shapes]
    return configs if _AUTOTUNE else configs[:1]


def _quick_bench(fn, quantiles):
    """Autotuning timer: shorter than do_bench's defaults (25 ms warm-up, 100 ms) to tune faster."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _prune_tall_tiles(configs, named_args, **kwargs):
    """Skip configs whose BLOCK_M is far taller than M (they only waste tuning time)."""
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, named_args["M_BUCKET"])]
    return kept or configs[:1]


_scaled_mm = triton.autotune(_gemm_configs(), key=["M_BUCKET", "N", "K"], do_bench=_quick_bench,
                             prune_configs_by={"early_config_prune": _prune_tall_tiles})(_scaled_mm_kernel)


# ----------------------------------------------------------------------------- GEMM wrapper


def _scale_vector(scale, length, name):
    """[length, 1] / [length] / [1] -> (1-D tensor, stride): stride 0 broadcasts one value."""
    if scale.numel() == 1:
        return scale.reshape(1), 0
    if scale.numel() != length or (scale.dim() == 2 and scale.shape[1] != 1) or scale.dim() > 2:
        raise ValueError(f"{name} must be [{length}, 1], [{length}] or [1], got {list(scale.shape)}")
    flat = scale.reshape(length)
    return flat, flat.stride(0)


def check_scaled_mm_inputs(a, a_scale, b, b_scale, bias, dtype):
    """Shapes of a [M, K], b [N, K] (both `dtype`), scales and bias -> the two 1-D scales + strides."""
    if a.dtype != dtype or b.dtype != dtype:
        raise ValueError(f"activations and weights must be {dtype}, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"expected activations [M, K] and weights [N, K] with the same K, got "
                         f"{list(a.shape)} and {list(b.shape)}")
    M, N = a.shape[0], b.shape[0]
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must be [N={N}], got {list(bias.shape)}")
    return _scale_vector(a_scale, M, "activation scale"), _scale_vector(b_scale, N, "weight scale")


def scaled_mm(a, a_scale, b, b_scale, bias, out_dtype, acc_dtype):
    """Launch the shared 8-bit GEMM on checked inputs: a [M, K], b [N, K] -> [M, N] in out_dtype."""
    (a_s, stride_as), (b_s, stride_bs) = check_scaled_mm_inputs(a, a_scale, b, b_scale, bias, a.dtype)
    M, K = a.shape
    N = b.shape[0]
    c = torch.empty(M, N, device=a.device, dtype=out_dtype)
    if M == 0:
        return c

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _scaled_mm[grid](
        a, b, a_s, b_s, bias if bias is not None else b_s, c,
        M, N, K, triton.next_power_of_2(M),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), stride_as, stride_bs, c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, ACC_DTYPE=acc_dtype,
    )
    return c


def int8_matmul(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16):
    """y [M, N] = (x_q [M, K] @ w_q [N, K]^T, int32) * x_scale[m] * w_scale[n] + bias, in out_dtype.

    x_scale: [M, 1] or [1]; w_scale: [N, 1] or [1]; bias: [N] or None.
    """
    check_scaled_mm_inputs(x_q, x_scale, w_q, w_scale, bias, torch.int8)
    _check_device(x_q, "int8_matmul")
    return scaled_mm(x_q, x_scale, w_q, w_scale, bias, out_dtype, tl.int32)


def int8_matmul_reference(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16):
    """Plain torch. float64 holds every int32 partial sum exactly (|acc| < 2^53), on CPU and CUDA."""
    (xs, _), (ws, _) = check_scaled_mm_inputs(x_q, x_scale, w_q, w_scale, bias, torch.int8)
    acc = (x_q.double() @ w_q.double().T).float()  # [M, N], integers
    y = acc * xs.float()[:, None] * ws.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


# ----------------------------------------------------------------------------- linear


def w8a8_int8_linear(x, w_q, w_scale, bias=None, input_scale=None):
    """x [..., K] float -> [..., N] in x.dtype; per-token dynamic, or static when input_scale is given."""
    if input_scale is None:
        x_q, x_scale = quantize_per_token_int8(x)
    else:
        x_scale = check_static_scale(input_scale, x)
        x_q = quantize_static_int8(x, x_scale)
    y = int8_matmul(x_q, x_scale, w_q, w_scale, bias=bias, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], w_q.shape[0])


def w8a8_int8_linear_reference(x, w_q, w_scale, bias=None, input_scale=None):
    if input_scale is None:
        x_q, x_scale = quantize_per_token_int8_reference(x)
    else:
        x_scale = input_scale.reshape(1).float()
        x_q = quantize_static_int8_reference(x, x_scale)
    y = int8_matmul_reference(x_q, x_scale, w_q, w_scale, bias=bias, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], w_q.shape[0])
