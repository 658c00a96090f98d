"""AWQ: activation-aware scaling (and clipping) of weights before round-to-nearest.

Scaling the input columns of the balance Linears by s and dividing the previous op's
output by s leaves the model unchanged in full precision (see ptq.algorithms.smoothquant),
but changes what quantization does: columns that meet large activations get a finer grid.
AWQ searches s on a grid (Lin et al., 2024; as llm-awq `auto_scale`, llm-compressor's
AWQModifier):

    x̄ = mean |x| per input channel (calibration tokens),
    w̄ = mean over output rows of |W| / max|W| within each quantization group,
    s(r) = x̄^r / w̄^(1−r)  ("duo" scaling)  or  x̄^r  (activation only),  r = i / n_grid,
    s ← s / sqrt(max(s)·min(s)),
    loss(s) = MSE of the inspected module's output with Q(W·diag(s))·diag(1/s) in place of W.

The loss never touches the previous op: Q(W s)·(x/s) = (Q(W s)/s)·x, so replacing W by
Q(W s)/s on the unchanged input is the same computation. The identity s = 1 (plain RTN)
is tried too, so the search never picks scales worse than RTN on the calibration loss.
Optional clipping (llm-awq `auto_clip`) then shrinks each group's range where that lowers
the group's output error.

All 1 + n_grid candidates (1 + 2·n_grid with both grids) are scored by one loss call,
which returns squared-error sums (LossSums). The recipe's `loss: linear` (the default)
scores every mapping by its balance Linears' own output errors, Σ_j ‖X·ΔW_jᵀ‖², the
objective of the AWQ paper (its Eq. 4): from the Gram matrix G = Σ x xᵀ of their shared
input each candidate costs out·in² multiply-adds (`make_linear_loss`) instead of
tokens·in·out, and no forward pass. `loss: module` scores it as AutoAWQ and llm-compressor
do, by the output error of the enclosing attention or MLP module: one forward pass of every
cached batch per candidate (`make_module_loss`), tokens·(that module's FLOPs per token),
by far the largest cost of the search (where the inspected module is the balance Linear
itself, o_proj or down_proj, both losses are the Gram one).

Search and apply are separate: `awq_search` and `awq_clip_search` return plain tensors;
`apply_awq_` and `apply_clip_` change modules in place. The arithmetic is float32 but for
the Gram loss's GEMMs on an accelerator (in the forward pass's precision) and follows the
inputs' device; on a CPU the candidate weights come from the compiled grid
(ptq.algorithms.compiled).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from ptq.algorithms import compiled, smooth_compiled
from ptq.algorithms.smoothquant import apply_smoothing_, replace_
from ptq.devices import cpu_budget, cpu_parallel, map_side_by_side
from ptq.errors import PtqError
from ptq.primitives import fake_quantize, num_groups
from ptq.schemes import QuantArgs

MIN_SCALE = 1e-4
Inputs = Sequence[tuple[tuple, dict]]  # per batch: the inspected module's args and kwargs


@dataclass(frozen=True)
class AWQResult:
    """The chosen scales and how they were chosen."""

    scales: Tensor  # [in] float32, multiply the balance Linears' columns, divide the smooth op
    ratio: float | None  # r of the best grid point; None when s = 1 (plain RTN) was best
    loss: float  # mean squared output error with these scales
    baseline_loss: float  # the same with s = 1: plain RTN
    duo_scaling: bool  # whether the best grid point used w̄ (meaningless when ratio is None)


def weight_mean(weights: Sequence[Tensor], args: QuantArgs) -> Tensor:
    """w̄ [in]: mean over all rows of the balance weights of |W| / max|W| per quantization group."""
    if args.strategy in ("group", "channel"):  # bf16 on a CPU: |W| / max|W| in one pass, the same bits
        cols = weights[0].shape[-1]
        size = cols // num_groups(cols, args) if args.strategy == "group" else cols
        normalized = smooth_compiled.abs_over_max([w.detach() for w in weights], size)  # [out_total, in]
        if normalized is not None:
            return normalized.mean(dim=0)  # [in]
    W = torch.cat([w.detach() for w in weights]).float().abs_()  # [out_total, in]: a copy, then in place
    rows, cols = W.shape
    if args.strategy == "group":
        n = num_groups(cols, args)
        grouped = W.view(rows, n, cols // n)  # [out, groups, group_size]
        grouped.div_(grouped.amax(dim=-1, keepdim=True) + 1e-6)
    elif args.strategy == "tensor":
        W.div_(W.amax() + 1e-6)
    else:  # channel: the group is the whole row
        W.div_(W.amax(dim=1, keepdim=True) + 1e-6)
    return W.mean(dim=0)  # [in]


def grid_scales(x_mean: Tensor, w_mean: Tensor | None, ratio: float) -> Tensor:
    """s [in] for one grid point: x̄^r / w̄^(1−r) (w_mean given) or x̄^r, normalized, clamped."""
    return _grid_rows(x_mean, w_mean, [ratio], [w_mean is not None])[0]


def _grid_rows(x_mean: Tensor, w_mean: Tensor | None, ratios: list[float], duo: list[bool]) -> Tensor:
    """grid_scales of every ratio, [len(ratios), in], in a few ops over all rows: the rows
    with duo divide by w̄^(1−r)."""
    def column(values: list) -> Tensor:
        return torch.tensor(values, device=x_mean.device).unsqueeze(1)  # [k, 1]

    scales = x_mean.pow(column(ratios).float())  # [k, in]
    if any(duo):
        divisor = w_mean.pow(column([1.0 - r for r in ratios]).float()) + MIN_SCALE
        scales = torch.where(column(duo), scales / divisor, scales)
    scales = scales.clamp(min=MIN_SCALE)
    scales = scales / (scales.amax(dim=1, keepdim=True) * scales.amin(dim=1, keepdim=True)).sqrt()
    scales = torch.where(torch.isfinite(scales), scales, torch.ones_like(scales))
    return scales.clamp(min=MIN_SCALE)


LossSums = Callable[[Tensor], Tensor]
"""loss(scales [candidates, in]) -> float32 [candidates + 1]: each candidate's summed squared
output error, then the number of elements summed. Sums, so that processes calibrating on
shares of the samples add them (ptq.distributed.all_reduce_) and all choose alike."""

CANDIDATE_ELEMENTS = 1 << 25  # candidate weights [c, out, in] held at once: 128 MiB of float32
TASK_ELEMENTS = 1 << 20  # the Gram loss's candidates per task: this many weights (one at least)
GRAM_COLUMNS = 96  # the Gram loss's GEMMs: G's columns per block (_upper_blocks)


def grid_candidates(
    x_mean: Tensor, w_mean: Tensor, n_grid: int, duo_scaling: bool | Literal["both"]
) -> tuple[Tensor, list[tuple[float | None, bool]]]:
    """Every scale tried, [1 + grids·n_grid, in]: s = 1 (plain RTN) first, then each grid's
    ratios i / n_grid in order; and (ratio, duo) of each row (ratio None for s = 1)."""
    grids = {True: (True,), False: (False,), "both": (True, False)}[duo_scaling]
    labels: list[tuple[float | None, bool]] = [(None, False)]
    labels += [(i / n_grid, duo) for duo in grids for i in range(n_grid)]
    rows = _grid_rows(x_mean, w_mean, [r for r, _ in labels[1:]], [duo for _, duo in labels[1:]])
    return torch.cat([torch.ones_like(x_mean).unsqueeze(0), rows]), labels  # [candidates, in]


@torch.no_grad()
def awq_search(
    x_mean: Tensor,
    weights: Sequence[Tensor],
    loss: LossSums,
    *,
    args: QuantArgs,
    n_grid: int = 20,
    duo_scaling: bool | Literal["both"] = True,
) -> AWQResult:
    """Grid-search AWQ scales for balance weights [out_i, in] fed by activations with mean|x| [in].

    loss(S) gives the squared-error sums of the inspected module for each candidate scale
    in S (see LossSums, `make_module_loss`, `make_linear_loss`), all candidates in one call.
    duo_scaling=True uses x̄^r / w̄^(1−r), False x̄^r, "both" searches both grids
    (1 + 2·n_grid candidates). The first smallest loss wins (s = 1 on a tie). Non-finite
    losses (an fp16 overflow in the module) never win; PtqError if no loss is finite.
    """
    scales, labels = awq_grid(x_mean, weights, args=args, n_grid=n_grid, duo_scaling=duo_scaling)
    return awq_choice(scales, labels, loss(scales))


@torch.no_grad()
def awq_grid(
    x_mean: Tensor, weights: Sequence[Tensor], *, args: QuantArgs, n_grid: int = 20,
    duo_scaling: bool | Literal["both"] = True,
) -> tuple[Tensor, list[tuple[float | None, bool]]]:
    """awq_search's candidates: scales [candidates, in] and (ratio, duo) of each
    (grid_candidates, from the weights' w̄)."""
    if n_grid < 1:
        raise ValueError(f"n_grid must be at least 1, got {n_grid}")
    x_mean = x_mean.detach().float().clamp(min=0)  # [in]
    w_mean = weight_mean(weights, args).to(x_mean.device)  # [in]
    if w_mean.shape != x_mean.shape:
        raise ValueError(f"x_mean has {x_mean.numel()} channels, the weights have {w_mean.numel()} columns")
    return grid_candidates(x_mean, w_mean, n_grid, duo_scaling)  # [candidates, in]


def awq_choice(scales: Tensor, labels: list[tuple[float | None, bool]], sums: Tensor) -> AWQResult:
    """awq_search's pick from the candidates' loss sums [candidates + 1] (LossSums)."""
    sums = sums.double()  # [candidates + 1]
    mse = sums[:-1] / max(float(sums[-1]), 1.0)  # [candidates]
    mse = torch.where(torch.isfinite(mse), mse, torch.full_like(mse, float("inf")))
    best = int(torch.argmin(mse))  # the first of equal minima
    if mse[best] == float("inf"):
        raise PtqError(
            "AWQ found no finite loss: the inspected module gives NaN/Inf on the calibration "
            "inputs (an fp16 overflow?); load the model in bfloat16 or float32"
        )
    ratio, duo = labels[best]
    return AWQResult(scales[best], ratio, float(mse[best]), float(mse[0]), duo)


def candidate_weights(W: Tensor, scales: Tensor, args: QuantArgs, scale_dtype: torch.dtype) -> Tensor:
    """Q(W·diag(s))·diag(1/s) for each candidate s, in W's dtype:
    [candidates, out, in] from W [out, in] and scales [candidates, in]. On a CPU, group and
    channel schemes take the compiled grid (awq_grid.c, the same bits), one candidate per
    task on the CPU's threads; otherwise group and channel schemes quantize the rows of all
    candidates in one call (their rows are independent)."""
    W = W.detach()
    if compiled.awq_grid_for(W, args, scale_dtype):
        W32, s = W.float().contiguous(), scales.float().contiguous()
        out = torch.empty((len(s), *W.shape), dtype=W.dtype)
        cpu_parallel([functools.partial(compiled.awq_candidate, W32, s[c], args, scale_dtype, W.dtype, out[c], False)
                      for c in range(len(s))], cpu_budget())
        return out
    s = scales.to(device=W.device, dtype=torch.float32).unsqueeze(1)  # [c, 1, in]
    scaled = W.float() * s  # [c, out, in]
    if args.strategy in ("group", "channel"):
        q = fake_quantize(scaled.view(-1, W.shape[1]), args, scale_dtype).view_as(scaled)
    else:  # one range over the whole tensor: each candidate on its own
        q = torch.stack([fake_quantize(one, args, scale_dtype) for one in scaled])
    return (q / s).to(W.dtype)  # [c, out, in]


def _chunks(scales: Tensor, weight_elements: int) -> tuple[Tensor, ...]:
    """scales [candidates, in] in pieces whose candidate weights fit CANDIDATE_ELEMENTS."""
    return scales.split(max(1, CANDIDATE_ELEMENTS // max(1, weight_elements)))


def make_linear_loss(weights: Sequence[Tensor], gram: Tensor, tokens: int, *, args: QuantArgs,
                     scale_dtype: torch.dtype = torch.float32) -> LinearLoss:
    """Loss sums of balance Linears that read one input, each inspected by itself (o_proj,
    down_proj; or every mapping with AWQStep.loss "linear"), summed over them: from their
    input's Gram matrix gram = Σ x xᵀ [in, in] (float32, over `tokens` tokens).

    The output error of a candidate is X·ΔWᵀ (the bias cancels), so its squared sum is
    Σ ΔW ∘ (ΔW·G), ΔW = candidate weight − W: out·in² multiply-adds per candidate instead of
    tokens·in·out, for the weights' rows stacked into one W.

    - On a CPU with AMX or AVX512-BF16, bf16 weights whose shape is a multiple of 32 take
      compiled.QuadraticForm: ΔW and G rounded to bf16, the products summed in float32,
      nothing else rounded (within 1e-7 of the exact loss of those inputs), half the
      multiply-adds (G is symmetric) and no ΔW·G in memory.
    - Elsewhere on a CPU, float32 GEMMs of ΔW and G, for bf16 weights both rounded to bf16
      first (the same inputs and sums as QuadraticForm's, in another order: bf16 GEMMs there
      would be slow, or round the outputs ΔW·G to bf16, about 1e-4 off, which changed one of
      the three ratios of the bundled model's first block), G being
      symmetric in blocks of GRAM_COLUMNS of its columns, each with only its rows on and
      above the diagonal block, those above doubled (_upper_blocks): 55-60% of the
      multiply-adds (on a 2-core AVX2 EPYC 1.3-1.9x faster on SmolLM2's shapes than one
      GEMM, as accurate: within 1e-9 of float64).
    - On an accelerator, one GEMM in the forward pass's precision: bf16 for bf16 weights
      (ΔW and G rounded to bf16, the output too), float32 otherwise.

    The products of the GEMMs' outputs with ΔW are summed in float64. Candidates go
    TASK_ELEMENTS weights to a task; on a CPU each task's GEMMs run on one thread
    (cpu_parallel), so the bits do not depend on the thread count.
    """
    parts = [w.detach() for w in weights]
    W32 = torch.empty(sum(len(w) for w in parts), parts[0].shape[1], device=parts[0].device)  # [out, in]
    for w, rows in zip(parts, W32.split([len(w) for w in parts])):
        rows.copy_(w)  # widened in the copy: one pass, no stacked copy in the weights' dtype
    (out_features, in_features), dtype, device = W32.shape, parts[0].dtype, W32.device
    on_accelerator = device.type != "cpu"  # float16 G would overflow: float32 for float16 weights
    gemm_dtype = torch.bfloat16 if dtype == torch.bfloat16 and on_accelerator else torch.float32
    compiled_grid = compiled.awq_grid_for(parts[0], args, scale_dtype)
    W = None if compiled_grid else W32.to(dtype)  # the stacked weights, for the torch grid
    if compiled_grid and dtype == torch.bfloat16 and compiled.gram_kernel() and out_features % 32 == 0 \
            and in_features % 32 == 0:
        form = compiled.QuadraticForm(gram)
    else:
        # bf16 weights: ΔW and G rounded to bf16 as for QuadraticForm, whatever the GEMMs' dtype
        delta_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        G = gram.to(device=device, dtype=delta_dtype).to(gemm_dtype)  # [in, in]
        form, blocks = None, _upper_blocks(G, in_features if on_accelerator else GRAM_COLUMNS)

    def squared_errors(part: Tensor) -> list[float]:  # part [k, in]: k candidates
        if form is not None:
            d = torch.empty(W32.shape, dtype=torch.bfloat16)  # [out, in]: each candidate's in turn
            return [form.of(compiled.awq_candidate(W32, s, args, scale_dtype, dtype, d, delta=True)) for s in part]
        if compiled_grid:
            dW = torch.empty((len(part), *W32.shape), dtype=delta_dtype)  # [k, out, in]
            for s, d in zip(part, dW):
                compiled.awq_candidate(W32, s, args, scale_dtype, dtype, d, delta=True)
        else:
            dW = (candidate_weights(W, part, args, scale_dtype).float() - W32).to(delta_dtype)  # [k, out, in]
        dW = dW.to(gemm_dtype)
        flat, sums = dW.view(-1, in_features), torch.zeros(len(part), dtype=torch.float64, device=device)
        for a, b, upper in blocks:  # Σ ΔW[:, a:b] ∘ (ΔW[:, :b] · upper)
            products = (flat[:, :b] @ upper).view(len(part), -1, b - a).float().mul_(dW[:, :, a:b].float())
            sums += products.flatten(1).sum(dim=1, dtype=torch.float64)
        return sums.tolist()

    return LinearLoss(squared_errors, max(1, TASK_ELEMENTS // W32.numel()), tokens * out_features, device,
                      out_features * in_features * in_features)


class LinearLoss:
    """make_linear_loss's loss sums (a LossSums: loss(scales)), also as their tasks: tasks(scales)
    gives the candidates' squared-error sums in independent tasks of a few candidates each,
    each task's work on the thread that runs it, and sums(results) the loss sums from their
    results in order. Candidates go to tasks alike however the tasks are run: the same bits
    from a search's own threads (loss(scales)) and from a block's tasks of every mapping
    together (ptq.smoothing runs the tasks of independent searches that way, the costliest
    first, so that no thread waits while another has a mapping's candidates left)."""

    def __init__(self, squared_errors: Callable[[Tensor], list[float]], per_task: int, elements: int,
                 device: torch.device, cost: int):
        self._squared_errors, self._per_task, self._elements = squared_errors, per_task, elements
        self.device = device
        self.task_cost = cost * per_task  # multiply-adds of a whole task (cost: one candidate's), to order tasks

    def tasks(self, scales: Tensor) -> list[Callable[[], list[float]]]:
        s = scales.to(device=self.device, dtype=torch.float32).contiguous()  # [candidates, in]
        return [functools.partial(self._squared_errors, part) for part in s.split(self._per_task)]

    def sums(self, results: list[list[float]]) -> Tensor:
        sums = [value for part in results for value in part]
        return torch.tensor(sums + [float(self._elements)], dtype=torch.float64, device=self.device).float()

    @torch.no_grad()
    def __call__(self, scales: Tensor) -> Tensor:
        return self.sums(run_tasks(self.tasks(scales), self.device))


def run_tasks(tasks: list[Callable[[], list[float]]], device: torch.device) -> list[list[float]]:
    """Gram-loss tasks' results in order: on the CPU's threads (each task's work on one), on
    an accelerator one after another."""
    return cpu_parallel(tasks, cpu_budget()) if device.type == "cpu" else [task() for task in tasks]


def _upper_blocks(G: Tensor, columns: int) -> list[tuple[int, int, Tensor]]:
    """G [in, in] symmetric in blocks of `columns` columns [a, b), each with its rows [0, b):
    those above the diagonal block doubled (exactly: a power of two), so that
    Σ_blocks d[a:b] · (d[:b] · block) = d G dᵀ for any row d (columns >= in: G itself)."""
    n = G.shape[0]
    edges = list(range(0, n, columns)) + [n]
    return [(a, b, torch.cat([G[:a, a:b] * 2, G[a:b, a:b]])) for a, b in zip(edges, edges[1:])]


def make_module_loss(
    module: nn.Module,
    balance: Sequence[nn.Linear],
    inputs: Inputs,
    reference_outputs: Sequence[Tensor] | None = None,
    *,
    args: QuantArgs,
    scale_dtype: torch.dtype = torch.float32,
) -> LossSums:
    """Loss sums of any inspected module: its output error when each balance weight W is
    Q(W·diag(s))·diag(1/s), one forward pass of every cached batch per candidate.

    inputs are the cached (args, kwargs) of each calibration batch reaching `module`;
    reference_outputs its full-precision outputs for them (computed now when None). A tuple
    output counts by its first element. The weights are swapped only during a call and
    restored (the very same tensors) even if the forward raises. Q rounds its scales to
    scale_dtype, as the checkpoint will; each row's error is summed in float32, the rows in
    float64, the batches in order. On a CPU a candidate's batches run side by side
    (devices.map_side_by_side), each forward on its own thread.
    """
    if reference_outputs is None:
        reference_outputs = _run(module, inputs)
    reference = list(reference_outputs)
    count = sum(ref.numel() for ref in reference)
    elements = sum(linear.weight.numel() for linear in balance)
    batches = list(zip(inputs, reference))
    device = balance[0].weight.device

    def error_of(batch: tuple) -> float:  # one batch's; the batches run side by side
        (args, kwargs), ref = batch
        return _squared_error(ref, _output(module, args, kwargs))

    @torch.no_grad()
    def loss(scales: Tensor) -> Tensor:
        originals = [linear.weight.data for linear in balance]
        sums = []
        try:
            for part in _chunks(scales, elements):
                candidates = [candidate_weights(W, part, args, scale_dtype) for W in originals]
                for c in range(len(part)):
                    for linear, Wc in zip(balance, candidates):
                        linear.weight.data = Wc[c]  # [out, in]
                    sums.append(sum(map_side_by_side(error_of, batches, device)))
        finally:
            for linear, W in zip(balance, originals):
                linear.weight.data = W
        on = scales.device if not reference else reference[0].device
        return torch.tensor(sums + [float(count)], dtype=torch.float64, device=on).float()

    return loss


@torch.no_grad()
def _run(module: nn.Module, inputs: Inputs) -> list[Tensor]:
    return list(map_side_by_side(lambda batch: _output(module, *batch), list(inputs), next(module.parameters()).device))


def _output(module: nn.Module, args: tuple, kwargs: dict) -> Tensor:
    """module's output on one cached batch (a tuple's first element)."""
    out = module(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _squared_error(reference: Tensor, output: Tensor) -> float:
    """Σ (out − ref)² of one batch: float32 within each row, the rows added in float64."""
    d = output.float().sub_(reference.to(output.device))  # [..., features]
    return float(d.square_().sum(dim=-1).double().sum())


def apply_awq_(
    smooth: nn.Module, balance: Sequence[nn.Linear], scales: Tensor, *, rows: slice | None = None,
    weight_offset: float = 0.0,
) -> None:
    """Fold AWQ scales into the model in place (smooth op / s, balance columns · s); rows and
    weight_offset as in ptq.algorithms.smoothquant.apply_smoothing_ (fused Linears, Gemma norms)."""
    apply_smoothing_(smooth, balance, scales, rows=rows, weight_offset=weight_offset)


@torch.no_grad()
def awq_clip_search(
    W: Tensor,
    X: Tensor,
    args: QuantArgs,
    *,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    n_sample_tokens: int = 512,
    scale_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Best clipping value max_val [out, n_groups] per row and quantization group of W [out, in].

    For i = 0 .. int(max_shrink·n_grid) − 1 the range of each group is clamped to
    ±max|w|·(1 − i/n_grid) before fake-quantizing; the kept value minimizes that group's
    contribution to the output error on X [tokens, in] (evenly strided to n_sample_tokens).
    i = 0 is no clipping, so clipping never raises a group's error on the sample.

    As in llm-awq, callers skip the Linears whose outputs meet in q·kᵀ (q_proj, k_proj):
    their error is not measured by a per-Linear output loss. Integer group or channel
    schemes only.
    """
    if args.type != "int" or args.strategy not in ("group", "channel"):
        raise ValueError(f"clip search needs an int group or channel scheme, got {args.type}/{args.strategy}")
    W = W.detach().float()  # [out, in]
    rows, cols = W.shape
    n = num_groups(cols, args)
    size = cols // n
    X = X.detach().reshape(-1, cols).float().to(W.device)  # [tokens, in]
    X = X[:: max(1, X.shape[0] // n_sample_tokens)][:n_sample_tokens]
    Xg = X.view(X.shape[0], n, size)  # [tokens, groups, group_size]

    chunk = max(1, (1 << 24) // max(1, X.shape[0] * n))  # rows per pass: bounds [rows, tokens, groups]
    best_all = []
    for Wc in W.split(chunk):
        best_all.append(_clip_rows(Wc.view(-1, n, size), Xg, args, n_grid, max_shrink, scale_dtype))
    return torch.cat(best_all)  # [out, groups]


def _clip_rows(w: Tensor, Xg: Tensor, args: QuantArgs, n_grid: int, max_shrink: float, scale_dtype) -> Tensor:
    """w [rows, groups, group_size], Xg [tokens, groups, group_size] -> best max [rows, groups]."""
    rows, n, size = w.shape
    full_max = w.abs().amax(dim=-1, keepdim=True)  # [rows, groups, 1]
    reference = torch.einsum("tgk,rgk->rtg", Xg, w)  # [rows, tokens, groups]
    best_max = full_max.clone()
    best_err = torch.full((rows, n, 1), float("inf"), device=w.device)
    for i in range(int(max_shrink * n_grid)):
        max_val = full_max * (1 - i / n_grid)  # [rows, groups, 1]
        clipped = torch.maximum(torch.minimum(w, max_val), -max_val)
        q = fake_quantize(clipped.view(rows, n * size), args, scale_dtype).view(rows, n, size)
        err = (torch.einsum("tgk,rgk->rtg", Xg, q) - reference).pow(2).mean(dim=1)  # [rows, groups]
        better = err.unsqueeze(-1) < best_err
        best_err = torch.where(better, err.unsqueeze(-1), best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max.squeeze(-1)


@torch.no_grad()
def apply_clip_(linear: nn.Linear, max_val: Tensor) -> None:
    """Clamp linear's weight in place to ±max_val [out, n_groups] per row and group."""
    W = linear.weight
    rows, cols = W.shape
    if max_val.shape[0] != rows or cols % max_val.shape[1]:
        raise ValueError(f"max_val {tuple(max_val.shape)} does not fit a weight of shape {tuple(W.shape)}")
    bound = max_val.to(device=W.device, dtype=torch.float32)  # [out, groups]
    bound = bound.repeat_interleave(cols // max_val.shape[1], dim=1)  # [out, in]
    replace_(W, torch.maximum(torch.minimum(W.float(), bound), -bound).to(W.dtype))  # [out, in]
