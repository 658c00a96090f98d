"""The compiled moves (transpose.c: compiled.transposed, gathered, mirror_, reverse_) against
torch's, and GPTQ, the Hessian's mirror and the Cholesky steps with them against without:
moves and exact widening, so equal bits."""

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


def test_indices_out_of_range_raise_before_the_compiled_copy_reads_them():
    src = torch.randn(5, 7)
    with pytest.raises(IndexError, match=r"\[0, 5\)"):
        compiled.transposed(src, rows=torch.tensor([0, 5]))
    with pytest.raises(IndexError, match=r"\[0, 7\)"):
        compiled.gathered(src, torch.tensor([1]), torch.tensor([-1, 2]))


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


def _threads(monkeypatch, tasks: int) -> None:
    """The compiled moves split into `tasks` ranges (however small)."""
    monkeypatch.setattr(compiled, "TRANSPOSE_TASK", 1 if tasks > 1 else 1 << 30)
    monkeypatch.setattr(torch, "get_num_threads", lambda: tasks)


@pytest.mark.parametrize("tasks", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_gathered_holds_index_selects_bits(tasks, dtype, monkeypatch):
    _threads(monkeypatch, tasks)
    wide = (torch.randn(60, 80) * 100).to(dtype)
    src = wide[:, 3:70]  # rows of stride 80
    rows, cols = torch.randperm(60)[:45], torch.randint(0, 67, (90,))  # columns repeat
    assert torch.equal(compiled.gathered(src, rows, cols), src.index_select(0, rows).index_select(1, cols))
    assert compiled.gathered(src.to(torch.bfloat16), rows, cols) is None  # 4-byte elements only
    assert compiled.gathered(src.t(), cols[:10], rows) is None  # rows of unit stride only


@pytest.mark.parametrize("tasks", [1, 2, 5])
@pytest.mark.parametrize("to_upper", [False, True])
def test_mirror_copies_one_strict_triangle_onto_the_other(tasks, to_upper, monkeypatch):
    _threads(monkeypatch, tasks)
    wide = torch.randn(70, 75)
    A = wide[:, 2:72]  # [70, 70], rows of stride 75
    before = wide.clone()
    assert compiled.mirror_(A, to_upper=to_upper)
    kept = A.tril() if to_upper else A.triu()  # the triangle read, diagonal included, unchanged
    assert torch.equal(kept, (before[:, 2:72].tril() if to_upper else before[:, 2:72].triu()))
    assert torch.equal(A, A.t())
    assert torch.equal(wide[:, :2], before[:, :2]) and torch.equal(wide[:, 72:], before[:, 72:])
    assert not compiled.mirror_(torch.randn(4, 5)) and not compiled.mirror_(torch.randn(4, 4).half())


@pytest.mark.parametrize("tasks", [1, 3])
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_reverse_is_flip_in_place(tasks, layout, monkeypatch):
    _threads(monkeypatch, tasks)
    A = torch.randn(37, 29)
    A = A if layout == "rows" else A.t().contiguous().t()
    expected = A.flip((0, 1))
    assert compiled.reverse_(A) and torch.equal(A, expected) and A.stride() == expected.stride()
    assert not compiled.reverse_(torch.randn(6, 8)[:, :5])  # not dense
    assert not compiled.reverse_(torch.randn(6, 8).bfloat16())


def test_the_torch_steps_give_the_compiled_moves_bits(monkeypatch):
    # where the compiled moves do not apply (a GPU, no compiler), the torch steps run:
    # the Hessian's mirror, the Cholesky's triangle copies and flip, the reordered copy
    from ptq.algorithms import cholesky

    W, _, H = _problem(out=64, inp=300, seed=7)
    H = H.triu()  # the observer's sum before its mirror
    order = torch.randperm(300)

    def steps():
        mirrored = cholesky.mirror_triangle_(H.clone())
        Hr = cholesky._reordered(mirrored, order.flip(0))
        F, damp, failure = cholesky.feedback(Hr.clone(), 0.01)
        kept = Hr.clone()
        cholesky.mirror_triangle_(kept, to_upper=True)
        restored = kept.clone()
        cholesky.mirror_triangle_(restored)
        return mirrored, Hr, F, kept, restored, cholesky.flip_(Hr.clone())

    fast = steps()
    for name in ("mirror_", "reverse_"):
        monkeypatch.setattr(compiled, name, lambda *a, **k: False)
    monkeypatch.setattr(compiled, "gathered", lambda *a, **k: None)
    for a, b in zip(fast, steps()):
        assert torch.equal(a, b) and a.stride() == b.stride()
