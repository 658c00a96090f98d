"""Pipeline pieces: GPTQ on Linears that share an input, solved once as one stacked weight."""

import pytest
import torch

from ptq.algorithms.gptq import gptq
from ptq.stage_solve import split_rows as _split_rows
from ptq.schemes import PRESETS


@pytest.mark.parametrize("scheme,actorder", [("W4A16", "static"), ("W4A16_ASYM", "group"), ("W8A16", "none")])
def test_stacked_solve_equals_separate_solves(scheme, actorder):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 256, generator=g) @ torch.randn(256, 256, generator=g)  # correlated inputs
    H = 2 * x.t() @ x / x.shape[0]
    weights = [torch.randn(rows, 256, generator=g) * 0.02 for rows in (128, 64, 64)]  # q, k, v
    args = PRESETS[scheme].weights
    solve = dict(scale_dtype=torch.bfloat16, actorder=actorder)
    stacked = _split_rows(gptq(torch.cat(weights), H, args, **solve).weight, [128, 64, 64])
    for W, part in zip(weights, stacked):
        alone = gptq(W, H, args, **solve).weight
        # rows are independent given H; only the block-update matmuls' blocking may differ
        assert (part.q != alone.q).float().mean() < 0.01
        torch.testing.assert_close(part.dequantize().float(), alone.dequantize().float(), atol=0.02, rtol=0)
        assert (part.g_idx is None) == (alone.g_idx is None)
