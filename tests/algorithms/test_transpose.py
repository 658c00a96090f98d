"""The compiled transposed copies (transpose.c, compiled.transposed) against torch's, and
GPTQ with them against GPTQ without: moves and exact widening, so equal bits."""

from __future__ import annotations

import pytest
import torch

from ptq.algorithms import compiled
from ptq.algorithms.gptq import gptq
from ptq.primitives import FP8_DTYPE

from .test_gptq import _args, _problem


def _reference(src, rows, cols, dtype):
    picked = src if rows is None else src.index_select(0, rows)
    picked = picked if cols is None else picked.index_select(1, cols)
    return picked.t().contiguous().to(dtype)


def _source(dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
    values = torch.randn(*shape) * 4
    return values.to(torch.int8) if dtype == torch.int8 else values.to(dtype)


@pytest.mark.parametrize("dtype, target", [
    (torch.int8, torch.int8), (FP8_DTYPE, FP8_DTYPE), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16), (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
])
@pytest.mark.parametrize("picks", ["none", "rows", "cols", "both"])
@pytest.mark.parametrize("tasks", [1, 3])
def test_transposed_copy_holds_torch_bits(dtype, target, picks, tasks, monkeypatch):
    assert compiled.unavailable() is None  # built at install wherever a C compiler is
    monkeypatch.setattr(compiled, "TRANSPOSE_TASK", 1 if tasks > 1 else 1 << 30)
    monkeypatch.setattr(torch, "get_num_threads", lambda: tasks)
    wide = _source(dtype, (70, 90))
    src = wide[:, 5:80]  # [70, 75], rows of stride 90: not a multiple of the 32-row tile either
    rows = torch.randperm(70)[:50] if picks in ("rows", "both") else None
    cols = torch.randperm(75) if picks in ("cols", "both") else None
    out = compiled.transposed(src, rows=rows, cols=cols, dtype=target)
    expected = _reference(src, rows, cols, target)
    assert out.dtype == target and out.is_contiguous() and out.shape == expected.shape
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))  # bits, NaN or not


def test_transposed_copy_declines_what_it_does_not_do():
    assert compiled.transposed(torch.randn(4, 6).half(), dtype=torch.float32) is None  # only bf16 widens
    assert compiled.transposed(torch.randn(4, 6).t()) is None  # columns of unit stride only
    assert compiled.transposed(torch.randn(6)) is None
    assert compiled.transposed(torch.randn(4, 6), dtype=torch.bfloat16) is None  # no narrowing
    assert compiled.transposed(torch.empty(0, 6)).shape == (6, 0)


@pytest.mark.parametrize("actorder", ["none", "static", "group"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_gptq_gives_the_same_weight_with_the_compiled_copies(actorder, dtype, monkeypatch):
    W, _, H = _problem(out=96, inp=256, seed=5)
    W = W.to(dtype)
    W[:, 7] = 0
    H[7], H[:, 7] = 0, 0  # a dead input: its weights zeroed in the working copy
    args = _args(group_size=64, symmetric=False)
    solve = lambda: gptq(W, H, args, scale_dtype=torch.bfloat16, actorder=actorder).weight  # noqa: E731
    fast = solve()
    monkeypatch.setattr(compiled, "transposed", lambda *a, **k: None)
    reference = solve()
    assert torch.equal(fast.q, reference.q) and torch.equal(fast.scale, reference.scale)
    assert torch.equal(fast.zero, reference.zero)
    assert (fast.g_idx is None) == (reference.g_idx is None)
    assert fast.g_idx is None or torch.equal(fast.g_idx, reference.g_idx)
