"""GPTQ's column loop on a GPU as Triton kernels (opt-in: PTQ_GPTQ_LOOP=triton).

The torch loop (gptq._solve) dispatches about ten small ops per column. On the first GPU
run (H200, a Llama-3-8B-shaped layer: 26,624 columns in four solves) that was 4.6 s of a
layer's 10.6, almost all of it launches of kernels over one column of a few thousand rows.
Here one launch runs a block's columns up to the next group fit: rows are independent given
F (cholesky.feedback), so each program takes a slice of the rows and keeps the block's rows
of that slice in registers while it rounds the columns one by one and feeds each column's
error forward. The group fits (a group's scale and zero point, fitted when its first column
is reached) stay in torch between launches, as do the lazy update after each block (one
GEMM) and the loss.

Each column is rounded as the torch loop rounds it: t = w / s (IEEE division), + zero,
clamped, rounded half to even, the code stored; then (t - zero) in the scale dtype times the
scale, rounded to the scale dtype, is the dequantized value; the error against the original
weight, w0 - ŵ, moves the block's later columns, and the scaled error (w - ŵ) · pivot goes
to the loss. The kernel rounds to bf16 with integer bit operations (Triton 3.9's interpreter
truncates the cast). The updates of the later columns round as the compiler contracts them
(a fused multiply-add on a GPU; torch's CPU addr_ fuses most of its elements too, not all),
so the codes can differ from the torch loop's where a
value lies within a rounding of a code's edge: tests/kernels/test_gptq_triton.py compares
codes, scales and loss with the torch loop within stated tolerances.

It has not run on a GPU yet (written after the session's device time was spent): until a
GPU run of scripts/gpu_check.sh validates it (step 5 compares it with the torch loop on the
GPU and times both), solves use it only when PTQ_GPTQ_LOOP=triton is set.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_BLOCK = 128  # the block's rows of a slice live in registers: [128, BLOCK_R] float32
BLOCK_R = 64  # weight rows (output features) per program
_RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: v + magic - magic rounds half to even, |v| < 2^22
_SCALE_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def applies(scale_dtype: torch.dtype, block_size: int, weights: int) -> bool:
    """Whether a solve that gptq_compiled.loop_for sends here fits the kernel: a block within
    MAX_BLOCK, a scale dtype it rounds to, and fewer weights than 2^31 (its offsets are 32-bit
    integers; Llama-3-405B's stacked gate/up are 1.7e9); else the torch loop runs."""
    return block_size <= MAX_BLOCK and scale_dtype in _SCALE_KINDS and weights < 2**31


@triton.jit
def _to_scale_dtype(v, KIND: tl.constexpr):
    """fp32 v rounded to the scale dtype (0 bf16, 1 fp16, 2 fp32), returned as fp32."""
    if KIND == 0:  # bf16: round the low 16 bits away, half to even (finite values)
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    elif KIND == 1:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit(do_not_specialize=["i1", "i2", "c0", "c1"])  # one compiled kernel for every block
def _columns_kernel(Wt, W0, F, E, S, Qt, scale, zero, group_of, R, i1, i2, c0, c1, stride_h, stride_hc, qmin,
                    qmax, HAS_ZERO: tl.constexpr, SCALE_KIND: tl.constexpr, BLOCK: tl.constexpr,
                    BLOCK_R: tl.constexpr):
    """Columns c0..c1-1 of the block [i1, i2) for rows pid * BLOCK_R ...: round, store the code,
    the error against W0 (E's row p - i1) and the scaled error (S's), and subtract the error's
    share from the block's later columns; the block's columns from c0 on are read once and
    written back at the end."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]: weight rows, Wt's columns
    c_mask = cols < R
    rows = i1 + tl.arange(0, BLOCK)  # [BLOCK]: the block's positions
    live = (rows >= c0) & (rows < i2)
    tile_ptrs = Wt + rows[:, None] * R + cols[None, :]
    tile = tl.load(tile_ptrs, mask=live[:, None] & c_mask[None, :], other=0.0)  # [BLOCK, BR]
    for p in range(c0, c1):
        w = tl.sum(tl.where(rows[:, None] == p, tile, 0.0), axis=0)  # [BR]: column p as it stands
        g = tl.load(group_of + p)
        s = tl.load(scale + g * R + cols, mask=c_mask, other=1.0)
        t = tl.math.div_rn(w, s)
        if HAS_ZERO:
            z = tl.load(zero + g * R + cols, mask=c_mask, other=0.0)
            t = t + z
        t = tl.minimum(tl.maximum(t, qmin), qmax)  # clamping first is the same: the bounds are integers
        t = (t + _RINT_MAGIC) - _RINT_MAGIC  # round half to even
        tl.store(Qt + p * R + cols, t.to(tl.int8), mask=c_mask)
        if HAS_ZERO:
            t = t - z
        # (t in the scale dtype) x scale, rounded to the scale dtype: bf16 and fp16 products are
        # exact in fp32, so one rounding gives what the scale dtype's multiplication gives
        q = _to_scale_dtype(_to_scale_dtype(t, SCALE_KIND) * s, SCALE_KIND)
        pivot = tl.load(F + p * stride_h + p * stride_hc)
        tl.store(S + (p - i1) * R + cols, (w - q) * pivot, mask=c_mask)
        err = tl.load(W0 + p * R + cols, mask=c_mask, other=0.0) - q  # [BR]
        tl.store(E + (p - i1) * R + cols, err, mask=c_mask)
        h = tl.load(F + p * stride_h + rows * stride_hc, mask=(rows > p) & (rows < i2), other=0.0)  # [BLOCK]
        tile = tile - h[:, None] * err[None, :]
    tl.store(tile_ptrs, tile, mask=live[:, None] & c_mask[None, :])


def solve_blocks(Wt: Tensor, W0: Tensor, F: Tensor, Err1: Tensor, Scaled: Tensor, Qt: Tensor, members: Tensor,
                 members_dev: Tensor, group: Tensor, first: dict[int, int], grid, block_size: int,
                 current) -> Tensor:
    """The column loop over Wt [in, out] (consumed; W0 its copy from before, read only) with
    the kernel, filling Qt and the grid's parameters; returns Σ Losses. F: the feedback
    matrix; Err1, Scaled [block, out]: room for a block's errors and scaled errors; first:
    position -> the group fitted there; current: gptq's _current (a group's columns as they
    stand); grid: gptq's _Grid."""
    cols, R = Wt.shape
    for t in (Wt, W0, Err1, Scaled, Qt, grid.scale_f) + (() if grid.zero is None else (grid.zero,)):
        assert t.is_contiguous(), "the Triton loop indexes rows of R elements"
    group_of = group.to(device=Wt.device, dtype=torch.int32)
    zero = grid.zero
    kind = _SCALE_KINDS[grid.scale_dtype]
    block = triton.next_power_of_2(block_size)
    launches = (triton.cdiv(R, BLOCK_R),)
    loss = torch.zeros((), device=Wt.device)
    fits = sorted(first)
    k = 0  # the next fit in `fits`
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        E, S = Err1[: i2 - i1].zero_(), Scaled[: i2 - i1]  # [block, out]
        cuts = [i1]
        while k < len(fits) and fits[k] < i2:
            if fits[k] > i1:
                cuts.append(fits[k])
            k += 1
        for c0, c1 in zip(cuts, cuts[1:] + [i2]):
            g = first.get(c0)
            if g is not None:
                grid.fit_(g, current(Wt, E, F, i1, i2, members[g], members_dev[g]), members_dev[g])
            _columns_kernel[launches](
                Wt, W0, F, E, S, Qt, grid.scale_f, zero if zero is not None else grid.scale_f, group_of,
                R, i1, i2, c0, c1, F.stride(0), F.stride(1), float(grid.args.qmin), float(grid.args.qmax),
                HAS_ZERO=zero is not None, SCALE_KIND=kind, BLOCK=block, BLOCK_R=BLOCK_R,
                num_warps=4,
            )
        loss += S.square().sum() / 2
        if i2 < cols:
            Wt[i2:].addmm_(F[i1:i2, i2:].t(), E, alpha=-1)
    return loss
