"""Smoothing steps (SmoothQuant, AWQ) applied to one block during calibration.

Both are function-preserving rescalings of (previous op -> Linears) pairs from the
architecture table (or the recipe's mappings): statistics are collected in one pass of
the calibration samples through the block, the scales are searched per pair (pure
functions in ptq.algorithms), then applied. Each pair's statistics depend only on its own
rescaling (the others leave its input unchanged in full precision), so one pass serves all.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ptq import moe
from ptq.algorithms.awq import (
    AWQResult,
    LinearLoss,
    LossSums,
    apply_awq_,
    apply_clip_,
    awq_choice,
    awq_clip_search,
    awq_grid,
    awq_search,
    make_linear_loss,
    make_module_loss,
    run_tasks,
)
from ptq.algorithms.smoothquant import apply_smoothing_, smoothquant_scales
from ptq.arch import ResolvedMapping, block_mappings
from ptq.calibration.observers import AbsMaxObserver, HessianObserver, MeanAbsObserver
from ptq.calibration.runner import BlockRun
from ptq.devices import cpu_budget, cpu_parallel
from ptq.distributed import all_reduce_, is_main, share_from
from ptq.recipe import AWQStep, SmoothQuantStep, TransformStep
from ptq.schemes import QuantArgs

# their errors are amplified by the attention scores: keep ranges (also of fused q/k/v Linears)
NO_CLIP = ("q_proj", "k_proj", "qkv_proj", "query_key_value")
# AWQ's statistics pass: batches started up to two waves ahead of the one the caller works on
# (runner.BlockRun.collect), so a thread done while the caller sums a batch's Gram matrices
# goes on with the next (alternating runs of AWQ, linear loss, on a 2-core Xeon with AMX:
# bundled model 0.657 -> 0.621 s, SmolLM2-shaped 6.86 -> 6.70 s, medians; three waves 0.617)
STATISTICS_WAVES = 2


@dataclass
class Smoothed:
    """What one smoothing step did to a block."""

    done: dict[str, str]  # what was done, per pair
    skipped: list[str]  # why pairs were left as they are
    statistics_seconds: float  # of the step's time, the pass that collected its statistics


def smooth_block_(
    model: nn.Module, run: BlockRun, step: TransformStep, args: QuantArgs, scale_dtype: torch.dtype,
    order: Sequence[nn.Module] | None = None,
) -> Smoothed:
    """Apply one smoothing step to the block in place. order: the block's Linears in the
    order its forward pass calls them, each once (None where unknown): the statistics pass
    then ends where the last Linear it observes is about to run (_stop_at)."""
    # the recipe's own mappings must name modules of every block; the table's may not apply
    mappings, skipped = block_mappings(model, run.block, step.mappings, strict=True, what=step.step_name)
    stop_at = _stop_at(mappings, order)
    if isinstance(step, SmoothQuantStep):
        done, seconds = _smoothquant_(run, mappings, step, stop_at)
    else:
        assert isinstance(step, AWQStep)
        done, seconds = _awq_(run, mappings, step, args, scale_dtype, stop_at)
    # a routed expert that no calibration token reached has no statistics: left as it is
    unrouted = [m.mapping.describe() for m in mappings if m.mapping.describe() not in done]
    skipped += [f"{pair} skipped: no calibration token was routed to it" for pair in unrouted]
    return Smoothed(done, skipped, seconds)


def _first_inputs(mappings: list[ResolvedMapping]) -> dict[str, nn.Linear]:
    return {m.mapping.balance[0]: m.balance[0] for m in mappings}


def _stop_at(mappings: list[ResolvedMapping], order: Sequence[nn.Module] | None) -> nn.Module | None:
    """Where the statistics pass can end: at the observed Linear (a mapping's first balance
    Linear) that the block calls last, when the order is known and holds them all. Nothing
    after it is needed: the rest of the block (down_proj's GEMM, the residual add in a
    Llama MLP) is not computed. Each AWQ mapping's inspected module contains its balance
    Linears, so its pre-hook, which records its inputs, comes before theirs."""
    position = {id(module): i for i, module in enumerate(order or ())}
    observed = [m.balance[0] for m in mappings]
    placed = observed and all(id(linear) in position for linear in observed)
    inside = all(any(module is m.balance[0] for module in m.inspect.modules()) for m in mappings)
    return max(observed, key=lambda linear: position[id(linear)]) if placed and inside else None


def _smoothquant_(
    run: BlockRun, mappings: list[ResolvedMapping], step: SmoothQuantStep, stop_at: nn.Module | None
) -> tuple[dict[str, str], float]:
    start = time.perf_counter()
    observers = run.collect(_first_inputs(mappings), AbsMaxObserver, stop_at=stop_at)
    seconds = time.perf_counter() - start
    done = {}
    for m in (m for m in mappings if m.mapping.balance[0] in observers):
        absmax = observers[m.mapping.balance[0]].value  # [in]
        scales = smoothquant_scales(absmax, [b.weight for b in m.balance], step.alpha)
        apply_smoothing_(m.smooth, m.balance, scales, rows=m.rows, weight_offset=m.weight_offset)
        done[m.mapping.describe()] = f"smoothquant alpha {step.alpha}"
    return done, seconds


def _awq_(
    run: BlockRun, mappings: list[ResolvedMapping], step: AWQStep, args: QuantArgs, scale_dtype: torch.dtype,
    stop_at: nn.Module | None,
) -> tuple[dict[str, str], float]:
    # "linear": the balance Linears of a mapping read one input (a pair whose smooth op feeds
    # a router, the only way routed experts could share one, is refused: moe.router_reads)
    start = time.perf_counter()
    inspected = _InspectedInputs(mappings, per_linear=step.loss == "linear")
    observers = run.collect(_first_inputs(mappings), MeanAbsObserver, stop_at=stop_at, hooks=inspected.hooks,
                            waves=STATISTICS_WAVES)
    seconds = time.perf_counter() - start
    done = {}
    found = [(i, m) for i, m in enumerate(mappings) if m.mapping.balance[0] in observers]

    def inputs(i: int, m: ResolvedMapping) -> tuple[Tensor, LossSums]:  # every process's sums: in turn
        return observers[m.mapping.balance[0]].value, inspected.loss(i, args, scale_dtype)

    grid = {"args": args, "n_grid": step.n_grid, "duo_scaling": step.duo_scaling}  # awq_grid's (awq_search's) options

    def search(m: ResolvedMapping, x_mean: Tensor, losses: LossSums) -> AWQResult:
        return awq_search(x_mean, [b.weight for b in m.balance], losses, **grid)

    def results() -> Iterator[AWQResult]:  # in the mappings' order
        if step.loss == "linear" and _searches_independent([m for _, m in found]):
            # the statistics read in turn, then every search's candidates as one set of tasks
            searches = [(m, observers[m.mapping.balance[0]].value, inspected.gram_loss(i, args, scale_dtype))
                        for i, m in found]
            yield from _independent_searches(searches, grid)
        else:  # each after the mappings before it are applied (a module loss runs the module)
            yield from (search(m, *inputs(i, m)) for i, m in found)

    for (i, m), result in zip(found, results()):
        apply_awq_(m.smooth, m.balance, result.scales, rows=m.rows, weight_offset=m.weight_offset)
        ratio = "none (plain RTN was best)" if result.ratio is None else f"{result.ratio:.2f}"
        gain = 1 - result.loss / result.baseline_loss if result.baseline_loss > 0 else 0.0
        what = "Linear output error" if step.loss == "linear" else "output error"
        done[m.mapping.describe()] = f"awq ratio {ratio}, {what} -{100 * gain:.0f}%"
        if step.clip:
            _clip_(run, m, args, scale_dtype)
    return done, seconds


def _independent_searches(searches: list[tuple[ResolvedMapping, Tensor, Callable[[], LinearLoss]]],
                          grid: dict) -> list[AWQResult]:
    """The linear-loss searches of mappings that do not depend on each other
    (_searches_independent), each given (mapping, x̄, a maker of its loss), with awq_grid's
    options `grid` (args, n_grid, duo_scaling) as awq_search takes them: their grids and
    losses made side by side, then the candidates of all of them as one list of tasks on the
    CPU's threads, the costliest first, so that no thread waits while another still has a
    mapping's candidates (with one search per thread, SmolLM2's gate/up search, 50 ms, beside
    q/k/v's, 18, then down's, 44, left a thread idle for 12 ms of each block's 62; the
    job's search, alternating runs on a 2-core Xeon: SmolLM2-shaped 2.01 -> 1.95 s, random
    1024 x 4 1.39 -> 1.29 s, medians). Every mapping's loss (its float32 weights, G's
    packing) is held until the tasks end. The same candidates go to the same tasks as in a
    search of its own: the same bits."""
    def prepare(m: ResolvedMapping, x_mean: Tensor, make: Callable[[], LinearLoss]) -> tuple:
        scales, labels = awq_grid(x_mean, [b.weight for b in m.balance], **grid)
        loss = make()
        return scales, labels, loss, loss.tasks(scales)

    if not searches:
        return []
    prepared = cpu_parallel([functools.partial(prepare, *search) for search in searches], cpu_budget())
    # (cost, mapping, its task's index, task), the costliest first, ties in order
    work = sorted(((loss.task_cost, k, j, task) for k, (_, _, loss, tasks) in enumerate(prepared)
                   for j, task in enumerate(tasks)), key=lambda w: -w[0])
    results = run_tasks([task for *_, task in work], prepared[0][2].device)
    done = {(k, j): result for (_, k, j, _), result in zip(work, results)}
    return [awq_choice(scales, labels, loss.sums([done[(k, j)] for j in range(len(tasks))]))
            for k, (scales, labels, loss, tasks) in enumerate(prepared)]


def _searches_independent(mappings: list[ResolvedMapping]) -> bool:
    """Whether the mappings' linear-loss searches may all run before any of their scales is
    applied: each reads only its balance weights (and statistics of the pass before), so
    where no mapping balances a Linear that an earlier one smooths or balances, each finds
    what it would one by one, applied in turn."""
    touched: set[int] = set()
    for m in mappings:
        if any(id(linear) in touched for linear in m.balance):
            return False
        touched.update(id(linear) for linear in m.balance)
        touched.add(id(m.smooth))
    return True


def _clip_(run: BlockRun, m: ResolvedMapping, args: QuantArgs, scale_dtype: torch.dtype) -> None:
    """AWQ's clipping of the mapping's balance Linears, searched on the first calibration
    batch: process 0's, whose ranges every process applies (ptq.distributed)."""
    clipped = [linear for name, linear in zip(m.mapping.balance, m.balance) if not name.endswith(NO_CLIP)]
    if not clipped:  # the same on every process: none of them sends or waits
        return
    found = None
    if is_main():  # smoothed now, as the weights are; a routed expert sees every token of the batch
        with moe.all_experts(run.block):
            inputs = run.first_input(m.balance[0]).float()
        inputs = inputs.reshape(-1, inputs.shape[-1])  # [tokens, in]
        found = [awq_clip_search(linear.weight, inputs, args, scale_dtype=scale_dtype) for linear in clipped]
    for linear, max_val in zip(clipped, share_from(found, 0)):  # one message for the mapping
        apply_clip_(linear, max_val)


class _InspectedInputs:
    """What each mapping's loss needs of its inspected module's inputs, gathered by forward
    pre-hooks during the statistics pass: the Gram matrix Σ x xᵀ of the balance Linears'
    shared input where the loss is theirs (the inspected module is the one balance Linear,
    or per_linear: AWQStep.loss "linear"; make_linear_loss, over all the balance Linears),
    else the cached (args, kwargs) of every batch (make_module_loss)."""

    def __init__(self, mappings: list[ResolvedMapping], per_linear: bool = False) -> None:
        self.mappings = mappings
        self.grams: dict[int, HessianObserver] = {}
        self.calls: dict[int, list] = {}
        self.hooks: list[tuple[nn.Module, Callable[[tuple, dict], None]]] = []  # for BlockRun.collect
        for i, m in enumerate(mappings):
            if per_linear or (len(m.balance) == 1 and m.inspect is m.balance[0]):
                self.grams[i] = HessianObserver()  # Σ x xᵀ (its gram), float32 to float32 accuracy
                # the balance Linears read one input
                self.hooks.append((m.balance[0], lambda a, kw, o=self.grams[i]: o.update(a[0])))
            else:
                self.calls[i] = []
                self.hooks.append((m.inspect, lambda a, kw, c=self.calls[i]: c.append((a, kw))))

    def loss(self, i: int, args: QuantArgs, scale_dtype: torch.dtype) -> LossSums:
        """The mapping's loss sums over the samples of every process (ptq.distributed): the
        module losses of each process's own samples are summed; the Gram matrix is already
        every process's (HessianObserver.gram combines them, and counts their tokens), read
        here, in the order every process keeps; the Gram loss (its float32 copy of the
        weights, G's packing) is made within each call, so that a block's searches side by
        side hold those only while they run (awq_search calls it once)."""
        m = self.mappings[i]
        if i in self.calls:
            local = make_module_loss(m.inspect, m.balance, self.calls.pop(i), args=args, scale_dtype=scale_dtype)
            return lambda scales: all_reduce_(local(scales))
        make = self.gram_loss(i, args, scale_dtype)
        return lambda scales: make()(scales)  # made in the call (a search's thread), its copies freed after it

    def gram_loss(self, i: int, args: QuantArgs, scale_dtype: torch.dtype) -> Callable[[], LinearLoss]:
        """A maker of mapping i's Gram loss (per_linear, or a mapping whose inspected module is
        its one balance Linear): the Gram matrix read now (every process's, in turn), the
        loss made when called (its float32 weights and G's packing held from then on)."""
        m, observer = self.mappings[i], self.grams.pop(i)
        gram = observer.gram()  # [in, in]: Σ x xᵀ, the running sum itself (read once, now: every process's)
        return functools.partial(make_linear_loss, [b.weight for b in m.balance], gram, observer.tokens, args=args,
                                 scale_dtype=scale_dtype)
