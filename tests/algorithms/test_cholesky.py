"""GPTQ's factorisation: Gᵀ G = J (H + λ mean(diag H) I) J for the lower G that the feedback
matrix F it returns stands for (G_kk = F_kk, G_kp = -F_pk G_kk for p < k; J reverses the
order), across several blocks, after dampening retries too."""

from __future__ import annotations

import pytest
import torch

from ptq.algorithms import cholesky, compiled


def _lower(F: torch.Tensor) -> torch.Tensor:
    """G (float64) from the feedback matrix F: the Cholesky factor of the reversed H it came from."""
    F = F.double()
    return (-F * F.diagonal().unsqueeze(0)).triu(1).t() + torch.diag(F.diagonal())


def _check(H: torch.Tensor, F: torch.Tensor, lam: float) -> None:
    n = H.shape[0]
    Hd = H.double() + lam * H.diagonal().double().mean() * torch.eye(n, dtype=torch.float64)
    expected = Hd.flip((0, 1))
    assert torch.equal(F, F.triu()) and bool((F.diagonal() > 0).all())
    G = _lower(F)
    assert float((G.t() @ G - expected).abs().max() / expected.abs().max()) < 1e-5


@pytest.fixture(params=["compiled", "compiled blocks", "torch"])
def route(request, monkeypatch):
    """The ways a CPU factors: the compiled factorisation in one piece (where the CPU has
    AVX-512 or AVX2; the test skips elsewhere); above SMALL rows, compiled blocks (AVX-512);
    torch's (LAPACK on one thread up to SMALL rows, its blocks above)."""
    if request.param == "compiled" and not compiled.linalg_available():
        pytest.skip("the compiled factorisation needs the compiled library and AVX-512 or AVX2")
    if request.param == "compiled blocks" and not compiled.gemm_available():
        pytest.skip("the compiled blocks need the compiled library and AVX-512")
    if request.param != "compiled":
        monkeypatch.setattr(cholesky, "_compiled", lambda H: False)
    if request.param == "torch":
        monkeypatch.setattr(cholesky, "compiled_blocks", lambda A: False)
    return request.param


# torch and compiled blocks: LAPACK on one thread up to cholesky.SMALL rows; above, blocks
# (1000: four of torch's blocks and chunks, two compiled ones; the last partial). compiled:
# whole blocks of 32 rows, or a last one padded (100, 700, 1000)
@pytest.mark.parametrize("n", [100, 256, 700, 1000])
def test_feedback_factor(n, route):
    x = torch.randn(3 * n, n, generator=torch.Generator().manual_seed(n)) * torch.linspace(0.1, 3, n)
    H = x.t() @ x / (3 * n)
    F, lam, reason = cholesky.feedback(H.clone(), 0.01)
    assert (lam, reason) == (0.01, None)
    _check(H, F, lam)


@pytest.mark.parametrize("n", [600, 1000])  # torch: LAPACK on one thread; blocked, the original kept in the upper triangle
def test_indefinite_matrix_retries_with_more_dampening(n, route):
    # three negative eigenvalues of -0.5 against a mean diagonal near 0.6: factoring fails
    # until the dampening reaches 1.0, after the partial factorisations overwrote the copy
    g = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    eigenvalues = torch.rand(n, generator=g) + 0.1
    eigenvalues[:3] = -0.5
    H = (Q * eigenvalues) @ Q.t()
    F, lam, reason = cholesky.feedback(H.clone(), 0.01)
    assert reason is None and lam == 1.0
    _check(H, F, lam)


def test_no_dampening_is_enough(route):
    # eigenvalues 11 and -9 in the first two coordinates, mean diagonal 1: H + λ·I stays
    # indefinite up to the last retry, λ = 1
    H = torch.eye(300)
    H[0, 1] = H[1, 0] = 10.0
    F, lam, reason = cholesky.feedback(H.clone(), 0.01)
    assert F is None and lam == 1.0 and reason == "Cholesky of the Hessian failed with dampening up to 1"


def test_a_feedback_matrix_that_is_not_finite_is_no_retry_from_the_overwritten_copy(route, monkeypatch):
    # above SMALL rows F is made in place of the copy a retry would start from: it says so
    # and stops, where a retry would factor F's mirror as the Hessian
    if route == "compiled":
        pytest.skip("the compiled factorisation copies H: its retries start from H itself")
    x = torch.randn(2000, 1000, generator=torch.Generator().manual_seed(1))
    factored = []

    def not_finite(L):  # as feedback_of_ on a factor with an Inf: False
        factored.append(L)
        return False

    monkeypatch.setattr(cholesky, "feedback_of_", not_finite)
    F, lam, reason = cholesky.feedback(x.t() @ x / 2000, 0.01)
    assert F is None and lam == 0.01 and len(factored) == 1
    assert reason == "the feedback matrix of the Hessian's Cholesky factor is not finite at dampening 0.01"


@pytest.mark.parametrize("n", [1, 31, 100])
def test_the_feedback_copy_gives_the_compiled_copys_bits_and_says_whether_it_is_finite(n):
    # torch's feedback_of_ (GPU, LAPACK and blocked paths) against linalg.c's ptq_feedback_copy
    # on the same factor, padded as the compiled Cholesky leaves it
    g = torch.Generator().manual_seed(n)
    L = torch.randn(n, n, generator=g).tril(-1) + torch.diag(torch.rand(n, generator=g) + 0.1)
    F = L.clone()
    F[torch.ones(n, n, dtype=torch.bool).triu(1)] = 5.0  # not read
    assert cholesky.feedback_of_(F)
    m = torch.arange(n - 1, -1, -1)
    expected = -(L[m][:, m] / L.diagonal()[m])  # F[p, k] = -(L[m, b] / L[b, b])
    expected = expected.triu(1) + torch.diag(L.diagonal()[m])
    assert torch.equal(F, expected)
    if compiled.linalg_available():
        padded = -(-n // 32) * 32
        A = torch.eye(padded)
        A[:n, :n] = L
        out = torch.empty(n, n)
        assert compiled.library()[0].ptq_feedback_copy(A.data_ptr(), padded, n, out.data_ptr()) == 0
        assert torch.equal(out, F)
    if n > 1:  # a tiny pivot: an entry above float32's range
        L[0, 0], L[n - 1, 0] = 1e-30, 1e30
        assert not cholesky.feedback_of_(L.clone())


@pytest.mark.skipif(not compiled.gemm_available(), reason="the compiled blocks need the compiled library and AVX-512")
@pytest.mark.parametrize("n", [1100, 1025])  # three blocks of cholesky.COMPILED_BLOCK rows, the last partial or of one row
def test_compiled_blocks_keep_the_upper_triangle_and_the_bits_on_any_thread_count(n):
    # their factor: L in A's lower triangle
    x = torch.randn(2 * n, n, generator=torch.Generator().manual_seed(2))
    H = x.t() @ x / (2 * n) + torch.eye(n) * 0.01
    results = []
    for threads in (1, 2, 3):
        A = H.clone()
        A[torch.ones(n, n, dtype=torch.bool).triu(1)] = 7.0  # what the factorisation must leave alone
        assert cholesky.blocked_cholesky_(A, threads)
        assert bool((A.triu(1) == torch.full((n, n), 7.0).triu(1)).all())
        results.append(A.tril())
    assert all(torch.equal(results[0], other) for other in results[1:])
    expected = torch.linalg.cholesky(H.double())
    assert float((results[0].double() - expected).abs().max() / expected.abs().max()) < 1e-5
    # not positive definite: a negative pivot in the last block
    A = H.clone()
    A[n - 1, n - 1] = -1.0
    assert not cholesky.blocked_cholesky_(A, 2)


# 100, 700: on one thread; 1000: the Cholesky's updates shared by the threads
@pytest.mark.parametrize("n", [100, 700, 1000])
@pytest.mark.parametrize("threads", [1, 2])
def test_an_order_followed_as_it_is_copied_in_gives_the_reordered_copys_bits(n, threads):
    # GPTQ's reversed Hessian, dead inputs pinned to 1 on the diagonal, factored from H
    # and the order instead of from a reordered copy
    if not compiled.linalg_available():
        pytest.skip("the compiled factorisation needs the compiled library and AVX-512 or AVX2")
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3 * n, n, generator=g) * torch.linspace(0.1, 3, n)
    x[:, :5] = 0  # dead inputs: zero rows and columns
    H = x.t() @ x / (3 * n)
    order = torch.randperm(n, generator=g)
    diagonal = H.diagonal()[order].masked_fill(H.diagonal()[order] == 0, 1)
    copy = H[order][:, order].contiguous()
    copy.diagonal().copy_(diagonal)
    if not cholesky.takes_order(H):
        pytest.skip(f"{n} rows: not the compiled factorisation here")
    expected = cholesky.feedback(copy, 0.01, threads)
    kept = H.clone()
    got = cholesky.feedback(H, 0.01, threads, order=order, diagonal=diagonal)
    assert torch.equal(H, kept)  # not changed
    assert got[1:] == expected[1:] and torch.equal(got[0], expected[0])
