"""ptq's compiled factorisation (linalg.c, in the library that compiled.library loads): the
Cholesky factor of a float32 CPU matrix, its triangular inverse (the blocked factorisation's
diagonal blocks) and GPTQ's error-feedback matrix from it (ptq.algorithms.cholesky drives
them). linalg.c's code in AVX-512 or, on CPUs with AVX2 and FMA alone, in narrower tiles of
the same bits (compiled.linalg_kind); the threads that share a factorisation each take
pieces fixed by its size, so the bits do not depend on how many there are.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ptq.algorithms.compiled import c_indices, c_pointer, library, linalg_kind
from ptq.devices import cpu_parallel

INVERSE_ROWS = 768  # from this many rows, inverse_of_factor's L⁻¹ is shared by threads (below: one)
CHOLESKY_ROWS = 768  # and the Cholesky's updates (ptq_cholesky_shared)


def cholesky_scratch(padded: int) -> tuple[Tensor, Tensor]:
    """The buffers that the threads sharing a Cholesky of `padded` rows pass to
    ptq_cholesky_shared: P (float32) and its state (int64 zeros), of the sizes linalg.c asks."""
    sizes = torch.empty(2, dtype=torch.int64)
    library()[0].ptq_cholesky_scratch(padded, sizes.data_ptr())
    return torch.empty(int(sizes[0])), torch.zeros(int(sizes[1]), dtype=torch.int64)


def cholesky(H: Tensor, diag: Tensor, narrow: bool = False, threads: int = 1,
             order: Tensor | None = None) -> Tensor | None:
    """The Cholesky factor L of H [n, n] (float32 on a CPU, its lower triangle read), or with
    an order [n] of H[order][:, order] taken as it is copied in (H symmetric: both triangles
    read), with its diagonal replaced by diag [n] (linalg.c; linalg_available must have said
    yes), in its lower triangle of a [p, p] buffer, p = n rounded up to 32 (the rest: the
    identity's; above the diagonal: zeros); None when that matrix is not positive definite.
    From CHOLESKY_ROWS rows up its updates (rows of 8, a block column at a time) are shared
    by up to `threads` threads (cpu_parallel), each piece the same bits whichever thread
    computes it; below, it all runs on this thread. One 1536-row Cholesky on the 2-core
    Xeon: 13 ms on one thread, 8.1-8.5 on two. narrow: the AVX2 code even where the CPU has
    AVX-512 (the same bits: for tests)."""
    n = H.shape[0]
    assert H.dtype == diag.dtype == torch.float32 and H.shape == (n, n) and H.device.type == "cpu"
    lib = library()[0]
    H = H if H.stride(1) == 1 else H.contiguous()
    diag, R = diag.contiguous(), c_indices(order, n)
    padded = -(-n // 32) * 32  # n rounded up to linalg.c's BLOCK
    A = torch.empty(padded, padded, dtype=torch.float32)
    if threads > 1 and padded >= CHOLESKY_ROWS and not narrow and linalg_kind() == "AVX-512":
        status = lib.ptq_cholesky_copy(H.data_ptr(), n, H.stride(0), c_pointer(R), diag.data_ptr(), A.data_ptr())
        P, state = cholesky_scratch(padded)
        shared = functools.partial(lib.ptq_cholesky_shared, A.data_ptr(), padded, P.data_ptr(), state.data_ptr())
        status = status or max(cpu_parallel([shared] * threads, threads))
    else:
        status = lib.ptq_cholesky_padded(H.data_ptr(), n, H.stride(0), c_pointer(R), diag.data_ptr(), A.data_ptr(),
                                         int(narrow))
    if status == 3:
        raise MemoryError(f"the compiled Cholesky ran out of memory for {n} rows")
    assert status != 4, "the compiled Cholesky needs AVX-512, or AVX2 and FMA"
    return A if status == 0 else None


def inverse_of_factor(A: Tensor, n: int, narrow: bool = False, threads: int = 1) -> Tensor | None:
    """L⁻¹ [n, n] (lower, zeros above) for the factor L that cholesky returned in A; None when
    an entry is not finite. From INVERSE_ROWS rows up L⁻¹'s tiles of columns are shared by
    up to `threads` threads, the same bits as on one."""
    padded, lib = A.shape[0], library()[0]
    X, next_tile = torch.empty(padded, padded, dtype=torch.float32), torch.zeros(1, dtype=torch.int64)
    tiles = functools.partial(lib.ptq_inverse_tiles, A.data_ptr(), padded, X.data_ptr(), next_tile.data_ptr(),
                              int(narrow))
    if threads > 1 and padded >= INVERSE_ROWS:
        cpu_parallel([tiles] * threads, threads)
    else:
        tiles()
    out = torch.empty(n, n, dtype=torch.float32)
    return out if lib.ptq_inverse_copy(X.data_ptr(), padded, n, out.data_ptr()) == 0 else None


def feedback(H: Tensor, diag: Tensor, narrow: bool = False, threads: int = 1,
             order: Tensor | None = None) -> Tensor | None:
    """GPTQ's error-feedback matrix F [n, n] (cholesky.feedback) from cholesky's factor L
    (its arguments) of the matrix in GPTQ's reversed order: F[p, p] = L[m, m] and F[p, k] =
    -(L[m, b] / L[b, b]) for k > p (m = n - 1 - p, b = n - 1 - k), zeros below the
    diagonal; None when the matrix is not positive definite or F is not finite."""
    A = cholesky(H, diag, narrow, threads, order)
    if A is None:
        return None
    n = H.shape[0]
    out = torch.empty(n, n, dtype=torch.float32)
    status = library()[0].ptq_feedback_copy(A.data_ptr(), A.shape[0], n, out.data_ptr())
    if status == 3:
        raise MemoryError(f"the compiled factorisation ran out of memory for {n} rows")
    return out if status == 0 else None
