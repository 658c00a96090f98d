"""Per-channel sums and maxima of |x| in one compiled pass (ptq/calibration/channel_stats.c,
compiled.abs_column_stat), the statistics of AWQ's and SmoothQuant's calibration passes:
maxima bit for bit torch's, sums in the order the C file states (bit for bit a torch
re-enactment of it, and within 1e-6 of float64 sums), the same bits however the columns are
split, and torch's own expressions where the compiled code does not take the input."""

from __future__ import annotations

import pytest
import torch

from ptq.algorithms import compiled
from ptq.calibration.observers import AbsMaxObserver, MeanAbsObserver

needs_library = pytest.mark.skipif(compiled.unavailable() is not None, reason="ptq's compiled library is not built")
BLOCK = 256  # channel_stats.c: rows per partial sum


def _activations(rows: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)  # channels of very different sizes, as activations have
    return (torch.randn(rows, n, generator=g) * torch.rand(n, generator=g).pow(4) * 50).to(dtype)


def _sums_in_order(x: torch.Tensor) -> torch.Tensor:
    """The C file's order in float32 torch steps: each block of BLOCK rows summed row by row
    from 0, the blocks' sums added up in order."""
    total = torch.zeros(x.shape[1])
    for start in range(0, x.shape[0], BLOCK):
        partial = torch.zeros(x.shape[1])
        for row in x[start:start + BLOCK].float().abs():
            partial += row
        total += partial
    return total


@needs_library
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, n", [(1, 7), (255, 576), (600, 1100), (2048, 33)])
def test_sums_follow_the_stated_order(dtype, rows, n):
    x = _activations(rows, n, dtype)
    got = compiled.abs_column_stat(x, "sum")
    assert got.dtype == torch.float32 and torch.equal(got, _sums_in_order(x))
    exact = x.double().abs().sum(0)
    assert ((got.double() - exact).abs() <= 1e-6 * exact).all()


@needs_library
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_maxima_are_torchs_with_nan_inf_and_negative_zero(dtype):
    x = _activations(300, 577, dtype)
    x[5, 3], x[290, 3], x[7, 9], x[:, 11], x[100, 400] = float("nan"), 1.0, float("-inf"), -0.0, float("nan")
    got = compiled.abs_column_stat(x, "max")
    want = x.abs().amax(dim=0).float()
    nan = want.isnan()
    assert nan[[3, 400]].all() and nan.sum() == 2 and torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan], want[~nan]) and got[9] == float("inf") and got[11] == 0


@needs_library
def test_rows_with_a_stride_and_columns_split_give_the_same_bits():
    wide = _activations(700, 1300, torch.bfloat16)
    x = wide[:, 100:1100]  # a row stride of 1300, not the width
    lib = compiled.library()[0]
    for stat, function in (("sum", lib.ptq_abs_column_sums), ("max", lib.ptq_abs_column_maxs)):
        whole = compiled.abs_column_stat(x, stat)
        assert torch.equal(whole, compiled.abs_column_stat(x.contiguous(), stat))
        split = torch.full((1000,), -1.0)
        for c0, c1 in ((0, 3), (3, 530), (530, 1000)):  # as threads might share the columns
            function(x.data_ptr(), x.stride(0), x.shape[0], c0, c1, 1, split.data_ptr())
        assert torch.equal(split, whole)


def test_inputs_it_does_not_take():
    x = _activations(64, 128, torch.float16)
    assert compiled.abs_column_stat(x, "sum") is None  # a dtype without a compiled path
    assert compiled.abs_column_stat(_activations(64, 128, torch.float32).t(), "max") is None  # a column stride
    observer = MeanAbsObserver()
    observer.update(x)  # torch's expression instead
    assert torch.allclose(observer.value, x.float().abs().mean(0), rtol=1e-6, atol=0)


@needs_library
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_observers_over_batches(dtype, monkeypatch):
    batches = [_activations(16, 640, dtype, seed=s).reshape(2, 8, 640) for s in range(3)]  # [batch, seq, features]
    batches.append(batches[0].transpose(0, 1))  # rows that reshape copies

    def observed(cls):
        observer = cls()
        for x in batches:
            observer.update(x)
        return observer.value

    compiled_mean, compiled_max = observed(MeanAbsObserver), observed(AbsMaxObserver)
    monkeypatch.setattr(compiled, "abs_column_stat", lambda x, stat: None)  # torch's expressions
    assert torch.equal(compiled_max, observed(AbsMaxObserver))
    assert torch.allclose(compiled_mean, observed(MeanAbsObserver), rtol=1e-6, atol=0)
