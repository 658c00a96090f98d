"""ptq's compiled float32 linear algebra (linalg.c): the Cholesky factor's inverse and the
GEMM of GPTQ's lazy updates, against float64, on any shapes, the same bits however the
output is sliced."""

from __future__ import annotations

import pytest
import torch

from ptq.algorithms import compiled, compiled_cholesky

pytestmark = pytest.mark.skipif(not compiled.linalg_available(),
                                reason="needs the compiled library and AVX-512, or AVX2 and FMA")
needs_gemm = pytest.mark.skipif(not compiled.gemm_available(), reason="the compiled GEMM needs AVX-512")


def _inverse_cholesky(H, diag, narrow=False, threads=1, order=None):
    """L⁻¹ [n, n] (lower, zeros above) of compiled_cholesky.cholesky's factor (its arguments),
    by its inverse_of_factor; None when either says no."""
    A = compiled_cholesky.cholesky(H, diag, narrow, threads, order)
    return None if A is None else compiled_cholesky.inverse_of_factor(A, H.shape[0], narrow, threads)


@pytest.mark.parametrize("n", [1, 31, 32, 33, 97, 300])
def test_compiled_inverse_of_the_factor(n):
    # L⁻¹ of the damped matrix's factor against float64: lower with exact zeros above, within
    # 1e-6 of its largest entry (LAPACK's float32 is within about 1e-7 on these); only the
    # lower triangle is read (the upper holds garbage here); the same bits on a second call
    g = torch.Generator().manual_seed(n)
    x = torch.randn(2 * n + 3, n, generator=g) * torch.linspace(0.2, 2, n)
    H = x.t() @ x / n
    diag = H.diagonal() * 1.01
    garbage = H.tril() + torch.full((n, n), float("nan")).triu(1)
    X = _inverse_cholesky(garbage, diag)
    exact = H.double().clone()
    exact.diagonal().copy_(diag.double())
    expected = torch.linalg.inv(torch.linalg.cholesky(exact))
    assert torch.equal(X, X.tril())
    assert float((X.double() - expected).abs().max() / expected.abs().max()) < 1e-6
    assert torch.equal(X, _inverse_cholesky(garbage, diag))
    assert torch.equal(X, _inverse_cholesky(H.t(), diag))  # a column-major view of the same matrix


@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("n", [33, 300, 800, 1100])
def test_threads_sharing_the_inverse_give_the_bits_of_one(n, narrow, monkeypatch):
    # the Cholesky's updates (AVX-512) and L⁻¹'s tiles of columns shared by 2 or 3 threads
    # (from any size: CHOLESKY_ROWS and INVERSE_ROWS lowered), the same bits as on one; and
    # within 1e-6 of float64, as on one thread. 1100 rows: groups of 128 columns and a
    # shorter last one (1120 padded)
    if narrow and compiled.linalg_kind() != "AVX-512":
        pytest.skip("the AVX2 code alone runs here: the default already is it")
    monkeypatch.setattr(compiled_cholesky, "INVERSE_ROWS", 0)
    monkeypatch.setattr(compiled_cholesky, "CHOLESKY_ROWS", 0)
    x = torch.randn(2 * n, n, generator=torch.Generator().manual_seed(n)) * torch.linspace(0.1, 3, n)
    H = x.t() @ x / (2 * n)
    diag = H.diagonal() * 1.01
    one = _inverse_cholesky(H, diag, narrow=narrow)
    for threads in (2, 3):
        assert torch.equal(_inverse_cholesky(H, diag, narrow=narrow, threads=threads), one), threads
    exact = H.double().clone()
    exact.diagonal().copy_(diag.double())
    expected = torch.linalg.inv(torch.linalg.cholesky(exact))
    assert float((one.double() - expected).abs().max() / expected.abs().max()) < 1e-6


@pytest.mark.skipif(compiled.linalg_kind() != "AVX-512", reason="the shared Cholesky is AVX-512 code")
def test_a_thread_that_comes_late_to_the_shared_cholesky_changes_nothing():
    # whichever threads come do the work; one that arrives after it is all done finds every
    # piece taken and returns at once with the same status, A untouched (none waits forever)
    n = 300
    x = torch.randn(2 * n, n, generator=torch.Generator().manual_seed(5))
    H = x.t() @ x / (2 * n)
    diag = H.diagonal() * 1.01
    lib = compiled.library()[0]
    padded = -(-n // 32) * 32
    A, single = torch.empty(padded, padded), torch.empty(padded, padded)
    P, state = compiled_cholesky.cholesky_scratch(padded)
    assert lib.ptq_cholesky_copy(H.data_ptr(), n, n, None, diag.data_ptr(), A.data_ptr()) == 0
    assert lib.ptq_cholesky_shared(A.data_ptr(), padded, P.data_ptr(), state.data_ptr()) == 0
    done = A.clone()
    assert lib.ptq_cholesky_shared(A.data_ptr(), padded, P.data_ptr(), state.data_ptr()) == 0
    assert torch.equal(A, done)
    assert lib.ptq_cholesky_padded(H.data_ptr(), n, n, None, diag.data_ptr(), single.data_ptr(), 0) == 0
    assert torch.equal(A.tril(), single.tril())  # the one-thread call's factor


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_compiled_factorisation_says_what_failed(threads, monkeypatch):
    # on threads sharing the Cholesky too: every one of them returns (none waits forever)
    monkeypatch.setattr(compiled_cholesky, "CHOLESKY_ROWS", 0)
    n = 70
    H = torch.eye(n)
    H[40, 41] = H[41, 40] = 2.0  # indefinite in rows 40-41: the pivot of row 41 is 1 - 4 < 0
    assert _inverse_cholesky(H, H.diagonal().clone(), threads=threads) is None
    late = torch.eye(300)
    late[290, 291] = late[291, 290] = 2.0  # in the third group of 128 columns
    assert _inverse_cholesky(late, late.diagonal().clone(), threads=threads) is None
    nan = torch.eye(n)
    nan[50, 3] = float("nan")
    assert _inverse_cholesky(nan, nan.diagonal().clone()) is None
    # L = I - 64 on the first subdiagonal, exactly L Lᵀ's factor in float32 (pivots 4097 -
    # 64² = 1), but L⁻¹[i, j] = 64^(i - j) overflows float32 beyond 21 rows
    L = torch.eye(n) - 64 * torch.eye(n).roll(1, 0).tril(-1)
    steep = L @ L.t()
    assert _inverse_cholesky(steep[:21, :21].contiguous(), steep.diagonal()[:21].clone()) is not None
    assert _inverse_cholesky(steep, steep.diagonal().clone()) is None


@needs_gemm
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (7, 33, 5), (8, 32, 128), (61, 100, 128), (300, 480, 64)])
def test_gemm_subtract_against_float64(m, n, k):
    # A a transposed view (GPTQ passes F's rows as columns); sums within 2e-6 of C's and
    # the products' largest magnitude (float32 rounds each of k fused multiply-adds)
    g = torch.Generator().manual_seed(m * 1000 + n)
    C, A, B = torch.randn(m, n, generator=g), torch.randn(k, m, generator=g).t(), torch.randn(k, n, generator=g)
    expected = C.double() - A.double() @ B.double()
    out = C.clone()
    compiled.gemm_subtract(out, A, B)
    scale = float(C.abs().max() + (A.double().abs() @ B.double().abs()).max())
    assert float((out.double() - expected).abs().max()) / scale < 2e-6


@needs_gemm
@pytest.mark.parametrize("transposed", [False, True])
def test_gemm_subtract_slices_give_the_bits_of_the_whole(transposed):
    # the column loop gives each thread a slice of the output's columns (multiples of 16 but
    # the last) and the rows after the block: any slicing, the same bits. Slices of rows
    # move rows between the copied tiles of 8 and the rows left over, read in place, and
    # slices of columns between whole blocks of 32 and masked ones: every path, one result
    g = torch.Generator().manual_seed(3)
    C, B = torch.randn(203, 157, generator=g), torch.randn(128, 157, generator=g)
    A = torch.randn(128, 203, generator=g).t() if transposed else torch.randn(203, 128, generator=g)
    whole = C.clone()
    compiled.gemm_subtract(whole, A, B)
    for cuts in ([0, 16, 157], [0, 48, 96, 157], [0, 157]):
        for rows in ([0, 203], [0, 9, 200, 203]):
            sliced = C.clone()
            for a, b in zip(cuts, cuts[1:]):
                for r0, r1 in zip(rows, rows[1:]):
                    compiled.gemm_subtract(sliced[r0:r1, a:b], A[r0:r1], B[:, a:b])
            assert torch.equal(sliced, whole), (cuts, rows)
    # columns outside the view keep their values (integers: C - 1 - 1 - 1 is exactly C - 3)
    untouched = torch.randint(-100, 100, (10, 40), generator=g).float()
    before = untouched.clone()
    compiled.gemm_subtract(untouched[:, 5:25], torch.ones(10, 3), torch.ones(3, 20))
    assert torch.equal(untouched[:, :5], before[:, :5]) and torch.equal(untouched[:, 25:], before[:, 25:])
    assert torch.equal(untouched[:, 5:25], before[:, 5:25] - 3)


@pytest.mark.skipif(compiled.linalg_kind() != "AVX-512", reason="compares the AVX-512 code with the AVX2 one")
@pytest.mark.parametrize("n", [1, 31, 33, 100, 300, 768, 1100])
def test_the_avx2_code_gives_the_bits_of_the_avx512_code(n):
    x = torch.randn(2 * n, n, generator=torch.Generator().manual_seed(n)) * torch.linspace(0.1, 3, n)
    H = x.t() @ x / (2 * n)
    diag = H.diagonal() * 1.01
    assert torch.equal(_inverse_cholesky(H, diag), _inverse_cholesky(H, diag, narrow=True))
