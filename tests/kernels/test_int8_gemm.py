"""W8A8 int8 kernels (ptq.kernels.int8_gemm) against their torch references.

Quantization is bit-exact (torch.equal): same IEEE division, same round-half-even, same clamp.
The GEMM's int32 sums are exact, and the reference's float64 sums are exact too, so only the fp32
epilogue (acc * x_scale * w_scale + bias; a GPU may fuse the last multiply-add into one FMA)
and the output cast can differ:
  fp32 out: rtol = 1e-6 (a few fp32 ulps), atol = 1e-6.
  bf16 out: rtol = 2^-7 (one bf16 ulp: the interpreter truncates where torch rounds), atol = 1e-6.
"""

import pytest
import torch

from ptq.kernels import int8_gemm
from ptq.kernels.int8_gemm import (
    int8_matmul,
    int8_matmul_reference,
    quantize_per_token_int8,
    quantize_per_token_int8_reference,
    quantize_static_int8,
    quantize_static_int8_reference,
    w8a8_int8_linear,
    w8a8_int8_linear_reference,
)

TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=1e-6, rtol=2**-7)}


def activations(M, K, dtype, device, seed=0):
    """Random rows plus awkward ones: an all-zero row and exact .5 ties (absmax 127 -> scale 1)."""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed)) * 3
    if M >= 3:
        x[1] = 0.0
        ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.0, -127.0])
        x[2] = 0.25
        x[2, : ties.numel()] = ties
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K", [(1, 128), (5, 100), (3, 1500)])  # 1500: more than one K block
def test_quantize_per_token_is_bit_exact(M, K, dtype, device):
    x = activations(M, K, dtype, device)
    q, scale = quantize_per_token_int8(x)
    q_ref, scale_ref = quantize_per_token_int8_reference(x)
    assert q.dtype == torch.int8 and q.shape == (M, K) and scale.shape == (M, 1)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q, q_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_static_is_bit_exact(dtype, device):
    x = activations(5, 200, dtype, device).reshape(5, 2, 100)  # leading dims are flattened
    scale = torch.tensor([0.02], device=device)  # |x| up to ~10 -> many values saturate at +-127/-128
    q = quantize_static_int8(x, scale)
    assert q.shape == (10, 100)
    assert torch.equal(q, quantize_static_int8_reference(x, scale))
    assert q.min() == -128 and q.max() == 127


@pytest.mark.parametrize("M,N,K,per_channel,has_bias,out_dtype", [
    (1, 48, 128, True, False, torch.float32),
    (5, 80, 256, True, True, torch.float32),
    (17, 48, 100, False, True, torch.float32),
    (33, 80, 128, True, False, torch.bfloat16),
    (17, 80, 256, False, False, torch.bfloat16),
])
def test_int8_matmul_matches_reference(M, N, K, per_channel, has_bias, out_dtype, device):
    gen = torch.Generator().manual_seed(M * N)
    x_q = torch.randint(-128, 128, (M, K), generator=gen, dtype=torch.int8).to(device)
    w_q = torch.randint(-128, 128, (N, K), generator=gen, dtype=torch.int8).to(device)
    x_scale = (torch.rand(M, 1, generator=gen) * 0.01).to(device)
    w_scale = (torch.rand(N if per_channel else 1, 1, generator=gen) * 0.01).to(device)
    w_scale = w_scale if per_channel else w_scale.reshape(1)
    bias = torch.randn(N, generator=gen).to(device) if has_bias else None
    y = int8_matmul(x_q, x_scale, w_q, w_scale, bias=bias, out_dtype=out_dtype)
    y_ref = int8_matmul_reference(x_q, x_scale, w_q, w_scale, bias=bias, out_dtype=out_dtype)
    assert y.dtype == out_dtype and y.shape == (M, N)
    torch.testing.assert_close(y, y_ref, **TOL[out_dtype])


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_int8_linear(static, dtype, device):
    x = activations(6, 128, dtype, device).reshape(2, 3, 128)
    gen = torch.Generator().manual_seed(1)
    w_q = torch.randint(-128, 128, (80, 128), generator=gen, dtype=torch.int8).to(device)
    w_scale = (torch.rand(80, 1, generator=gen) * 0.01).to(device)
    bias = torch.randn(80, generator=gen).to(device)
    input_scale = torch.tensor([0.05], device=device) if static else None
    y = w8a8_int8_linear(x, w_q, w_scale, bias=bias, input_scale=input_scale)
    y_ref = w8a8_int8_linear_reference(x, w_q, w_scale, bias=bias, input_scale=input_scale)
    assert y.shape == (2, 3, 80) and y.dtype == dtype
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


def test_errors_name_the_problem(device):
    x_q = torch.zeros(4, 64, dtype=torch.int8, device=device)
    w_q = torch.zeros(8, 64, dtype=torch.int8, device=device)
    ones = torch.ones(4, 1, device=device)
    with pytest.raises(ValueError, match=r"same K, got \[4, 64\] and \[8, 32\]"):
        int8_matmul(x_q, ones, w_q[:, :32], torch.ones(8, 1, device=device))
    with pytest.raises(ValueError, match=r"must be torch.int8, got torch.float32"):
        int8_matmul(x_q.float(), ones, w_q, torch.ones(8, 1, device=device))
    with pytest.raises(ValueError, match=r"weight scale must be \[8, 1\], \[8\] or \[1\], got \[7, 1\]"):
        int8_matmul(x_q, ones, w_q, torch.ones(7, 1, device=device))
    with pytest.raises(ValueError, match=r"bias must be \[N=8\]"):
        int8_matmul(x_q, ones, w_q, torch.ones(8, 1, device=device), bias=torch.zeros(4, device=device))
    with pytest.raises(ValueError, match=r"static input scale must be one float value"):
        w8a8_int8_linear(torch.randn(4, 64, device=device), w_q, torch.ones(8, 1, device=device),
                         input_scale=torch.ones(2, device=device))


def test_cpu_tensor_without_interpreter_raises(monkeypatch):
    monkeypatch.setattr(int8_gemm, "_INTERPRET", False)
    with pytest.raises(RuntimeError, match=r"needs a CUDA tensor"):
        quantize_per_token_int8(torch.randn(2, 64))
