"""GPTQ: quality floors against round-to-nearest, bit-exact consistency of what it returns,
and its behaviour on dead inputs and broken Hessians.

Problems are small and seeded: correlated inputs X = Z A (so H is far from diagonal) with
channel scales spread over e^±1.5 and four channels 20x louder than the rest.
"""

from __future__ import annotations

import pytest
import torch

from ptq.algorithms.gptq import GPTQResult, gptq
from ptq.algorithms.rtn import rtn
from ptq.primitives import FP8_DTYPE, quantize
from ptq.schemes import QuantArgs



def _problem(out: int = 64, inp: int = 256, tokens: int = 512, seed: int = 0):
    """W [out, in], X [tokens, in], H = 2/N XᵀX [in, in]."""
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(tokens, inp, generator=g)  # [tokens, in]
    A = torch.eye(inp) + torch.randn(inp, inp, generator=g) / inp**0.5  # [in, in] mixing
    X = Z @ A  # [tokens, in]
    X *= torch.exp(1.5 * (2 * torch.rand(inp, generator=g) - 1))
    X[:, torch.randperm(inp, generator=g)[:4]] *= 20
    W = torch.randn(out, inp, generator=g) / inp**0.5  # [out, in]
    return W, X, 2 / tokens * X.T @ X


def _args(bits: int = 4, group_size: int | None = 128, symmetric: bool = True) -> QuantArgs:
    strategy = "group" if group_size else "channel"
    return QuantArgs(num_bits=bits, symmetric=symmetric, strategy=strategy, group_size=group_size)


def _output_error(W, X, qw) -> float:
    """‖W Xᵀ − Ŵ Xᵀ‖."""
    return float(((W - qw.dequantize().float()) @ X.T).norm())


def _assert_consistent(result: GPTQResult, W, H, requantize: bool = True) -> None:
    """qw.dequantize() is the weight GPTQ rounded to: result.error is the GPTQ loss of exactly
    that weight, ½ tr(E H_d Eᵀ) with E = W − qw.dequantize() and H_d the dampened H; and
    re-quantizing it with qw's own parameters gives qw.q back bit for bit.

    The round trip needs (q - zero)·scale to be exact in the scale dtype; bfloat16 (8
    significant bits) cannot hold it for |q - zero| near 255, so 8-bit asymmetric weights with
    bfloat16 scales skip it (a property of dequantizing in bfloat16, not of GPTQ).
    """
    qw = result.weight
    Wq = qw.dequantize()  # [out, in]
    assert torch.isfinite(Wq.float()).all()
    if requantize:
        assert torch.equal(quantize(Wq, qw.scale, qw.zero, qw.args, qw.g_idx), qw.q)
    assert result.error == pytest.approx(float(_row_losses(result, W, H).sum()), rel=1e-4)


def _row_losses(result: GPTQResult, W, H) -> torch.Tensor:
    """The GPTQ loss of each row e of E = W − Ŵ, ½ e H_d eᵀ with H_d the dampened H, in
    float64: [out]."""
    E = (W - result.weight.dequantize().float()).double()  # [out, in]
    Hd = (H + result.damp * H.diagonal().mean() * torch.eye(H.shape[0])).double()  # [in, in]
    return 0.5 * ((E @ Hd) * E).sum(1)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", [32, 64, 128, None], ids=["g32", "g64", "g128", "channel"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_beats_rtn(bits, group_size, symmetric):
    W, X, H = _problem()
    args = _args(bits, group_size, symmetric)
    result = gptq(W, H, args, scale_dtype=torch.bfloat16)
    assert result.fallback is None and result.damp == 0.01
    qw = result.weight
    assert qw.q.dtype == torch.int8 and qw.q.shape == W.shape
    assert qw.scale.dtype == torch.bfloat16 and qw.scale.shape == (64, 256 // (group_size or 256))
    assert (qw.zero is None) == symmetric
    assert int(qw.q.min()) >= args.qmin and int(qw.q.max()) <= args.qmax
    _assert_consistent(result, W, H, requantize=bits < 8 or symmetric)
    # quality floor: at least 20% less output error than round-to-nearest on this seed
    assert _output_error(W, X, qw) < 0.8 * _output_error(W, X, rtn(W, args, torch.bfloat16))


@pytest.mark.parametrize("scales", ["updated", "original"])
@pytest.mark.parametrize("actorder", ["none", "static", "group"])
def test_both_scale_modes_beat_rtn(actorder, scales):
    W, X, H = _problem(seed=1)
    args = _args(4, 32, symmetric=False)
    result = gptq(W, H, args, scale_dtype=torch.float16, actorder=actorder, scales=scales)
    _assert_consistent(result, W, H)
    reference = rtn(W, args, torch.float16)
    assert _output_error(W, X, result.weight) < 0.85 * _output_error(W, X, reference)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_actorder_group_returns_a_group_map(symmetric):
    W, X, H = _problem(seed=2)
    args = _args(4, 64, symmetric)
    result = gptq(W, H, args, scale_dtype=torch.bfloat16, actorder="group")
    qw = result.weight
    assert qw.actorder == "group"
    assert qw.g_idx is not None and qw.g_idx.dtype == torch.int32 and qw.g_idx.shape == (256,)
    assert torch.equal(torch.bincount(qw.g_idx.long()), torch.full((4,), 64))
    # the columns were regrouped by activation order: the map is not the plain one
    assert not torch.equal(qw.g_idx, torch.arange(256, dtype=torch.int32) // 64)
    # group k holds the k-th 64 columns in order of descending diag(H)
    order = torch.argsort(H.diagonal(), descending=True, stable=True)
    assert torch.equal(qw.g_idx[order].long(), torch.arange(256) // 64)
    _assert_consistent(result, W, H)


def test_actorder_static_beats_no_actorder():
    W, X, H = _problem(seed=3)
    args = _args(4, 128)
    static = gptq(W, H, args, scale_dtype=torch.bfloat16, actorder="static")
    plain = gptq(W, H, args, scale_dtype=torch.bfloat16, actorder="none")
    assert static.weight.g_idx is None and static.weight.actorder == "static"
    assert plain.weight.g_idx is None and plain.weight.actorder is None
    _assert_consistent(static, W, H)
    # diag(H) spans e^±1.5 plus 20x channels: rounding them first is a clear gain (on this seed)
    assert _output_error(W, X, static.weight) < 0.85 * _output_error(W, X, plain.weight)


@pytest.mark.parametrize("actorder", ["none", "static", "group"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_dead_inputs_get_zero_weights(actorder, symmetric):
    W, X, _ = _problem(seed=4)
    dead = torch.tensor([0, 17, 100, 255])
    X[:, dead] = 0
    H = 2 / X.shape[0] * X.T @ X
    assert torch.equal(H.diagonal()[dead], torch.zeros(4))
    result = gptq(W, H, _args(4, 32, symmetric), scale_dtype=torch.bfloat16, actorder=actorder)
    assert result.fallback is None and result.damp == 0.01
    Wq = result.weight.dequantize().float()  # [out, in]
    assert torch.isfinite(Wq).all()
    assert torch.equal(Wq[:, dead], torch.zeros(64, 4))
    assert Wq[:, 1:17].abs().sum() > 0


def test_indefinite_hessian_raises_damping():
    W, X, H = _problem(seed=5)
    # shift H so its smallest eigenvalue is -5% of its mean diagonal: 1% dampening is not
    # enough, 10% is
    low = float(torch.linalg.eigvalsh(H.double())[0])
    shift = (low + 0.05 * float(H.diagonal().mean())) / 1.05
    bad = H - shift * torch.eye(256)
    assert float(torch.linalg.eigvalsh(bad.double())[0]) < 0
    result = gptq(W, bad, _args(4, 128), scale_dtype=torch.bfloat16)
    assert result.fallback is None
    assert result.damp == pytest.approx(0.1)
    assert torch.isfinite(result.weight.dequantize().float()).all()
    _assert_consistent(result, W, bad)


@pytest.mark.parametrize("actorder", ["none", "static"])
@pytest.mark.parametrize("indefinite", [False, True], ids=["definite", "retried"])
def test_the_factorisation_that_reorders_as_it_copies_gives_the_reversed_copys_bits(actorder, indefinite, monkeypatch):
    # where the compiled factorisation runs it follows the reversed processing order as it
    # copies H in (cholesky.takes_order) instead of factoring a reversed copy of H: the same
    # codes, scales, dampening and loss, dead inputs and a dampening retry included
    from ptq.algorithms import cholesky

    W, X, _ = _problem(seed=8)
    X[:, [3, 50]] = 0  # dead inputs
    H = 2 / X.shape[0] * X.T @ X
    if indefinite:  # 1% dampening is not enough, 10% is (test_indefinite_hessian_raises_damping)
        low = float(torch.linalg.eigvalsh(H.double())[0])
        H = H - (low + 0.05 * float(H.diagonal().mean())) / 1.05 * torch.eye(256)
    if not cholesky.takes_order(H):
        pytest.skip("the compiled factorisation does not run here")
    args = _args(4, 32)
    fused = gptq(W, H, args, scale_dtype=torch.bfloat16, actorder=actorder)
    monkeypatch.setattr(cholesky, "takes_order", lambda H: False)
    copied = gptq(W, H, args, scale_dtype=torch.bfloat16, actorder=actorder)
    assert fused.damp == copied.damp == (0.1 if indefinite else 0.01)
    assert fused.error == copied.error and fused.fallback is copied.fallback is None
    assert torch.equal(fused.weight.q, copied.weight.q) and torch.equal(fused.weight.scale, copied.weight.scale)


def _hopeless_hessian(n: int) -> torch.Tensor:
    """Symmetric, mean diagonal 0.25, but eigenvalues -1.5: no dampening up to 1.0 helps."""
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(6)))
    eigenvalues = torch.tensor([2.0, -1.5]).repeat(n // 2)
    return (Q * eigenvalues) @ Q.T


@pytest.mark.parametrize(
    "broken, reason",
    [
        (lambda n: torch.full((n, n), float("nan")), "non-finite"),
        (lambda n: -torch.eye(n), "not positive"),
        (_hopeless_hessian, "failed with dampening up to 1"),
    ],
    ids=["nan", "negative-diagonal", "indefinite"],
)
def test_broken_hessian_falls_back_to_rtn(broken, reason):
    W, _, _ = _problem(seed=6)
    args = _args(4, 64, symmetric=False)
    result = gptq(W, broken(256), args, scale_dtype=torch.bfloat16)
    assert result.fallback is not None and reason in result.fallback
    reference = rtn(W, args, torch.bfloat16, observer="mse")  # the observer GPTQ was given (its default)
    assert torch.equal(result.weight.q, reference.q)
    assert torch.equal(result.weight.scale, reference.scale)
    assert torch.isfinite(result.weight.dequantize().float()).all()


def test_scale_dtype_is_kept():
    W, _, H = _problem(seed=7)
    for scale_dtype in (torch.bfloat16, torch.float16, torch.float32):
        for actorder in ("static", "group"):
            qw = gptq(W, H, _args(4, 64, False), scale_dtype=scale_dtype, actorder=actorder).weight
            assert qw.scale.dtype == scale_dtype and qw.zero.dtype == torch.int8


@pytest.mark.parametrize("actorder", ["none", "static"])
def test_the_papers_algorithm_with_the_inverse_gives_the_same_codes(actorder):
    """ptq feeds each column's error against the original weight forward along the feedback
    matrix, from H's Cholesky factor (cholesky's docstring); Algorithm 1 of the paper feeds
    the scaled error along the rows of H⁻¹'s upper Cholesky factor. In float64, column by
    column, with the scales ptq chose, the paper's loop gives the same codes (up to
    roundings near a code's edge: float32 against float64) and the same loss."""
    W, _, H = _problem(seed=11)
    args = _args(4, None)
    result = gptq(W, H, args, scale_dtype=torch.float32, actorder=actorder, scales="original", observer="minmax")
    diag = H.diagonal()
    order = torch.argsort(diag, descending=True, stable=True) if actorder == "static" else torch.arange(len(diag))
    Hd = H.double() + result.damp * diag.double().mean() * torch.eye(len(diag), dtype=torch.float64)
    U = torch.linalg.cholesky(torch.linalg.inv(Hd[order][:, order]), upper=True)  # [in, in]
    scale = result.weight.scale.double()  # [out, 1]
    Wp = W.double()[:, order].clone()  # [out, in] in processing order
    codes, loss = torch.empty_like(Wp), 0.0
    for j in range(Wp.shape[1]):
        codes[:, j] = (Wp[:, j : j + 1] / scale).round().clamp(args.qmin, args.qmax).squeeze(1)
        e = (Wp[:, j] - codes[:, j] * scale.squeeze(1)) / U[j, j]  # [out]
        loss += float(e.square().sum()) / 2
        Wp[:, j + 1 :] -= e.unsqueeze(1) * U[j, j + 1 :]
    same = (result.weight.q[:, order].double() == codes).float().mean()
    assert same >= 0.999
    assert result.error == pytest.approx(loss, rel=1e-4)


def test_block_size_does_not_change_the_result():
    """Lazy batch updates are exact: blocks shorter than a group, or cutting through groups,
    give the same rounding (up to float summation order) as one block over all columns."""
    W, _, H = _problem(seed=8)
    args = _args(3, 64, symmetric=False)
    for actorder in ("none", "static", "group"):
        whole = gptq(W, H, args, scale_dtype=torch.float32, actorder=actorder, block_size=256)
        for block_size in (16, 48, 128):
            part = gptq(
                W, H, args, scale_dtype=torch.float32, actorder=actorder, block_size=block_size
            )
            assert (part.weight.q != whole.weight.q).float().mean() < 1e-3
            assert part.error == pytest.approx(whole.error, rel=1e-4)


def test_inputs_are_not_modified():
    W, _, H = _problem(seed=9)
    W, H = W.to(torch.bfloat16), H.clone()
    W0, H0 = W.clone(), H.clone()
    gptq(W, H, _args(4, 32), scale_dtype=torch.bfloat16, actorder="group")
    assert torch.equal(W, W0) and torch.equal(H, H0)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_fp8_weights(strategy):
    W, X, H = _problem(seed=10)
    args = QuantArgs(num_bits=8, type="float", strategy=strategy)
    result = gptq(W, H, args, scale_dtype=torch.bfloat16)
    qw = result.weight
    assert qw.q.dtype == FP8_DTYPE and qw.zero is None
    assert qw.scale.shape == ((64, 1) if strategy == "channel" else (1, 1))
    _assert_consistent(result, W, H)
    assert _output_error(W, X, qw) < 0.8 * _output_error(W, X, rtn(W, args, torch.bfloat16))


def test_rejects_what_it_cannot_do():
    W, _, H = _problem(out=8, inp=64, tokens=64)
    with pytest.raises(ValueError, match="per 'channel' or 'group'"):
        gptq(W, H, QuantArgs(num_bits=8, strategy="tensor"), scale_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unknown actorder 'weight'"):
        gptq(W, H, _args(4, 32), scale_dtype=torch.bfloat16, actorder="weight")
    with pytest.raises(ValueError, match="unknown scales"):
        gptq(W, H, _args(4, 32), scale_dtype=torch.bfloat16, scales="fixed")
    with pytest.raises(ValueError, match="does not divide"):
        gptq(W, H, _args(4, 48), scale_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"H must be \[in, in\]"):
        gptq(W, H[:32, :32], _args(4, 32), scale_dtype=torch.bfloat16)
