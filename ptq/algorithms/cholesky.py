"""GPTQ's factorisation: the error-feedback matrix F, from the Cholesky factor of H alone.

GPTQ (Algorithm 1) moves the columns not yet rounded by each rounded column's scaled error
(w_p - q_p) / U_pp along U's row p, U the upper Cholesky factor of H⁻¹. The same codes
follow from the Cholesky factor of H itself, with nothing inverted (GPTQ is Babai's
nearest-plane algorithm: Chen et al., "The Geometry of LLM Quantization", 2025): factor
J H J = L Lᵀ (J reverses the order), so that H⁻¹ = Uᵀ U with U = J L⁻¹ J and
G = U⁻ᵀ = J Lᵀ J lower triangular. The errors e_p = (t_p - q_p) / U_pp (t_p: the column
as it stands when rounded) and the errors against the original weights, d_p = w_p - q_p,
satisfy d = Uᵀ e; so a column k stands at t_k = w_k + Σ_{p<k} (G_kp / G_kk) d_p when it
is rounded, and the loss is ½ Σ e_p² with e_p = (t_p - q_p) G_pp. F holds both:
F_pk = -G_kp / G_kk above the diagonal (each rounded column moves the later ones by
-F_pk d_p, as GPTQ's by -U_pk e_p) and F_pp = G_pp; with m = n - 1 - p, b = n - 1 - k,
G_kp = L_mb. That is the Cholesky's n³/3 multiply-adds, without the triangular inverse's
n³/3 (on SmolLM2's 1536-row Hessian the inverse took 5.4 ms of the 12 + 5.4 + 1.4 of
factorisation, inverse and copy, on the 2-core Xeon).

On a CPU, LAPACK's Cholesky (MKL potrf, trsm) rounds differently with the thread count, and
GPTQ's rounding decisions amplify that; on one thread it took a fifth of the GPTQ job on
SmolLM2's shapes (issue 15). Here it is split by hand: every operation of the Cholesky's
blocks (a Cholesky of a BLOCK-wide diagonal block, a triangular solve, a GEMM update) runs
on one thread, the independent ones side by side on all threads (devices.cpu_parallel).
The blocks are fixed by the matrix size alone, so the bits do not depend on the thread
count. Up to SMALL rows (q/k/v, o and gate/up of SmolLM2-sized models) the blocks are too
few to keep the threads busy and their Python costs more than the arithmetic: there LAPACK
factors on one thread (with the inverse it used to compute as well, 1.5 times faster than
the blocks: 576 rows 4.3 against 6.3 ms), as independent of the thread count. On a CPU
with AVX-512, matrices of up to COMPILED rows take ptq's compiled Cholesky (linalg.c)
instead: on an AMD EPYC, where MKL runs its AVX2 code, 5-6 times LAPACK's one thread (576
rows 0.95 against 5.3 ms, 768 2.2 against 14, 1536 18.5 against 93, Cholesky and inverse
then). From compiled_cholesky.CHOLESKY_ROWS rows up its updates are shared by the threads
(a 2-core Xeon with AMX: 1536 rows 8.1-8.5 ms on two threads against 13 on one); the same
bits on any count. On a CPU with AVX2 and FMA but not AVX-512 the same code in narrower tiles (the
same bits) takes matrices of up to SMALL rows: on a 2-core AMD EPYC (Zen 3) 576 rows
2.7-5.8 against LAPACK's 12-14 ms, 768 rows 12 against 28 (with the inverses); from 1024
rows the blocked path on two threads is faster there. Above COMPILED rows on a CPU with
AVX-512 the blocks are compiled code too (blocked_cholesky_: each diagonal block's factor
inverted at once, GEMMs where LAPACK's blocks have triangular solves): on a 2-core AMD
EPYC (Zen 5), medians of five runs alternating with the torch blocks, with the inverse
then, 2048 rows 40 against 59 ms, 2816 95 against 148, 4096 242 against 411, 5632 547
against 1028 (blocks of 256 rows measured the same within the noise; 512 read the
trailing matrix half as often).

Memory: one [n, n] matrix (on down_proj's Hessian, 5632², 127 MB) and a few blocks. The
factorisation reads only the lower triangle: the strict lower triangle of the original is
first kept in the strict upper one, so that a retry with more dampening can restore it.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor

from ptq.algorithms import compiled, compiled_cholesky
from ptq.devices import cpu_budget, cpu_parallel, cpu_threads

MAX_DAMP = 1.0  # dampening retries stop at this fraction of the mean diagonal
MAX_RETRIES = 4
BLOCK = 256  # rows and columns of the factorisation's blocks
SMALL = 3 * BLOCK  # on a CPU, up to this many rows LAPACK runs on one thread instead (measured crossover)
# on a CPU with AVX-512, up to this many rows the compiled factorisation runs, on one thread
# (on 2 cores of an AMD EPYC against the blocked path: 1024 rows 6.7 against 15.6 ms, 1536
# 18 against 32; 2048 68 against 73, where its passes over the matrix no longer stay in the
# cache, and more cores would favour the blocked path)
COMPILED = 1536
COMPILED_BLOCK = 512  # rows of blocked_cholesky_'s blocks


def describe() -> str:
    """How Hessians are factored and inverted here, for the report (report.cpu)."""
    rows, kind = compiled_rows(), compiled.linalg_kind()
    if not rows:
        return "LAPACK"
    above = "compiled blocks above" if compiled.gemm_available() else "LAPACK above"
    return f"compiled ({kind}) up to {rows} rows, {above}"


def compiled_rows() -> int:
    """Up to how many rows the compiled factorisation runs here: COMPILED with AVX-512,
    SMALL with AVX2 alone, 0 without the library (compiled.linalg_kind)."""
    return {"AVX-512": COMPILED, "AVX2": SMALL}.get(compiled.linalg_kind(), 0)


def damp_schedule(damp: float) -> list[float]:
    """damp, then ten times more each retry, up to MAX_DAMP and MAX_RETRIES retries."""
    steps = [damp]
    while len(steps) <= MAX_RETRIES and steps[-1] < MAX_DAMP:
        steps.append(min(max(steps[-1], 1e-3) * 10, MAX_DAMP))
    return steps


def feedback(H: Tensor, damp: float, threads: int | None = None, order: Tensor | None = None,
             diagonal: Tensor | None = None) -> tuple[Tensor | None, float, str | None]:
    """GPTQ's error-feedback matrix F (the module's docstring) of H + λ mean(diag H) I,
    raising λ from `damp` until its Cholesky works.

    H: a float32 copy this function factors in place; or, with an order [in], the symmetric
    matrix to factor as H[order][:, order] (GPTQ's Hessian in its reversed processing order,
    J H J), which is not changed: where the compiled factorisation runs (takes_order) it
    follows the order as it copies H in, elsewhere it factors a reordered copy
    (_reordered). diagonal [in]: the diagonal to factor with in place of the (reordered)
    matrix's own (GPTQ's, dead inputs pinned to 1). Returns (F, λ, None) with F [in, in]
    upper triangular in processing order, or (None, λ, reason) when no λ works. threads:
    how many threads may share the work (cpu_budget() by default); the bits do not depend
    on it.
    """
    if order is not None and not takes_order(H):
        H, order = _reordered(H, order), None
    if not bool(torch.isfinite(H.sum())):  # a NaN or inf anywhere makes the sum one
        return None, damp, "the Hessian has non-finite entries"
    if diagonal is None:
        diagonal = H.diagonal() if order is None else H.diagonal()[order]
    base = diagonal.clone()  # [in]
    mean = base.mean()
    if not bool(mean > 0):
        return None, damp, f"the Hessian's mean diagonal is {float(mean):.3g}, not positive"
    threads = cpu_budget() if threads is None else threads
    if on_one_thread(H):
        return _feedback_small(H, base, mean, damp, threads, order)
    # the blocks' operations run side by side on one thread each (_parallel); between them
    # the copies and small steps run on this thread alone: on two threads each would first
    # wake torch's other OpenMP thread, asleep since the last (a VM's idle core wakes late)
    with cpu_threads(1) if H.device.type == "cpu" else contextlib.nullcontext():
        mirror_triangle_(H, to_upper=True)  # the original's strict lower triangle kept for retries
        for attempt, lam in enumerate(damp_schedule(damp)):
            if attempt:
                mirror_triangle_(H)
            H.diagonal().copy_(base).add_(mean * lam)
            if not (blocked_cholesky_(H, threads) if compiled_blocks(H) else cholesky_lower_(H, threads)):
                continue  # H's strict upper triangle still holds the original: retried from it
            if feedback_of_(H):
                return H, lam, None  # [in, in] upper
            # F overwrote the copy a retry would start from (only a factor with entries
            # that are not finite gets here: more dampening bounds F's by sqrt(n / λ))
            return None, lam, f"the feedback matrix of the Hessian's Cholesky factor is not finite at dampening {lam:g}"
    return None, lam, f"Cholesky of the Hessian failed with dampening up to {lam:g}"


def feedback_of_(L: Tensor) -> bool:
    """F (feedback's) in L's memory from the Cholesky factor L [n, n] in its lower triangle
    (its strict upper triangle is not read): each column divided by its diagonal entry and
    negated below the diagonal, the diagonal kept, zeros above, then both axes reversed (the
    compiled ptq_feedback_copy's values). Returns whether every entry is finite."""
    diagonal = L.diagonal().clone()  # [n]
    L.div_(diagonal.neg()).tril_(-1)  # a / -d: the bits of -(a / d)
    L.diagonal().copy_(diagonal)
    flip_(L)
    # a float64 sum of float32 values cannot overflow: it is finite iff they all are
    return bool(torch.isfinite(L.sum(dtype=torch.float64)))


def on_one_thread(H: Tensor) -> bool:
    """Whether feedback factors H in one piece (a CPU matrix of at most SMALL rows,
    or compiled_rows() where the compiled factorisation runs: from
    compiled_cholesky.CHOLESKY_ROWS rows up its pieces are taken by whichever threads come,
    the calling one alone if no other is free), so that work may run beside it. Decided by
    the size alone, never by the thread count: the bits stay the same."""
    return H.device.type == "cpu" and (H.shape[0] <= SMALL or _compiled(H))


def _compiled(H: Tensor) -> bool:
    return H.dtype == torch.float32 and H.shape[0] <= compiled_rows()


def takes_order(H: Tensor) -> bool:
    """Whether feedback follows an order as it copies H in (the compiled
    factorisation factors it) rather than factoring a reordered copy."""
    return on_one_thread(H) and _compiled(H)


def _reordered(H: Tensor, order: Tensor) -> Tensor:
    """H[order][:, order] as a new float32 matrix. On a CPU one compiled pass
    (compiled.gathered: 1536 rows, 1.2 against 2.0 ms); elsewhere rows, then columns: two
    gathers of whole rows and within rows, 2.5x faster than one gather of single elements
    (576 rows: 0.25 against 0.62 ms)."""
    copy = compiled.gathered(H, order, order)  # None where it does not apply
    return copy if copy is not None else H.index_select(0, order).index_select(1, order).float()


def _feedback_small(H: Tensor, base: Tensor, mean: Tensor, damp: float, threads: int,
                    order: Tensor | None = None) -> tuple[Tensor | None, float, str | None]:
    """feedback where on_one_thread says so: the compiled factorisation where it runs
    (compiled_rows; its Cholesky's updates shared by `threads` from
    compiled_cholesky.CHOLESKY_ROWS rows up), else LAPACK's Cholesky on one thread (H is not
    changed: the damped matrix is a copy). order: as feedback's (the compiled factorisation
    only)."""
    if _compiled(H):
        feedback_of = functools.partial(compiled_cholesky.feedback, threads=threads, order=order)
    else:
        feedback_of = _lapack_feedback
    for lam in damp_schedule(damp):
        F = feedback_of(H, base + mean * lam)  # [n, n] upper, or None
        if F is not None:
            return F, lam, None
    return None, lam, f"Cholesky of the Hessian failed with dampening up to {lam:g}"


def _lapack_feedback(H: Tensor, diag: Tensor) -> Tensor | None:
    """compiled_cholesky.feedback by LAPACK's Cholesky on one thread: F from the factor L of
    H with its diagonal replaced by diag; None when that matrix is not positive definite or
    F is not finite."""
    damped = H.clone()
    damped.diagonal().copy_(diag)
    with cpu_threads(1):
        L, info = torch.linalg.cholesky_ex(damped)  # [n, n] lower; reads the lower triangle
    if int(info) != 0:
        return None
    return L if feedback_of_(L) else None


def _parallel(tasks: list, A: Tensor, threads: int) -> list:
    """The tasks on the CPU's threads (one OpenMP thread each), or in turn on a GPU."""
    if A.device.type == "cpu":
        return cpu_parallel(tasks, threads)
    return [task() for task in tasks]


def _edges(n: int, block: int) -> list[int]:
    return list(range(0, n, block)) + [n]


def cholesky_lower_(A: Tensor, threads: int) -> bool:
    """Factor A [n, n] = L Lᵀ in place from its lower triangle (diagonal included), which
    becomes L; the strict upper triangle is neither read nor changed. Right-looking and
    blocked: a diagonal block's Cholesky, the triangular solve of the blocks below it, and
    the update of the lower triangle to their right, a block column at a time (one GEMM
    each: the same bits as tile by tile, 5-10% faster on 1536 to 2816 rows). Returns False
    when A is not positive definite (A's lower triangle then holds a partial factorisation).

    On a GPU, whose factorisation does not depend on a thread count, one call does it all."""
    if A.device.type != "cpu":
        L, info = torch.linalg.cholesky_ex(A)
        _set_lower_(A, L)
        return int(info) == 0
    edges = _edges(A.shape[0], BLOCK)
    blocks = list(zip(edges, edges[1:]))
    for k, (k0, k1) in enumerate(blocks):
        with cpu_threads(1):
            L, info = torch.linalg.cholesky_ex(A[k0:k1, k0:k1])  # [b, b] lower
        if int(info) != 0:
            return False
        _set_lower_(A[k0:k1, k0:k1], L)
        below = blocks[k + 1:]
        if not below:
            return True

        def solve(i0: int, i1: int) -> None:  # L[i, k] = A[i, k] L[k, k]⁻ᵀ
            A[i0:i1, k0:k1] = torch.linalg.solve_triangular(L.mT, A[i0:i1, k0:k1], upper=True, left=False)

        _parallel([functools.partial(solve, i0, i1) for i0, i1 in below], A, threads)

        def update(j0: int, j1: int) -> None:  # A[i, j] -= L[i, k] L[j, k]ᵀ for the block column j, i >= j
            product = A[j0:, k0:k1] @ A[j0:j1, k0:k1].t()  # [n - j0, j1 - j0]
            product[: j1 - j0].tril_()  # the diagonal block's strict upper triangle is not the matrix's
            A[j0:, j0:j1] -= product

        _parallel([functools.partial(update, j0, j1) for j0, j1 in below], A, threads)
    return True


def compiled_blocks(A: Tensor) -> bool:
    """Whether a matrix above compiled_rows() is factored by blocked_cholesky_ (a
    float32 CPU matrix, where the compiled GEMM runs: AVX-512) rather than by torch's blocks."""
    return A.device.type == "cpu" and A.dtype == torch.float32 and compiled.gemm_available()


CACHED_FLOATS = 1 << 17  # of A at a time in _gemm_subtract: 512 KiB, within a core's L2
CACHED_COLUMNS = 512  # of A's columns at most in one of those pieces


def _gemm_subtract(C: Tensor, A: Tensor, B: Tensor) -> None:
    """compiled.gemm_subtract (C -= A @ B) in pieces of A of about CACHED_FLOATS floats
    (at most CACHED_COLUMNS of its columns, and the rows to match): the compiled GEMM reads all of A
    once per 32 columns of C, from the cache where the piece fits (a tall update of 5376
    rows ran at 183 GFLOP/s, pieces of 512 rows at 245). The same bits as one call: each
    element of C is still its value less its products in order, one rounding each (a later
    piece of A's columns goes on from the sums the earlier one stored)."""
    m, k = C.shape[0], A.shape[1]
    depth = min(k, CACHED_COLUMNS)
    rows = max(8, CACHED_FLOATS // depth // 8 * 8)
    for r0 in range(0, m, rows):
        for p0 in range(0, k, depth):
            compiled.gemm_subtract(C[r0 : r0 + rows], A[r0 : r0 + rows, p0 : p0 + depth], B[p0 : p0 + depth])


def blocked_cholesky_(A: Tensor, threads: int) -> bool:
    """cholesky_lower_ (A's lower triangle becomes L; its strict upper triangle is neither
    read nor changed) in COMPILED_BLOCK-wide blocks of ptq's compiled code (linalg.c): each
    diagonal block factored and its factor inverted at once (compiled_cholesky.cholesky,
    compiled_cholesky.inverse_of_factor), and everything else GEMMs (compiled.gemm_subtract) where
    LAPACK's path has triangular solves: the blocks below a diagonal one times its inverse
    factor, then the update of the lower triangle to their right a block column at a time.
    Every task runs on one thread and its pieces are fixed by n, and each element of a
    compiled GEMM gets the same bits from any slice: the same bits on any thread count.
    Returns False when A is not positive definite."""
    n = A.shape[0]
    edges = _edges(n, COMPILED_BLOCK)
    blocks = list(zip(edges, edges[1:]))
    for k, (k0, k1) in enumerate(blocks):
        diagonal = A[k0:k1, k0:k1]
        factor = compiled_cholesky.cholesky(diagonal, diagonal.diagonal())  # reads its lower triangle; [p, p] padded
        inverse = None if factor is None else compiled_cholesky.inverse_of_factor(factor, k1 - k0)  # X_kk = L_kk⁻¹
        if inverse is None:
            return False
        _set_lower_(diagonal, factor[: k1 - k0, : k1 - k0])
        if k1 == n:
            break
        panel = A[k1:, k0:k1]  # [n - k1, b]: L_ik = A_ik X_kkᵀ
        negated_t = torch.empty_like(inverse).copy_(inverse.t()).neg_()  # [b, b]: C -= A (-X_kkᵀ)
        product = torch.zeros(n - k1, k1 - k0)
        rows = _edges(n - k1, BLOCK)
        _parallel([functools.partial(_gemm_subtract, product[r0:r1], panel[r0:r1], negated_t)
                   for r0, r1 in zip(rows, rows[1:])], A, threads)
        panel.copy_(product)

        def update(j0: int, j1: int) -> None:  # A[i, j] -= L_ik L_jkᵀ for the block column j, i >= j
            # L_ik read from product (contiguous rows: A's are n apart, a page each)
            # [b, j1 - j0], rows of unit stride (contiguous() keeps a view of one column as it is)
            right = torch.empty(k1 - k0, j1 - j0).copy_(product[j0 - k1 : j1 - k1].t())
            corner = A[j0:j1, j0:j1].clone()  # its strict upper triangle is not the matrix's
            _gemm_subtract(corner, product[j0 - k1 : j1 - k1], right)
            _set_lower_(A[j0:j1, j0:j1], corner)
            if j1 < n:
                _gemm_subtract(A[j1:, j0:j1], product[j1 - k1 :], right)
        _parallel([functools.partial(update, j0, j1) for j0, j1 in blocks[k + 1:]], A, threads)
    return True


def _set_lower_(target: Tensor, source: Tensor, diagonal: bool = True, rows: int = 512) -> None:
    """target's lower triangle = source's (diagonal included or not); target's other entries
    stay. A row block at a time (no [n, n] temporary); target and source may be views of
    one matrix (its transpose) when they share no entry written here."""
    n = target.shape[0]
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        target[r0:r1, :r0] = source[r0:r1, :r0]
        tile = target[r0:r1, r0:r1]
        lower = torch.ones_like(tile, dtype=torch.bool).tril_(0 if diagonal else -1)
        tile.copy_(torch.where(lower, source[r0:r1, r0:r1], tile))


def mirror_triangle_(A: Tensor, to_upper: bool = False) -> Tensor:
    """A [n, n] (returned) with its strict lower triangle copied from its strict upper one,
    transposed, or with to_upper the other way round, in place. On a CPU compiled
    (compiled.mirror_: 1536 rows, 0.5-0.6 against 1.9-2.8 ms), elsewhere a block of rows
    at a time."""
    if not compiled.mirror_(A, to_upper=to_upper):
        target, source = (A.t(), A) if to_upper else (A, A.t())  # A.t()'s strict lower triangle: A's strict upper one
        _set_lower_(target, source, diagonal=False)
    return A


def flip_(A: Tensor, chunk: int = 1 << 20) -> Tensor:
    """A.flip((0, 1)) in A's memory (returned), A [n, n] dense in either layout: reversing
    both axes reverses the storage, swapped a chunk of elements at a time. The same
    values and strides as flip's copy, without the copy. On a CPU compiled
    (compiled.reverse_: 1536 rows, 0.36 against 1.5 ms)."""
    if compiled.reverse_(A):
        return A
    flat = A.t().reshape(-1) if A.stride(0) == 1 else A.view(-1)  # A's storage, in order
    assert flat.data_ptr() == A.data_ptr() and flat.numel() == A.numel(), "A must be dense"
    total = flat.numel()
    for a in range(0, total // 2, chunk):
        b = min(a + chunk, total // 2)
        front = flat[a:b].clone()
        flat[a:b] = flat[total - b : total - a].flip(0)
        flat[total - b : total - a] = front.flip(0)
    return A
