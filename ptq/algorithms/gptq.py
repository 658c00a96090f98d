"""GPTQ: quantize a weight column by column, feeding each column's rounding error forward.

Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers" (2022), Algorithm 1. For each row w of W [out, in] it minimises the layer's
output error ½ (w - ŵ) H (w - ŵ)ᵀ, H = 2/N Σ x xᵀ, one input column at a time: column q is
rounded, and its error moves the columns not yet rounded. The paper moves them by the
error divided by the diagonal of the upper Cholesky factor U of H⁻¹, along U's rows; here
by the error against the original weight, along the rows of the feedback matrix F, which
comes from the Cholesky factor of H with no inverse (cholesky's docstring: the same codes in
exact arithmetic). Updates are applied lazily: inside a block of `block_size` columns right
away, to the columns after the block once per block.

Layout: the working copy of W is kept transposed (`Wt`, [in, out]) so that the column being
rounded is a contiguous row; positions count columns in processing order, which with
activation order is the order of descending diag(H).

Each column is rounded with exactly the scale (already rounded to the scale dtype) and zero
point that the returned QuantizedWeight holds, and dequantized as `dequantize` does, so
`result.weight.dequantize()` is bit for bit the weight GPTQ fed its error forward from.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ptq.algorithms import compiled
from ptq.algorithms.cholesky import feedback, on_one_thread
from ptq.algorithms.gptq_compiled import BlockLoop, loop_for
from ptq.algorithms.rtn import rtn
from ptq.devices import cpu_budget, cpu_parallel, cpu_threads, float32_gemms
from ptq.primitives import (
    FP8_DTYPE,
    FP8_MAX,
    OBSERVERS,
    QuantizedWeight,
    num_groups,
    observer_used,
    qparams_from_minmax,
    qparams_mse,
)
from ptq.schemes import QuantArgs

ACTORDERS = ("none", "static", "group")
SCALES = ("updated", "original")


@dataclass(frozen=True)
class GPTQResult:
    """What `gptq` returns: the weight and how the solve went."""

    weight: QuantizedWeight
    damp: float  # dampening finally used, as a fraction of mean(diag H)
    fallback: str | None  # None, or why the weight was rounded to nearest instead
    error: float  # the paper's Σ Losses = ½ Σ_rows (W - Ŵ) H_damped (W - Ŵ)ᵀ


def gptq(
    W: Tensor,
    H: Tensor,
    args: QuantArgs,
    *,
    scale_dtype: torch.dtype,
    block_size: int = 128,
    damp: float = 0.01,
    actorder: str = "static",
    scales: str = "updated",
    observer: str = "mse",
) -> GPTQResult:
    """Quantize W [out, in] to `args` with GPTQ, given H [in, in] = 2/N Σ x xᵀ (float32).

    actorder: "none" keeps the column order; "static" rounds columns in order of descending
    diag(H) with groups on the original columns (no g_idx); "group" does the same with
    groups formed by consecutive columns in that order (returns g_idx). Per-channel scales
    have no groups to reorder: there "group" behaves as "static".
    scales: "updated" computes a group's scale when its first column is reached, from the
    group's columns as GPTQ has updated them so far; "original" computes all scales up front
    from W. Per-channel (and fp8 per-tensor) scales are the same in both modes.
    observer: "minmax" fits each group's range to its min and max; "mse" shrinks that range
    by the factor (1.00 down to 0.81) that minimises the group's rounding error, each
    column's squared error weighted by its diag(H), the energy of the input it multiplies.
    Neither W nor H is modified. When H cannot be inverted even after raising the
    dampening, the result is round-to-nearest with `fallback` saying why.
    """
    _check(W, H, args, block_size, damp, actorder, scales, observer)
    with float32_gemms("ieee"):  # GPTQ's float32 GEMMs stay float32 whatever the caller set
        return _gptq(W, H, args, scale_dtype, block_size, damp, actorder, scales, observer)


def _gptq(W: Tensor, H: Tensor, args: QuantArgs, scale_dtype: torch.dtype, block_size: int, damp: float,
          actorder: str, scales: str, observer: str) -> GPTQResult:
    diag = H.detach().diagonal().float()  # [in]
    dead = diag == 0  # [in]: inputs that were always zero
    diag = diag.masked_fill(dead, 1)  # dead inputs are pinned to 1, as in the factorised copy
    perm = None
    if actorder != "none":
        perm = torch.argsort(diag, descending=True, stable=True)  # [in]
    order = torch.arange(H.shape[0], device=H.device) if perm is None else perm  # [in]
    importance = diag[order]  # [in], in processing order
    threads = cpu_budget()  # read here: inside cpu_parallel below the factorisation would see 1
    reverse = order.flip(0)  # [in]: J, the factorisation's order (cholesky's docstring)
    # -> F [in, in] upper, damp, failure; H is not changed
    factor = functools.partial(feedback, H.detach(), damp, threads, order=reverse, diagonal=diag[reverse])
    prepare = functools.partial(_working_copy, W, perm, dead, args, actorder)
    if on_one_thread(H) and threads > 1:  # the working copy is made beside the factorisation
        (F, used_damp, reason), working = cpu_parallel([factor, prepare], 2)
    else:
        (F, used_damp, reason), working = factor(), None
    if F is None:
        return _fallback(W, H, dead, args, scale_dtype, used_damp, reason, observer)
    Wt, W0, members, group = working or prepare()
    grid = _Grid(members.shape[0], W.shape[0], args, scale_dtype, observer, importance)
    Qt, loss = _solve(Wt, W0, F, members, group, grid, block_size, scales)

    g_idx, position = None, None
    if perm is not None:
        position = torch.argsort(perm)  # [in]: position of each original column
        if actorder == "group" and args.strategy == "group":
            g_idx = group.to(W.device)[position].to(torch.int32)  # [in]
    zero = None if grid.zero is None else grid.zero.t().to(torch.int8).contiguous()
    weight = QuantizedWeight(
        q=_codes(Qt, position),  # [out, in]
        scale=grid.scale.t().contiguous(),  # [out, groups]
        zero=zero,  # [out, groups]
        g_idx=g_idx,
        args=args,
        actorder=None if perm is None else ("group" if g_idx is not None else "static"),
        observer=observer_used(observer, args),
    )
    return GPTQResult(weight, used_damp, None, float(loss))


def _check(
    W: Tensor, H: Tensor, args: QuantArgs, block_size: int, damp: float, actorder: str, scales: str, observer: str
) -> None:
    if W.dim() != 2:
        raise ValueError(f"W must be a 2-D weight [out, in], got shape {tuple(W.shape)}")
    n = W.shape[1]
    if tuple(H.shape) != (n, n):
        raise ValueError(
            f"H must be [in, in] = [{n}, {n}] for W {tuple(W.shape)}, got {tuple(H.shape)}"
        )
    if H.device != W.device:
        raise ValueError(f"W is on {W.device} but H on {H.device}; move both to one device")
    if actorder not in ACTORDERS:
        raise ValueError(f"unknown actorder '{actorder}'; choose one of {', '.join(ACTORDERS)}")
    if scales not in SCALES:
        raise ValueError(f"unknown scales '{scales}'; choose one of {', '.join(SCALES)}")
    if observer not in OBSERVERS:
        raise ValueError(f"unknown observer '{observer}'; choose one of {', '.join(OBSERVERS)}")
    if block_size < 1:
        raise ValueError(f"block_size must be a positive number of columns, got {block_size}")
    if not (math.isfinite(damp) and damp >= 0):
        raise ValueError(f"damp must be a finite fraction >= 0 (e.g. 0.01), got {damp}")
    if args.strategy == "token" or (args.strategy == "tensor" and args.type == "int"):
        raise ValueError(
            f"GPTQ quantizes int weights per 'channel' or 'group', not per '{args.strategy}'; "
            "change the weights' strategy"
        )
    num_groups(n, args)  # raises when group_size does not divide in


def _fallback(
    W: Tensor,
    H: Tensor,
    dead: Tensor,
    args: QuantArgs,
    scale_dtype: torch.dtype,
    damp: float,
    reason: str,
    observer: str,
) -> GPTQResult:
    """Round to nearest; error is ½ tr(E H Eᵀ) with the given H (NaN when H is not finite)."""
    W = W.detach().to(torch.float32, copy=True)  # [out, in]
    W[:, dead] = 0
    weight = rtn(W, args, scale_dtype, observer)
    E = W - weight.dequantize().float()  # [out, in]
    error = 0.5 * float(((E @ H.float()) * E).sum())
    return GPTQResult(weight, damp, f"round-to-nearest: {reason}", error)


def _working_copy(W: Tensor, perm: Tensor | None, dead: Tensor, args: QuantArgs, actorder: str
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Wt [in, out], the weight in processing order with dead inputs' weights zeroed (row p
    = column perm[p]), a copy of it that the loop only reads (the original weights its
    errors are taken against), and the group layout (_group_layout): what the column loop
    needs besides F."""
    Wt = _transposed_copy(W, perm)
    if bool(dead.any()):
        Wt[dead if perm is None else dead[perm]] = 0
    return (Wt, Wt.clone(), *_group_layout(W.shape[1], args, actorder, perm))


def _transposed_copy(W: Tensor, perm: Tensor | None) -> Tensor:
    """A float32 copy of W [out, in] as [in, out] with rows in processing order."""
    Wt = compiled.transposed(W.detach(), cols=perm, dtype=torch.float32)  # None where it does not apply
    if Wt is not None:
        return Wt
    Wt = W.detach().t()  # [in, out], a view
    # one copy in W's dtype, then float32 (no copy when W is float32: hence the clone)
    Wt = Wt.index_select(0, perm) if perm is not None else Wt.clone(memory_format=torch.contiguous_format)
    return Wt.float()


def _codes(Qt: Tensor, position: Tensor | None) -> Tensor:
    """The codes Qt [in, out] (rows in processing order; int8, or fp8) as [out, in] with
    columns in the original order: column c is row position[c]."""
    Q = Qt.view(torch.int8)  # fp8 bits travel as int8
    moved = compiled.transposed(Q, rows=position)  # None where it does not apply
    if moved is None:
        moved = (Q if position is None else Q.index_select(0, position)).t().contiguous()
    return moved.view(Qt.dtype)


def _group_layout(
    cols: int, args: QuantArgs, actorder: str, perm: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Which positions form each quantization group, on the CPU.

    members [groups, size]: the positions of each group's columns, ascending.
    group [in]: the group of each position.
    """
    if args.strategy != "group":
        members = torch.arange(cols).view(1, cols)
    elif actorder == "static":  # groups of original columns, met out of order
        assert perm is not None
        position = torch.argsort(perm.cpu())  # [in]
        members = position.view(-1, args.group_size).sort(dim=1).values
    else:  # groups of consecutive positions
        members = torch.arange(cols).view(-1, args.group_size)
    group = torch.empty(cols, dtype=torch.long)
    group[members.flatten()] = torch.arange(members.shape[0]).repeat_interleave(members.shape[1])
    return members, group


class _Grid:
    """Scale and zero point of each group, filled as groups are met, and the column rounding."""

    def __init__(
        self, groups: int, rows: int, args: QuantArgs, scale_dtype: torch.dtype, observer: str, importance: Tensor
    ):
        device = importance.device
        width = 1 if args.strategy == "tensor" else rows
        self.args = args
        self.scale_dtype = scale_dtype
        self.observer = observer
        self.importance = importance  # [in]: diag H in processing order
        self.scale = torch.ones(groups, width, dtype=scale_dtype, device=device)  # [groups, out]
        self.scale_f = torch.ones(groups, width, device=device)  # [groups, out] float32 copy
        asym = args.type == "int" and not args.symmetric
        self.zero = torch.zeros(groups, width, device=device) if asym else None  # [groups, out]
        # per-group rows as views, made once: the column loop indexes Python lists, not tensors
        self._scale = self.scale.unbind(0)
        self._scale_f = self.scale_f.unbind(0)
        self._zero = None if self.zero is None else self.zero.unbind(0)

    def fit_(self, g: int | slice, x: Tensor, positions: Tensor) -> None:
        """Parameters of group(s) g from their columns x [..., size, out] at positions [..., size]."""
        if self.args.strategy == "tensor":
            lo, hi = x.amin(dim=(-2, -1)).unsqueeze(-1), x.amax(dim=(-2, -1)).unsqueeze(-1)
            scale, zero = qparams_from_minmax(lo, hi, self.args, self.scale_dtype)
        elif self.observer == "mse":
            importance = self.importance[positions].unsqueeze(-2)  # [..., 1, size]
            scale, zero = qparams_mse(x.transpose(-1, -2), self.args, self.scale_dtype, importance)
        else:
            scale, zero = qparams_from_minmax(x.amin(dim=-2), x.amax(dim=-2), self.args, self.scale_dtype)
        self.scale[g] = scale
        self.scale_f[g] = scale.float()
        if self.zero is not None:
            self.zero[g] = zero.float()

    def round_column(self, w: Tensor, g: int, q_out: Tensor) -> Tensor:
        """Quantize column w [out] of group g into q_out; return it dequantized, as `dequantize`."""
        t = torch.div(w, self._scale_f[g])  # [out]
        if self.args.type == "float":
            q = t.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            q_out.copy_(q)
            return q.to(self.scale_dtype).mul_(self._scale[g])
        zero = self._zero[g] if self._zero is not None else None
        if zero is not None:
            t.add_(zero)
        t.round_().clamp_(self.args.qmin, self.args.qmax)
        q_out.copy_(t)
        if zero is not None:
            t.sub_(zero)
        return t.to(self.scale_dtype).mul_(self._scale[g])


def _current(
    Wt: Tensor, Err1: Tensor, F: Tensor, i1: int, i2: int, pos: Tensor, pos_dev: Tensor
) -> Tensor:
    """Columns at positions pos (ascending, none rounded yet) as they stand now: [size, out].

    Those inside the block [i1, i2) are up to date in Wt; those after it still miss the
    block's pending update -F[i1:i2, pos]ᵀ Err1 (Err1 is zero for unrounded columns).
    """
    x = Wt[pos_dev]  # [size, out]
    late = int((pos < i2).sum())
    if late < len(pos):
        x[late:] -= F[i1:i2, pos_dev[late:]].t() @ Err1
    return x


def _solve(
    Wt: Tensor,
    W0: Tensor,
    F: Tensor,
    members: Tensor,
    group: Tensor,
    grid: _Grid,
    block_size: int,
    scales: str,
) -> tuple[Tensor, Tensor]:
    """The column loop over Wt [in, out] (consumed), filling the grid: Qt [in, out] and Σ Losses.

    W0 [in, out]: Wt as it was before the loop (read only); F: cholesky.feedback's matrix.
    Each rounded column's error against W0, W0[p] - ŵ_p, moves a later column k by
    -F[p, k] times it; the loss takes its scaled error (Wt[p] - ŵ_p) F[p, p].
    On a CPU, integer weights take the compiled loop (gptq_loop.c, via gptq_compiled) when
    it was built: the same steps without an op dispatched per column; on a GPU, with
    PTQ_GPTQ_LOOP=triton, the Triton loop (gptq_triton: a launch per run of columns between
    group fits)."""
    cols, rows = Wt.shape
    device = Wt.device
    members_dev = members.to(device)
    q_dtype = FP8_DTYPE if grid.args.type == "float" else torch.int8
    Qt = torch.empty(cols, rows, dtype=q_dtype, device=device)  # [in, out]
    first: dict[int, int] = {}  # position -> group whose parameters are fitted there
    if scales == "original":
        grid.fit_(slice(None), Wt[members_dev], members_dev)
    else:
        first = {p: g for g, p in enumerate(members[:, 0].tolist())}
    loop = loop_for(device, grid.args, grid.scale_dtype)
    if loop == "compiled":
        first_at = torch.full((cols,), -1, dtype=torch.long)  # [in]
        first_at[list(first)] = torch.tensor(list(first.values()), dtype=torch.long)
        blocks = BlockLoop(Wt, W0, F, Qt, group, first_at, members, grid.importance, grid.scale_f, grid.zero,
                           grid.args, grid.scale_dtype, grid.observer, cpu_budget())
        loss = blocks.solve(block_size)
        grid.scale.copy_(grid.scale_f)  # the compiled loop fills the float32 copy, in scale_dtype's values
        return Qt, loss
    Err1 = torch.zeros(min(block_size, cols), rows, device=device)  # [block, out]: errors against W0
    Scaled = torch.empty_like(Err1)  # [block, out]: the scaled errors, for the loss
    if loop == "triton":
        from ptq.algorithms import gptq_triton  # imports triton: only where it runs

        if gptq_triton.applies(grid.scale_dtype, block_size, Wt.numel()):
            loss = gptq_triton.solve_blocks(Wt, W0, F, Err1, Scaled, Qt, members, members_dev, group, first, grid,
                                            block_size, _current)
            return Qt, loss

    loss = torch.zeros((), device=device)
    group_of = group.tolist()
    W_rows, W0_rows, Q_rows = Wt.unbind(0), W0.unbind(0), Qt.unbind(0)  # [out] views, made once
    # On a CPU the column loop runs on one thread and only the lazy block updates (GEMMs)
    # on all: the loop's ops are small (a column, a group), and on more threads each pays
    # an OpenMP fork and join, on a busy CPU a wait for a descheduled thread (issue 15: the
    # solves on SmolLM2's shapes took half the time). The codes are the same at any count.
    cpu = device.type == "cpu"
    threads = cpu_budget()
    with cpu_threads(1) if cpu else contextlib.nullcontext():
        for i1 in range(0, cols, block_size):
            i2 = min(i1 + block_size, cols)
            F1 = F[i1:i2, i1:i2]  # [block, block]
            F_rows = F1.unbind(0)
            E, S = Err1[: i2 - i1].zero_(), Scaled[: i2 - i1]  # [block, out]
            E_rows, S_rows = E.unbind(0), S.unbind(0)
            for i in range(i2 - i1):
                p = i1 + i
                g = first.get(p)
                if g is not None:
                    grid.fit_(g, _current(Wt, E, F, i1, i2, members[g], members_dev[g]), members_dev[g])
                w = W_rows[p]  # [out]
                q = grid.round_column(w, group_of[p], Q_rows[p])  # [out], dequantized
                torch.sub(w, q, out=S_rows[i])
                err1 = torch.sub(W0_rows[p], q, out=E_rows[i])
                Wt[p + 1 : i2].addr_(F_rows[i][i + 1 :], err1, alpha=-1)
            loss += S.mul_(F1.diagonal().unsqueeze(1)).square().sum() / 2
            with cpu_threads(threads) if cpu else contextlib.nullcontext():
                Wt[i2:].addmm_(F[i1:i2, i2:].t(), E, alpha=-1)
    return Qt, loss
