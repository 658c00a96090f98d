"""The compiled passes over bf16 weights around AWQ's grid and SmoothQuant
(smooth_weights.c): the normalized |W| behind AWQ's w̄ and the scales folded into weights,
bit for bit against the torch steps they replace, edge values included."""

from __future__ import annotations

import pytest
import torch

from ptq.algorithms import compiled, smooth_compiled
from ptq.algorithms.awq import weight_mean
from ptq.algorithms.smoothquant import _scale_
from ptq.schemes import QuantArgs

pytestmark = pytest.mark.skipif(compiled.linalg_kind() != "AVX-512", reason="the compiled passes need AVX-512")


def _bf16_weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random bf16 weights with the values that trip rounding and maxima up: zeros of both
    signs, subnormals, the largest finite values, infinities, a NaN."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(rows, cols, generator=g) * 0.05
    W[0, :6] = torch.tensor([0.0, -0.0, 1e-40, -1e-39, 3.38e38, -3.38e38])
    W[1, 17] = float("inf")
    W[2, 33] = float("-inf")
    W[3, 40] = float("nan")
    W[4] = 0  # a row of zeros: 0 / 1e-6
    return W.bfloat16()


@pytest.mark.parametrize("size", [16, 64, 192])
def test_abs_over_max_gives_the_torch_steps_bits(size):
    weights = [_bf16_weights(40, 192, 0), _bf16_weights(24, 192, 1)]
    compiled_out = smooth_compiled.abs_over_max(weights, size)
    W = torch.cat(weights).float().abs_()  # the torch steps of awq.weight_mean
    grouped = W.view(W.shape[0], -1, size)
    expected = grouped.div_(grouped.amax(dim=-1, keepdim=True) + 1e-6).view_as(W)
    assert compiled_out is not None and compiled_out.dtype == torch.float32
    assert torch.equal(compiled_out.isnan(), expected.isnan())
    assert torch.equal(compiled_out.nan_to_num(), expected.nan_to_num())


def test_weight_mean_is_unchanged_by_the_compiled_pass(monkeypatch):
    weights = [torch.randn(96, 128).bfloat16(), torch.randn(32, 128).bfloat16()]
    for args in (QuantArgs(num_bits=4, strategy="group", group_size=32), QuantArgs(num_bits=4, strategy="channel")):
        fast = weight_mean(weights, args)
        with monkeypatch.context() as m:
            m.setattr(smooth_compiled, "abs_over_max", lambda *a: None)
            assert torch.equal(fast, weight_mean(weights, args))


@pytest.mark.parametrize("per_row", [False, True])
def test_scale_bf16_gives_the_torch_steps_bits(per_row):
    W = _bf16_weights(48, 96, 2)
    g = torch.Generator().manual_seed(3)
    factor = torch.rand(48, 1, generator=g) * 4 if per_row else torch.rand(1, 96, generator=g) * 4
    factor.view(-1)[:3] = torch.tensor([0.0, 1e-30, 3e38])  # zeros, subnormal products, overflows to inf
    out = smooth_compiled.scale_bf16(W, factor)
    expected = (W.float() * factor).bfloat16()
    assert out is not None and out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))  # NaNs too: 0xFFFF as torch's


def test_scale_bf16_declines_what_it_does_not_take():
    W = torch.randn(8, 32).bfloat16()
    assert smooth_compiled.scale_bf16(W.float(), torch.ones(1, 32)) is None  # float32 weights: torch's way
    assert smooth_compiled.scale_bf16(W, torch.ones(1, 32, dtype=torch.float64)) is None
    assert smooth_compiled.scale_bf16(W[:, :24].contiguous(), torch.ones(1, 24)) is None  # not a multiple of 16
    assert smooth_compiled.scale_bf16(W.t(), torch.ones(1, 8)) is None  # not contiguous


def test_folding_scales_into_a_parameter_keeps_the_torch_bits(monkeypatch):
    W = torch.randn(64, 128).bfloat16()
    factor = torch.rand(1, 128) + 0.5
    fast, slow = torch.nn.Parameter(W.clone(), requires_grad=False), torch.nn.Parameter(W.clone(), requires_grad=False)
    _scale_(fast, factor)
    with monkeypatch.context() as m:
        m.setattr(smooth_compiled, "scale_bf16", lambda *a: None)
        _scale_(slow, factor)
    assert torch.equal(fast.view(torch.int16), slow.view(torch.int16))
