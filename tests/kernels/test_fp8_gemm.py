"""FP8 e4m3 W8A8 kernels (ptq.kernels.fp8_gemm) against their torch references.

The Triton CPU interpreter runs the fp8 kernels (quantization and GEMM), so on CPU these tests
exercise the real kernels; on a GPU without fp8 support (compute capability < 8.9) the public
functions fall back to the references and the comparisons hold trivially.

Quantization is bit-exact (compared as raw bytes, so -0.0 vs +0.0 counts). In the GEMM, e4m3 x e4m3
products are exact in fp32 and the reference sums in fp32:
  fp32 out, interpreter: rtol = 1e-5, atol = 1e-5 * max|y| (K <= 256 terms summed in another
            order: ~K * 2^-24 relative).
  fp32 out, GPU: rtol = atol / max|y| = 1e-3. Hopper's fp8 MMA keeps only ~14 bits of each
            product while accumulating inside an instruction (DeepSeek-V3 report); Triton's own
            fp8 dot test uses 1e-3.
  bf16 out: rtol = 2^-7 (one bf16 ulp: the interpreter truncates where torch rounds),
            atol = 2^-7 * max|y|; on GPU the 1e-3 above fits inside it.
"""

import pytest
import torch

from ptq.kernels import fp8_gemm
from ptq.kernels.fp8_gemm import (
    fp8_matmul,
    fp8_matmul_reference,
    is_supported,
    quantize_per_token_fp8,
    quantize_per_token_fp8_reference,
    quantize_static_fp8,
    quantize_static_fp8_reference,
    w8a8_fp8_linear,
    w8a8_fp8_linear_reference,
)

FP8 = torch.float8_e4m3fn
TOL = {
    ("cpu", torch.float32): dict(atol=1e-5, rtol=1e-5),
    ("cuda", torch.float32): dict(atol=1e-3, rtol=1e-3),
    ("cpu", torch.bfloat16): dict(atol=2**-7, rtol=2**-7),
    ("cuda", torch.bfloat16): dict(atol=2**-7, rtol=2**-7),
}


def assert_same_bytes(a, b):
    assert a.dtype == b.dtype == FP8 and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_matches(y, y_ref):
    tol = TOL[(y.device.type, y.dtype)]
    torch.testing.assert_close(y, y_ref, atol=tol["atol"] * y_ref.abs().max().item(), rtol=tol["rtol"])


def activations(M, K, dtype, device, seed=0):
    """Random rows of mixed magnitude plus an all-zero row and a row of exact e4m3 ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * torch.logspace(-4, 1, K)  # tiny values hit e4m3 subnormals
    if M >= 3:
        x[1] = 0.0
        # absmax 448 -> scale 1: 17 and 19 are ties (spacing 2 there), 3 * 2^-10 a subnormal tie.
        ties = torch.tensor([448.0, 17.0, 19.0, -17.0, 3 * 2**-10, -(2**-10), 440.0, -1e-6])
        x[2] = 0.0
        x[2, : ties.numel()] = ties
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K", [(5, 200), (3, 1500)])  # 1500: more than one K block
def test_quantize_per_token_is_bit_exact(M, K, dtype, device):
    x = activations(M, K, dtype, device)
    q, scale = quantize_per_token_fp8(x)
    q_ref, scale_ref = quantize_per_token_fp8_reference(x)
    assert scale.shape == (M, 1)
    assert torch.equal(scale, scale_ref)
    assert_same_bytes(q, q_ref)


def test_quantize_static_is_bit_exact(device):
    x = activations(5, 200, torch.float32, device) * 100  # values past 448 * scale saturate
    scale = torch.tensor([0.5], device=device)
    q = quantize_static_fp8(x, scale)
    assert_same_bytes(q, quantize_static_fp8_reference(x, scale))
    assert q.float().abs().max() == 448.0


@pytest.mark.parametrize("M,N,K,per_channel,has_bias,out_dtype", [
    (1, 48, 128, True, False, torch.float32),
    (17, 80, 100, False, True, torch.float32),
    (33, 48, 256, True, True, torch.bfloat16),
])
def test_fp8_matmul_matches_reference(M, N, K, per_channel, has_bias, out_dtype, device):
    gen = torch.Generator().manual_seed(M)
    x_q = (torch.randn(M, K, generator=gen) * 50).clamp(-448, 448).to(FP8).to(device)
    w = (torch.randn(N, K, generator=gen) * 50).clamp(-448, 448).to(FP8).to(device)
    x_scale = (torch.rand(M, 1, generator=gen) * 0.01).to(device)
    w_scale = torch.rand(N, 1, generator=gen) * 0.01 if per_channel else torch.tensor([0.003])
    w_scale = w_scale.to(device)
    bias = torch.randn(N, generator=gen).to(device) if has_bias else None
    y = fp8_matmul(x_q, x_scale, w, w_scale, bias=bias, out_dtype=out_dtype)
    y_ref = fp8_matmul_reference(x_q, x_scale, w, w_scale, bias=bias, out_dtype=out_dtype)
    assert y.shape == (M, N) and y.dtype == out_dtype
    assert_matches(y, y_ref)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_fp8_linear(static, dtype, device):
    x = activations(6, 128, dtype, device).reshape(3, 2, 128)
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(80, 128, generator=gen) * 50).clamp(-448, 448).to(FP8).to(device)
    w_scale = (torch.rand(80, 1, generator=gen) * 0.01).to(device)
    bias = torch.randn(80, generator=gen).to(device)
    input_scale = torch.tensor([0.02], device=device) if static else None
    y = w8a8_fp8_linear(x, w, w_scale, bias=bias, input_scale=input_scale)
    y_ref = w8a8_fp8_linear_reference(x, w, w_scale, bias=bias, input_scale=input_scale)
    assert y.shape == (3, 2, 80) and y.dtype == dtype
    assert_matches(y, y_ref)


def test_fallback_without_fp8_support_is_the_reference(monkeypatch, device):
    monkeypatch.setattr(fp8_gemm, "is_supported", lambda device=None: False)
    x = activations(4, 64, torch.bfloat16, device)
    w = torch.randn(48, 64).to(FP8).to(device)
    w_scale = torch.tensor([0.01], device=device)
    for input_scale in (None, torch.tensor([0.01], device=device)):
        y = w8a8_fp8_linear(x, w, w_scale, input_scale=input_scale)
        assert torch.equal(y, w8a8_fp8_linear_reference(x, w, w_scale, input_scale=input_scale))


def test_is_supported(monkeypatch):
    monkeypatch.setattr(fp8_gemm, "_INTERPRET", False)
    assert is_supported("cpu") is False
    if torch.cuda.is_available():
        assert is_supported("cuda") == (torch.cuda.get_device_capability() >= (8, 9))
    monkeypatch.setattr(fp8_gemm, "_INTERPRET", True)
    assert is_supported("cpu") is True


def test_errors_name_the_problem(device):
    x_q = torch.zeros(4, 64, device=device).to(FP8)
    w = torch.zeros(8, 64, device=device).to(FP8)
    with pytest.raises(ValueError, match=r"must be torch.float8_e4m3fn, got torch.float8_e4m3fn and torch.int8"):
        fp8_matmul(x_q, torch.ones(4, 1, device=device), w.view(torch.int8), torch.ones(1, device=device))
    with pytest.raises(ValueError, match=r"activation scale must be \[4, 1\], \[4\] or \[1\], got \[3, 1\]"):
        fp8_matmul(x_q, torch.ones(3, 1, device=device), w, torch.ones(1, device=device))
    with pytest.raises(ValueError, match=r"x must be float16, bfloat16 or float32"):
        quantize_per_token_fp8(torch.zeros(4, 64, dtype=torch.int32, device=device))
