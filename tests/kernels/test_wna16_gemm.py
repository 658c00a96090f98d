"""Weight-only int GEMM (ptq.kernels.wna16_gemm) against its torch reference.

The kernel and the reference compute the same dequantized weights ((q - z) * s in fp32, rounded
to x's dtype), so the differences come only from summation order (fp32 tiles, split-K atomics)
and from rounding the output to 16 bits. Tolerances, stated once:
  fp32: atol = rtol = 1e-4. K <= 256 terms of size O(1 / sqrt(K)) summed in fp32 in a different
        order differ by ~K * 2^-24 relative, far below 1e-4.
  bf16: rtol = 2^-6 (two bf16 ulps), atol = 2^-6 * max|y|. The output cast is one ulp; the
        Triton CPU interpreter also truncates (not rounds) fp32 -> bf16, one more ulp on the
        output and on each dequantized weight.
  fp16: rtol = 2^-9 (two fp16 ulps), atol = 2^-9 * max|y|.
"""

import math

import pytest
import torch

from ptq.kernels import wna16_gemm
from ptq.kernels.wna16_gemm import unpack_int_weights, wna16_matmul, wna16_matmul_reference

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=2**-6, rtol=2**-6),  # atol is multiplied by max|y|
    torch.float16: dict(atol=2**-9, rtol=2**-9),
}


def pack_rows(q, bits):
    """Test-side packer written from the format's definition with Python integers.

    Each row is one little-endian bit stream: element k (offset by 2^(bits-1)) at bit k * bits.
    """
    n, k = q.shape
    words = math.ceil(k * bits / 32)
    out = torch.empty(n, words, dtype=torch.int64)
    for r, row in enumerate((q + (1 << (bits - 1))).tolist()):
        stream = sum(v << (bits * i) for i, v in enumerate(row))
        for w in range(words):
            word = (stream >> (32 * w)) & 0xFFFFFFFF
            out[r, w] = word - (1 << 32) if word >= 1 << 31 else word  # as signed int32
    return out.to(torch.int32)


def make_layer(N, K, bits, group_size, asym, act_order, dtype, device, seed=0):
    """Random quantized Linear in the checkpoint layout; outputs come out O(1) for x ~ N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    q = torch.randint(lo, hi, (N, K), generator=gen)  # [out, in]
    gs = K if group_size is None else group_size
    n_groups = math.ceil(K / gs)
    scale = (0.5 + torch.rand(N, n_groups, generator=gen)) / (hi * math.sqrt(K))  # [out, groups]
    zp = torch.randint(lo, hi, (N, n_groups), generator=gen, dtype=torch.int32) if asym else None
    g_idx = None
    if act_order:
        g_idx = (torch.arange(K) // gs)[torch.randperm(K, generator=gen)].to(torch.int32)  # [in]
    layer = dict(weight_packed=pack_rows(q, bits), weight_scale=scale.to(dtype),
                 weight_zero_point=zp, g_idx=g_idx)
    return {k: (v.to(device) if v is not None else None) for k, v in layer.items()}


def run_both(x, layer, bits, group_size, bias=None):
    kwargs = dict(bits=bits, group_size=group_size, bias=bias, **layer)
    weight_packed = kwargs.pop("weight_packed")
    weight_scale = kwargs.pop("weight_scale")
    y = wna16_matmul(x, weight_packed, weight_scale, **kwargs)
    y_ref = wna16_matmul_reference(x, weight_packed, weight_scale, **kwargs)
    return y, y_ref


def assert_matches(y, y_ref):
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    tol = TOL[y.dtype]
    atol = tol["atol"] * (y_ref.abs().max().item() if y.dtype != torch.float32 else 1.0)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=tol["rtol"])


# ----------------------------------------------------------------------------- layout


def test_layout_fixed_vectors():
    # int4 -8..7 are stored 0..15, element k of a word at bit 4 * (k % 8), least significant first.
    q4 = torch.arange(-8, 8).repeat(2, 1)  # [2, 16]: two words per row
    expected4 = torch.tensor([[0x76543210, 0xFEDCBA98 - (1 << 32)]] * 2, dtype=torch.int32)
    assert torch.equal(pack_rows(q4, 4), expected4)
    assert torch.equal(unpack_int_weights(expected4, 4, 16), q4.to(torch.int32))
    # int8 [-128, -1, 0, 127] are stored [0, 127, 128, 255], byte k at bit 8k: word 0xFF807F00.
    q8 = torch.tensor([[-128, -1, 0, 127]])
    expected8 = torch.tensor([[0xFF807F00 - (1 << 32)]], dtype=torch.int32)
    assert torch.equal(pack_rows(q8, 8), expected8)
    assert torch.equal(unpack_int_weights(expected8, 8, 4), q8.to(torch.int32))
    # int3: 11 values need 33 bits; element 10 straddles words 0 and 1.
    q3 = torch.tensor([[-4, -3, -2, -1, 0, 1, 2, 3, 3, 2, -3]])
    assert torch.equal(unpack_int_weights(pack_rows(q3, 3), 3, 11), q3.to(torch.int32))


# ----------------------------------------------------------------------------- kernel vs reference


@pytest.mark.parametrize("act_order", [False, True], ids=["no_gidx", "gidx"])
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", [32, 64, 128, None], ids=["g32", "g64", "g128", "channel"])
@pytest.mark.parametrize("bits", [4, 8])
def test_matches_reference_fp32(bits, group_size, asym, act_order, device):
    N, K = 80, 256  # N ragged against BLOCK_N; K holds 2 to 8 groups
    layer = make_layer(N, K, bits, group_size, asym, act_order, torch.float32, device)
    for M in (1, 17):  # decode (split-K) and prefill launch, both ragged in M
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(device)
        assert_matches(*run_both(x, layer, bits, group_size))


@pytest.mark.parametrize("M,N,K", [(5, 48, 128), (33, 48, 128), (33, 80, 256), (5, 80, 100), (17, 48, 200)])
def test_ragged_shapes(M, N, K, device):
    # K = 100 and 200: a partial last word (100 * 4 bits = 12.5 words) and a short last group.
    layer = make_layer(N, K, 4, 32, True, False, torch.float32, device, seed=M)
    x = torch.randn(M, K).to(device)
    assert_matches(*run_both(x, layer, 4, 32))


@pytest.mark.parametrize("bits,group_size,asym,act_order,M,K", [
    (2, 64, True, False, 5, 256),
    (2, None, False, True, 17, 128),
    (3, 32, True, False, 1, 256),   # 3-bit values straddle word boundaries
    (3, None, False, True, 33, 100),
])
def test_other_bit_widths(bits, group_size, asym, act_order, M, K, device):
    layer = make_layer(48, K, bits, group_size, asym, act_order, torch.float32, device)
    x = torch.randn(M, K).to(device)
    assert_matches(*run_both(x, layer, bits, group_size))


@pytest.mark.parametrize("dtype,bits,group_size,asym,act_order,M", [
    (torch.bfloat16, 4, 128, False, False, 1),
    (torch.bfloat16, 4, 32, True, True, 17),
    (torch.bfloat16, 8, None, True, False, 5),
    (torch.float16, 4, 64, True, False, 33),
    (torch.float16, 8, 128, False, True, 1),
])
def test_half_precision(dtype, bits, group_size, asym, act_order, M, device):
    layer = make_layer(80, 256, bits, group_size, asym, act_order, dtype, device)
    x = torch.randn(M, 256).to(dtype).to(device)
    assert_matches(*run_both(x, layer, bits, group_size))


@pytest.mark.parametrize("lead", [(2, 3), (2, 8, 1)], ids=["prefill", "decode"])
def test_bias_and_leading_dims(lead, device):
    layer = make_layer(48, 128, 4, 64, True, False, torch.float32, device)
    bias = torch.randn(48).to(device)
    x = torch.randn(*lead, 128).to(device)
    y, y_ref = run_both(x, layer, 4, 64, bias=bias)
    assert y.shape == (*lead, 48)
    assert_matches(y, y_ref)


# ----------------------------------------------------------------------------- errors


def test_shape_errors_name_the_problem(device):
    layer = make_layer(48, 128, 4, 32, True, False, torch.float32, device)
    wp, ws, wz = layer["weight_packed"], layer["weight_scale"], layer["weight_zero_point"]
    x = torch.randn(3, 128, device=device)
    with pytest.raises(ValueError, match=r"bits=5 is not supported"):
        wna16_matmul(x, wp, ws, bits=5, group_size=32)
    with pytest.raises(ValueError, match=r"ceil\(K\*bits/32\)=8"):
        wna16_matmul(torch.randn(3, 64, device=device), wp, ws, bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"weight_scale must be \[N, ceil\(K/group_size\)\] = \[48, 2\]"):
        wna16_matmul(x, wp, ws, bits=4, group_size=64)
    with pytest.raises(ValueError, match=r"weight_zero_point must be unpacked"):
        wna16_matmul(x, wp, ws, bits=4, group_size=32, weight_zero_point=wz[:, :1])
    with pytest.raises(ValueError, match=r"g_idx must be an int32 tensor \[K=128\]"):
        wna16_matmul(x, wp, ws, bits=4, group_size=32, g_idx=torch.zeros(64, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"bias must be \[N=48\]"):
        wna16_matmul(x, wp, ws, bits=4, group_size=32, bias=torch.zeros(47, device=device))
    with pytest.raises(ValueError, match=r"x must be float16, bfloat16 or float32"):
        wna16_matmul(x.to(torch.int32), wp, ws, bits=4, group_size=32)


def test_cpu_tensor_without_interpreter_raises(monkeypatch):
    monkeypatch.setattr(wna16_gemm, "_INTERPRET", False)
    layer = make_layer(48, 128, 4, 32, False, False, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"needs a CUDA tensor.*wna16_matmul_reference"):
        wna16_matmul(torch.randn(2, 128), layer["weight_packed"], layer["weight_scale"], bits=4, group_size=32)


@pytest.mark.parametrize("M", [1, 33], ids=["decode", "prefill"])
def test_fewer_stages_when_shared_memory_runs_out(monkeypatch, M, device):
    """A config whose pipelined tiles exceed shared memory (OutOfResources when the compiled
    kernel loads: fp32 x with per-element scales on an H200) runs again with at most 2 stages,
    and that cap is kept for the kernel's specialisation. The GPU's limit is faked here."""
    from triton.runtime.errors import OutOfResources

    real, tried = wna16_gemm._launcher, []

    def launcher(decode, cap):
        tried.append(cap)
        if cap is None:  # the configs as listed: "too large"
            def fail(*args, **kwargs):
                raise OutOfResources(450560, 232448, "shared memory")
            return _Subscriptable(fail)
        return real(decode, cap)

    monkeypatch.setattr(wna16_gemm, "_launcher", launcher)
    monkeypatch.setattr(wna16_gemm, "_stage_cap", {})
    layer = make_layer(80, 256, 4, 32, True, False, torch.float32, device)
    x = torch.randn(M, 256, generator=torch.Generator().manual_seed(1)).to(device)
    assert_matches(*run_both(x, layer, 4, 32))
    assert tried == [None, 2]
    assert_matches(*run_both(x, layer, 4, 32))  # remembered: straight to the cap that fitted
    assert tried == [None, 2, 2]
    layer8 = make_layer(80, 256, 8, 32, True, False, torch.float32, device)
    assert_matches(*run_both(x, layer8, 8, 32))  # another specialisation tries from the start
    assert tried == [None, 2, 2, None, 2]


def test_out_of_resources_at_every_cap_is_raised(monkeypatch, device):
    from triton.runtime.errors import OutOfResources

    def fail(*args, **kwargs):
        raise OutOfResources(450560, 232448, "shared memory")

    monkeypatch.setattr(wna16_gemm, "_launcher", lambda decode, cap: _Subscriptable(fail))
    monkeypatch.setattr(wna16_gemm, "_stage_cap", {})
    layer = make_layer(80, 256, 4, 32, True, False, torch.float32, device)
    with pytest.raises(OutOfResources):
        wna16_matmul(torch.randn(1, 256).to(device), layer["weight_packed"], layer["weight_scale"], bits=4,
                     group_size=32, weight_zero_point=layer["weight_zero_point"])
    assert wna16_gemm._stage_cap == {}


class _Subscriptable:
    """Stands in for an autotuned launcher: launcher[grid](*args, **meta) calls fn."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn
