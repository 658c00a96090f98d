"""Primitives: exact values on hand-made inputs, and bit-exact agreement with compressed-tensors."""

import pytest
import torch

from ptq.primitives import FP8_DTYPE, compute_qparams, dequantize, fake_quantize, quantize
from ptq.schemes import PRESETS, QuantArgs


def test_symmetric_int4_by_hand():
    args = QuantArgs(num_bits=4, strategy="group", group_size=4)
    w = torch.tensor([[1.5, -0.75, 0.0, 0.3, 0.2, 0.1, -0.05, 0.0]])
    scale, zero = compute_qparams(w, args, torch.float32)
    assert zero is None
    assert torch.equal(scale, torch.tensor([[1.5 / 7.5, 0.2 / 7.5]]))
    q = quantize(w, scale, zero, args)
    # 1.5 / 0.2 = 7.5 rounds (half to even) to 8, clamped to 7; -0.75 / 0.2 = -3.75 -> -4
    assert q.tolist() == [[7, -4, 0, 2, 7, 4, -2, 0]]
    assert torch.equal(dequantize(q, scale), q.float() * scale.repeat_interleave(4, dim=1))


def test_asymmetric_uses_whole_range():
    args = QuantArgs(num_bits=4, symmetric=False, strategy="channel")
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0, 15.0]])
    scale, zero = compute_qparams(w, args, torch.float32)
    assert torch.equal(scale, torch.tensor([[1.0]])) and zero.tolist() == [[-8]]
    q = quantize(w, scale, zero, args)
    assert q.tolist() == [[-8, -7, -6, -5, 7]]
    assert torch.equal(dequantize(q, scale, zero), w)


def test_scale_rounded_before_quantizing():
    args = PRESETS["W4A16"].weights
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    scale, _ = compute_qparams(w, args, torch.bfloat16)
    assert scale.dtype == torch.bfloat16
    q = quantize(w, scale, None, args)
    # the integers are those of the bf16 scale, not of the float32 one
    expected = torch.round(w / scale.float().repeat_interleave(128, dim=1)).clamp(-8, 7)
    assert torch.equal(q.float(), expected)


def test_fp8_per_channel():
    args = QuantArgs(num_bits=8, type="float", strategy="channel")
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    scale, zero = compute_qparams(w, args, torch.float32)
    q = quantize(w, scale, zero, args)
    assert q.dtype == FP8_DTYPE and zero is None
    assert torch.equal(scale[:, 0], w.abs().amax(dim=1) / 448)
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 for normal values
    back = dequantize(q, scale)
    assert ((back - w).abs() <= w.abs() / 16 + 1e-6).all()


def test_fake_quantize_per_token():
    args = QuantArgs(num_bits=8, strategy="token", dynamic=True)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    y = fake_quantize(x, args)
    step = x.abs().amax(dim=1, keepdim=True) / 127.5
    assert (y - x).abs().le(step / 2 + 1e-6).all()


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits,group", [(4, 128), (4, 32), (3, 64), (8, None)])
def test_matches_compressed_tensors(bits, group, symmetric):
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    strategy = "group" if group else "channel"
    args = QuantArgs(num_bits=bits, symmetric=symmetric, strategy=strategy, group_size=group)
    ct_args = ct.QuantizationArgs(num_bits=bits, symmetric=symmetric, strategy=strategy, group_size=group)
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(bits)) * 0.05
    scale, zero = compute_qparams(w, args, torch.bfloat16)
    grouped = w.view(16, -1, group or 256)
    ct_scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), ct_args)
    assert torch.equal(scale, ct_scale.to(torch.bfloat16))
    # ptq derives the zero point from the bf16-rounded scale (compressed-tensors from the
    # float32 one, before rounding); what must agree is quantize/dequantize given the params
    ct_zero = torch.zeros_like(scale) if zero is None else zero
    q = quantize(w, scale, zero, args)
    ct_q = ct_quantize(w, scale, ct_zero.to(scale.dtype), ct_args, dtype=torch.int8)
    assert torch.equal(q, ct_q)
    ours = dequantize(q, scale, zero)
    theirs = ct_dequantize(q, scale, ct_zero.to(scale.dtype), ct_args)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours, theirs)
