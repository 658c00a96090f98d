"""GPTQ's column loop on a CPU through the compiled gptq_loop.c (ptq.algorithms.compiled
loads it), called with ctypes.

The torch loop (gptq._solve) dispatches about ten small ops per column; at SmolLM2's
shapes that was most of the solve time, and on a busy CPU each op is a chance to wait
(issue 15). The compiled loop does a block of columns per call. Rows are independent
given F, so each thread takes a slice of the rows through every block, lazy updates
included (ctypes and torch let go of the GIL meanwhile): what each row gets is the same
for any thread count.

`loop_for` says which loop a solve takes; `unavailable()` why the compiled one cannot be
used, for the report. PTQ_GPTQ_LOOP=torch forces the torch loop.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from ptq.algorithms import compiled
from ptq.devices import cpu_parallel
from ptq.modules import triton_installed
from ptq.primitives import MSE_COARSE, MSE_FINE
from ptq.schemes import QuantArgs

ENV = "PTQ_GPTQ_LOOP"  # "torch": always the torch loop; "triton": the Triton loop on a GPU
MIN_ROWS_PER_THREAD = 64  # fewer rows gain nothing from another thread


def unavailable() -> str | None:
    """Why CPU solves take the torch loop, or None when they take the compiled one."""
    if os.environ.get(ENV, "").lower() == "torch":
        return f"{ENV}=torch is set"
    return compiled.unavailable()


def loop_for(device: torch.device, args: QuantArgs, scale_dtype: torch.dtype) -> str:
    """'compiled', 'triton' or 'torch': the loop a solve on `device` with these weights takes.
    On a GPU the Triton loop (gptq_triton) is opt-in, PTQ_GPTQ_LOOP=triton, until a GPU run
    has validated it."""
    if device.type == "cuda":
        wanted = os.environ.get(ENV, "").lower() == "triton"
        return "triton" if wanted and args.type == "int" and triton_installed() else "torch"
    if device.type != "cpu" or args.type != "int" or unavailable() or not compiled.has_dtypes(scale_dtype):
        return "torch"
    return "compiled"



def row_slices(rows: int, threads: int) -> list[tuple[int, int]]:
    """The weight's rows [r0, r1) each thread takes through the loop: about equal, starting
    at multiples of 16, none under MIN_ROWS_PER_THREAD rows (fewer threads then)."""
    threads = max(1, min(threads, rows // MIN_ROWS_PER_THREAD))
    edges = [rows * k // threads // 16 * 16 for k in range(threads)] + [rows]
    return list(zip(edges, edges[1:]))


class BlockLoop:
    """The compiled loop over one weight: `solve(block_size)` runs it, a block of positions
    at a time.

    Wt [cols, R] float32 (each row, once rounded, holds its errors against W0: the block's
    rows are its errors for the lazy update) and W0, the same before the loop (read only),
    F [cols, cols] float32 (cholesky.feedback's; any strides) and Qt [cols, R] int8, all
    contiguous where not said otherwise; group [cols] the group of each
    position, first [cols] the group fitted at each position (-1: none), members
    [groups, size], importance [cols]; scale, zero [groups, R] float32 (zero None when
    symmetric), filled as groups are fitted. portable: not the AVX-512 code for the block's
    updates (the same bits: for tests).
    """

    def __init__(self, Wt: Tensor, W0: Tensor, F: Tensor, Qt: Tensor, group: Tensor, first: Tensor,
                 members: Tensor, importance: Tensor, scale: Tensor, zero: Tensor | None, args: QuantArgs,
                 scale_dtype: torch.dtype, observer: str, threads: int, portable: bool = False):
        self._lib = compiled.library()[0]
        self._Wt, self._F = Wt, F
        mse = observer == "mse"
        candidates = torch.tensor(MSE_COARSE if mse else (1.0,), dtype=torch.float32)
        group, first, members = group.long().contiguous(), first.long().contiguous(), members.long().contiguous()
        importance = importance.float().contiguous()
        self._keep = (group, first, members, importance, candidates)  # alive while C reads them
        assert W0.shape == Wt.shape == Qt.shape, "W0 and Qt: Wt's shape"
        for t in (Wt, W0, Qt, scale) + (() if zero is None else (zero,)):
            assert t.shape[-1] == Wt.shape[1], "the loop's rows of R elements"
            assert t.is_contiguous() and t.device.type == "cpu", "the compiled loop takes contiguous CPU tensors"
        self._slices = row_slices(Wt.shape[1], threads)
        self._fixed = (  # ptq_gptq_block's arguments after r0, r1, i1, i2 and the loss's place
            Wt.data_ptr(), W0.data_ptr(), Wt.shape[1], F.data_ptr(), F.stride(0), F.stride(1), Qt.data_ptr(),
            group.data_ptr(), first.data_ptr(), members.data_ptr(), members.shape[1],
            importance.data_ptr() if mse else None, scale.data_ptr(), None if zero is None else zero.data_ptr(),
            compiled.KINDS[scale_dtype], float(args.qmin), float(args.qmax), candidates.data_ptr(),
            candidates.numel(), MSE_FINE if mse else 0.0, int(portable),
        )

    def solve(self, block_size: int) -> Tensor:
        """The whole loop, blocks of block_size positions; returns Σ Losses (float64).

        Each thread takes one slice of the rows through every block: the block's columns
        (ptq_gptq_block), then the lazy update of its rows after the block (one GEMM on
        this thread: compiled.gemm_subtract where the CPU has AVX-512, 195-218 against
        MKL's 98 GFLOP/s on one thread of an AMD EPYC, whose AVX2 code MKL runs; else
        torch's addmm_). The slices share no row, and no thread waits on another between
        blocks: one wake-up per solve instead of two per block, and a slice's rows of Wt
        stay in its core's cache (SmolLM2's four solves per layer: 42-44 -> 34-36 ms).
        Each row gets what it gets with all rows in one slice: the lazy update of a slice's
        columns sums each element over the block's positions as the whole GEMM does (the
        compiled GEMM by construction; MKL sums an element's products in one order whatever
        the output's width; the tests check the codes at 1 to 3 threads, i.e. 1 to 3
        slices)."""
        Wt, F = self._Wt, self._F
        cols = Wt.shape[0]
        starts = list(range(0, cols, block_size))
        losses = torch.zeros(len(starts), len(self._slices), dtype=torch.float64)  # [block, slice]
        block = self._lib.ptq_gptq_block
        lazy_update = compiled.gemm_subtract if compiled.gemm_available() else _addmm_subtract

        def rows(k: int, r0: int, r1: int) -> int:
            for b, i1 in enumerate(starts):
                i2 = min(i1 + block_size, cols)
                # the block's Σ s² (its scaled errors on the slice) into losses[b, k]
                if block(r0, r1, i1, i2, losses[b, k].data_ptr(), *self._fixed):
                    return 1
                if i2 < cols:
                    lazy_update(Wt[i2:, r0:r1], F[i1:i2, i2:].t(), Wt[i1:i2, r0:r1])  # the block's errors
            return 0

        tasks = [functools.partial(rows, k, r0, r1) for k, (r0, r1) in enumerate(self._slices)]
        if any(cpu_parallel(tasks, len(tasks))):
            raise MemoryError("the compiled GPTQ loop ran out of memory (a group's columns, a slice's sums)")
        return losses.sum() / 2


def _addmm_subtract(C: Tensor, A: Tensor, B: Tensor) -> None:
    """C -= A @ B in place (torch's GEMM): the lazy update where the compiled one does not run."""
    C.addmm_(A, B, alpha=-1)
