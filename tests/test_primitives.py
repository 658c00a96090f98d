"""Primitives: exact values on hand-made inputs, and bit-exact agreement with compressed-tensors."""

import pytest
import torch

from ptq.primitives import FP8_DTYPE, compute_qparams, dequantize, fake_quantize, qparams_mse, quantize
from ptq.algorithms.rtn import rtn
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


def _group_errors(w: torch.Tensor, scale: torch.Tensor, zero, args: QuantArgs, importance=None) -> torch.Tensor:
    """Σ importance · (w - ŵ)² per row and group of w [rows, cols]: [rows, groups]."""
    error = (w - dequantize(quantize(w, scale, zero, args), scale, zero).float()).square()
    if importance is not None:
        error = error * importance
    return error.view(w.shape[0], scale.shape[1], -1).sum(-1)


@pytest.mark.parametrize("symmetric", [True, False])
def test_mse_observer_never_loses_to_minmax_and_shrinks_some_groups(symmetric):
    args = QuantArgs(num_bits=4, symmetric=symmetric, strategy="group", group_size=64)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)) ** 3  # heavy tails
    minmax = compute_qparams(w, args, torch.float32)
    mse = compute_qparams(w, args, torch.float32, observer="mse")
    err_minmax, err_mse = _group_errors(w, *minmax, args), _group_errors(w, *mse, args)
    assert (err_mse <= err_minmax).all()
    # heavy tails: measured 0.880 (symmetric) and 0.961 (asymmetric) of min-max's total error
    assert err_mse.sum() < (0.9 if symmetric else 0.98) * err_minmax.sum()
    assert (mse[0] <= minmax[0]).all()  # a shrunk range never widens a scale
    assert (mse[0] >= 0.80 * minmax[0]).all()  # factors stop at 0.81 (scale rounding aside)


def test_mse_observer_weighs_members_by_importance():
    """One heavily weighted member: the chosen range is the one that rounds it best."""
    args = QuantArgs(num_bits=4, strategy="channel")
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(6))
    importance = torch.ones(128)
    importance[7] = 1e6
    scale = qparams_mse(x, args, torch.float32, importance)[0].unsqueeze(1)  # [32, 1]
    plain = qparams_mse(x, args, torch.float32)[0].unsqueeze(1)
    weighted = _group_errors(x, scale, None, args)[:, 0]
    member = (x[:, 7] - dequantize(quantize(x, scale, None, args), scale)[:, 7]).abs()
    member_plain = (x[:, 7] - dequantize(quantize(x, plain, None, args), plain)[:, 7]).abs()
    assert member.mean() < 0.5 * member_plain.mean()
    assert (weighted >= _group_errors(x, plain, None, args)[:, 0]).all()  # the plain fit is best unweighted


def test_mse_observer_leaves_fp8_to_minmax():
    args = PRESETS["FP8"].weights
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(7))
    for a, b in zip(compute_qparams(w, args, torch.float32, observer="mse"), compute_qparams(w, args, torch.float32)):
        assert (a is None and b is None) or torch.equal(a, b)


def test_fp8_records_the_observer_it_really_used():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(8))
    assert rtn(w, PRESETS["FP8"].weights, torch.bfloat16, observer="mse").observer == "minmax"
    assert rtn(w, PRESETS["W4A16"].weights, torch.bfloat16, observer="mse").observer == "mse"
