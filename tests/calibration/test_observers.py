"""HessianObserver's two readings: H = 2/N · Σ x xᵀ (GPTQ) and the Gram matrix Σ x xᵀ itself
(AWQ's linear loss), each made in place from the running sum, once."""

from __future__ import annotations

import pytest
import torch

from ptq.calibration.observers import HessianObserver


def _observed(x: torch.Tensor) -> HessianObserver:
    observer = HessianObserver()
    for batch in x.split(700):
        observer.update(batch)
    return observer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gram_matrix_is_the_sum_and_h_is_two_over_n_of_it(dtype):
    x = (torch.randn(2000, 96, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    exact = x.double().t() @ x.double()  # [96, 96]
    G = _observed(x).gram()
    assert G.dtype == torch.float32 and torch.equal(G, G.t())
    assert float((G.double() - exact).abs().max() / exact.abs().max()) < 1e-6
    H = _observed(x).value
    assert torch.equal(H, G.mul(2.0 / 2000))  # the same sum, scaled once


def test_a_read_sum_takes_no_more_batches_and_is_given_once():
    observer = _observed(torch.randn(100, 32))
    observer.gram()
    with pytest.raises(RuntimeError, match="read already"):
        observer.update(torch.randn(10, 32))
    with pytest.raises(RuntimeError, match="read already"):
        observer.gram()
