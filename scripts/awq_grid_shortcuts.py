"""What cheaper AWQ scale searches would choose: each shortcut replayed against the full grid.

ptq's AWQ (ptq.algorithms.awq, loss "linear") scores 1 + n_grid candidate scales per
smoothing pair, each by Σ ΔW ∘ (ΔW·G): out·in² multiply-adds, half that where G's symmetry
is used. GPTQ's column loop over the same weights takes about out·in², so at n_grid 20 the
search does about 10 times the solves' work (scripts/bench_gptq_vs_llmcompressor.py prints
both) and cannot undercut them unless it scores fewer candidates, or scores them on less.

This script measures what that would cost in accuracy. It collects each pair's statistics
(mean |x| and the Gram matrix G of the balance Linears' input) in one full-precision pass
over the calibration tokens (ptq's pipeline takes each block's after the blocks before it
are quantized: the same kind of losses, not the same numbers), computes
every candidate's loss row by row (float64 sums of the bf16-rounded ΔW and G that ptq's
search multiplies, for bf16 weights), checks that their smallest is the candidate ptq's own
awq_search picks, and replays the shortcuts on them:

- rows 1/k, best m: the losses of an evenly strided 1/k of the weight rows (or of whole
  blocks of 32 rows, the form ptq's compiled quadratic form could take) rank the candidates;
  s = 1 and the best m of that ranking are scored in full (cost: the sampled share of the
  grid, plus the m + 1 or fewer in full);
- coarse k: s = 1 and every k-th grid point are scored, then the grid points less than k
  steps from the best of them (cost: the candidates scored).

For each it prints the candidates scored per pair (in full losses' worth), on how many
pairs its choice differs from the full grid's, and the regret: how much larger the chosen
candidate's loss is than the grid's best (worst, and mean over all pairs). Also how flat
and how bumpy the losses are over the grid: the best against the second best, and how
many pairs' losses have more than one local minimum along the ratio (a bisection could
stop at the wrong one).

--quality also measures what the shortcuts' choices cost the model: for the full grid and
each shortcut, AWQ (loss linear, no clipping) then round to nearest on a copy of the model,
through ptq's own pipeline (each block's statistics after the blocks before it are
quantized), with each pair's pick replaced by the shortcut's (its candidates' losses row by
row, as above); then perplexity, KL and top-1 agreement against the original model on the
bundled held-out text. The table says on how many pairs each run's pick differed from that
run's full grid, and by how much its loss was higher.

It keeps every pair's Gram matrix until the pass ends (about 12 MB a block on the SmolLM2-shaped
model): meant for small models, not for an 8B one.

    python scripts/awq_grid_shortcuts.py                      # the bundled model
    python scripts/awq_grid_shortcuts.py --model /tmp/ptq-bench-gptq/smollm2 --seq-len 256 --group-size 64
    python scripts/awq_grid_shortcuts.py --quality             # and the quality each shortcut gives
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from unittest import mock

import torch
from torch import Tensor, nn

import ptq
import ptq.smoothing
from ptq.algorithms import awq
from ptq.arch import ResolvedMapping, block_mappings, find_blocks
from ptq.calibration.data import calibration_batches
from ptq.calibration.observers import HessianObserver, MeanAbsObserver
from ptq.errors import PtqError
from ptq.evaluate import eval_windows, evaluate, reference_logits
from ptq.recipe import parse_recipe
from ptq.schemes import QuantArgs

Labels = list[tuple[float | None, bool]]  # (ratio, duo) of each candidate: awq.grid_candidates


@dataclass
class Pair:
    """One smoothing pair: each candidate's squared output error per weight row, [candidates, out]."""

    name: str
    rows: Tensor
    labels: Labels
    searched: int  # the candidate ptq's awq_search chose

    @cached_property
    def losses(self) -> Tensor:
        """Each candidate's loss over all rows, [candidates]."""
        return self.rows.sum(dim=1)

    @cached_property
    def best(self) -> int:
        """The full grid's choice."""
        return choose(self.losses, set(range(len(self.labels))))


def choose(losses: Tensor, scored: set[int]) -> int:
    """The candidate of `scored` with the smallest loss, the first of equal ones (as awq_search)."""
    return min(sorted(scored), key=lambda c: float(losses[c]))


def rows_shortcut(every: int, keep: int, block: int = 1) -> Callable[[Tensor, Labels], tuple[set[int], float]]:
    """Rank on every `every`-th block of `block` weight rows (block 1: every `every`-th row; 32:
    whole blocks, as ptq's compiled quadratic form takes rows), score s = 1 and the best `keep`
    of that ranking in full."""
    def shortcut(rows: Tensor, labels: Labels) -> tuple[set[int], float]:
        taken = (torch.arange(rows.shape[1]) // block) % every == 0  # [out]
        sample = rows[:, taken].sum(dim=1)  # [candidates]
        ranked = torch.argsort(sample, stable=True)[:keep].tolist()
        scored = {0, *ranked}
        return scored, len(labels) * float(taken.float().mean()) + len(scored)
    return shortcut


def coarse_shortcut(step: int) -> Callable[[Tensor, Labels], tuple[set[int], float]]:
    """Score s = 1 and every `step`-th point of each grid, then the points of the best one's grid
    less than `step` points from it."""
    def shortcut(rows: Tensor, labels: Labels) -> tuple[set[int], float]:
        losses = rows.sum(dim=1)
        position = _grid_positions(labels)
        first = {c for c in range(len(labels)) if c == 0 or position[c][1] % step == 0}
        best = choose(losses, first)
        near = set()
        if best:
            grid, at = position[best]
            near = {c for c in range(1, len(labels)) if position[c][0] == grid and abs(position[c][1] - at) < step}
        scored = first | near
        return scored, float(len(scored))
    return shortcut


def _grid_positions(labels: Labels) -> dict[int, tuple[bool, int]]:
    """candidate -> (its grid: duo or not, its index along that grid); s = 1 (index 0) has none."""
    seen: dict[bool, int] = {}
    position = {}
    for c, (_, duo) in enumerate(labels[1:], start=1):
        position[c] = (duo, seen.get(duo, 0))
        seen[duo] = seen.get(duo, 0) + 1
    return position


def local_minima(losses: Tensor) -> int:
    """Strict local minima of a loss curve along the ratio (ends included)."""
    n = len(losses)
    return sum(1 for i in range(n)
               if (i == 0 or losses[i] < losses[i - 1]) and (i == n - 1 or losses[i] < losses[i + 1]))


@torch.no_grad()
def row_losses(weights: list[Tensor], gram: Tensor, scales: Tensor, args: QuantArgs,
               scale_dtype: torch.dtype) -> Tensor:
    """Σ_j ΔW_j ∘ (ΔW_j·G) per weight row for each candidate scale: [candidates, out], float64,
    ΔW and G rounded to the weights' dtype first (bf16 or float16 weights) as ptq's search does."""
    W = torch.cat([w.detach() for w in weights])  # [out, in]
    G = gram.to(W.dtype).double()  # [in, in]
    W32 = W.float()
    found = []
    for s in scales:
        delta = (awq.candidate_weights(W, s.unsqueeze(0), args, scale_dtype)[0].float() - W32).to(W.dtype)
        delta = delta.double()  # [out, in]
        found.append((delta @ G).mul_(delta).sum(dim=1))
    return torch.stack(found)  # [candidates, out]


def model_pairs(model: nn.Module, args: QuantArgs) -> list[tuple[int, ResolvedMapping]]:
    """(block index, pair) of every smoothing pair of the model's family table; PtqError where
    the group size does not divide a pair's input features."""
    _, blocks = find_blocks(model)
    pairs = [(index, m) for index, block in enumerate(blocks) for m in block_mappings(model, block)[0]]
    for index, m in pairs:
        features = m.balance[0].in_features
        if args.strategy == "group" and features % args.group_size:
            raise PtqError(f"group size {args.group_size} does not divide the {features} input features of "
                           f"block {index}'s {m.mapping.describe()}; give --group-size a divisor of {features}")
    return pairs


@torch.no_grad()
def collect(model: nn.Module, pairs: list[tuple[int, ResolvedMapping]], batches: Tensor,
            batch_size: int) -> list[tuple[str, ResolvedMapping, MeanAbsObserver, HessianObserver]]:
    """Each pair's name, mean |x| and Gram matrix of its balance Linears' input, over one
    full-precision pass of the batches."""
    found, handles = [], []
    for index, m in pairs:
        mean, gram = MeanAbsObserver(), HessianObserver()
        found.append((f"{index}: {m.mapping.describe()}", m, mean, gram))

        def observe(_module, args, mean=mean, gram=gram):
            mean.update(args[0])
            gram.update(args[0])
        handles.append(m.balance[0].register_forward_pre_hook(observe))
    try:
        for batch in batches.split(batch_size):
            model(batch)
    finally:
        for handle in handles:
            handle.remove()
    return found


def measure(model: nn.Module, batches: Tensor, args: QuantArgs, *, n_grid: int = 20, duo_scaling: bool = True,
            batch_size: int = 4) -> list[Pair]:
    """Every pair's per-row candidate losses, and what ptq's awq_search chose for it (PtqError
    before the pass where the group size does not fit a pair: model_pairs)."""
    dtype = next(model.parameters()).dtype
    pairs = []
    for name, m, mean, gram in collect(model, model_pairs(model, args), batches, batch_size):
        weights = [b.weight for b in m.balance]
        G = gram.value * (gram.tokens / 2)  # Σ x xᵀ
        result = awq.awq_search(mean.value, weights, awq.make_linear_loss(weights, G, gram.tokens, args=args,
                                scale_dtype=dtype), args=args, n_grid=n_grid, duo_scaling=duo_scaling)
        scales, labels = awq.grid_candidates(mean.value.float().clamp(min=0), awq.weight_mean(weights, args),
                                             n_grid, duo_scaling)
        searched = labels.index((result.ratio, result.duo_scaling if result.ratio is not None else False))
        pairs.append(Pair(name, row_losses(weights, G, scales, args, dtype), labels, searched))
    return pairs


SHORTCUTS = {
    "rows 1/4, best 4": rows_shortcut(4, 4),
    "rows 1/8, best 4": rows_shortcut(8, 4),
    "32-row blocks 1/8, 4": rows_shortcut(8, 4, block=32),
    "coarse 2": coarse_shortcut(2),
    "coarse 3": coarse_shortcut(3),
    "coarse 4": coarse_shortcut(4),
}


def table(pairs: list[Pair]) -> list[str]:
    """The shortcuts' cost and accuracy against the full grid, one line each."""
    lines = [f"{'search':20s} {'scored/pair':>11s} {'changed':>9s} {'worst regret':>13s} {'mean regret':>12s}"]
    shortcuts = {"full grid": lambda rows, labels: (set(range(len(labels))), float(len(labels)))} | SHORTCUTS
    for name, shortcut in shortcuts.items():
        cost, changed, regrets = 0.0, 0, []
        for pair in pairs:
            losses, best = pair.losses, pair.best
            scored, spent = shortcut(pair.rows, pair.labels)
            picked = choose(losses, scored)
            cost += spent
            changed += picked != best
            regrets.append(float(losses[picked] / losses[best] - 1) if losses[best] > 0 else 0.0)
        lines.append(f"{name:20s} {cost / len(pairs):11.1f} {changed:>4d} of {len(pairs):<3d} "
                     f"{100 * max(regrets):12.3f}% {100 * sum(regrets) / len(regrets):11.4f}%")
    return lines


def landscape(pairs: list[Pair]) -> str:
    """How flat and how bumpy the pairs' losses are over the grid."""
    gaps, bumpy, curves = [], 0, 0
    for pair in pairs:
        low = pair.losses.sort().values
        gaps.append(float(low[1] / low[0] - 1) if low[0] > 0 else 0.0)
        position = _grid_positions(pair.labels)
        for duo in {d for d, _ in position.values()}:
            curve = pair.losses[[c for c in sorted(position) if position[c][0] == duo]]
            bumpy += local_minima(curve) > 1
            curves += 1
    gaps.sort()
    return (f"second best loss over the best: median +{100 * gaps[len(gaps) // 2]:.3f}%, smallest "
            f"+{100 * gaps[0]:.4f}%; loss curves along the ratio with more than one local minimum: {bumpy} of "
            f"{curves}")


Shortcut = Callable[[Tensor, Labels], tuple[set[int], float]]


@dataclass
class Picks:
    """What a run's searches picked against the full grid of the same losses."""

    pairs: int = 0
    changed: int = 0
    regrets: list[float] = field(default_factory=list)


@contextmanager
def picked_by(shortcut: Shortcut | None, labels: Labels, picks: Picks) -> Iterator[None]:
    """Inside, every linear-loss AWQ search of ptq's pipeline takes the shortcut's pick
    (choose over the candidates it scores, from row_losses of the pair's weights, Gram matrix
    and candidates) and counts it in picks; None: the full grid, ptq's own choice, untouched."""
    made = ptq.smoothing.make_linear_loss

    def make(weights, gram, tokens, *, args, scale_dtype=torch.float32):
        loss = made(weights, gram, tokens, args=args, scale_dtype=scale_dtype)
        if shortcut is None:
            return loss
        tasks, sums, searched = loss.tasks, loss.sums, {}

        def remember(scales: Tensor):
            searched["scales"] = scales  # [candidates, in]
            return tasks(scales)

        def picked(results) -> Tensor:  # before any pick is applied: the weights are the searched ones
            true = sums(results)  # [candidates + 1]
            rows = row_losses(list(weights), gram, searched["scales"], args, scale_dtype)
            losses = rows.sum(dim=1)
            best, pick = choose(losses, set(range(len(labels)))), choose(losses, shortcut(rows, labels)[0])
            picks.pairs, picks.changed = picks.pairs + 1, picks.changed + (pick != best)
            picks.regrets.append(float(losses[pick] / losses[best] - 1) if losses[best] > 0 else 0.0)
            kept = torch.full_like(true, float("inf"))  # awq_choice takes the one finite sum
            kept[[pick, -1]] = true[[pick, -1]]  # (its RTN baseline is then inf: unused here)
            return kept

        loss.tasks, loss.sums = remember, picked
        return loss

    with mock.patch.object(ptq.smoothing, "make_linear_loss", make):
        yield


def quality_runs(model: nn.Module, tokenizer, scheme: QuantArgs, shortcuts: dict[str, Shortcut], *, samples: int,
                 seq_len: int, n_grid: int, windows: int | None = 64):
    """For the full grid and each shortcut: AWQ (loss linear) + RTN of a copy of the model
    with the shortcut's picks, evaluated against the model on the bundled held-out text
    (`windows` windows of 512 tokens). Returns [(name, its Picks or None for the full grid,
    its EvalResult)] and the model's own EvalResult."""
    weights = {"num_bits": scheme.num_bits, "symmetric": scheme.symmetric, "strategy": scheme.strategy,
               "group_size": scheme.group_size}
    recipe = parse_recipe({
        "calibration": {"samples": samples, "seq_len": seq_len, "seed": 0},
        "steps": [{"awq": {"n_grid": n_grid, "duo_scaling": True, "clip": False, "loss": "linear"}},
                  {"rtn": {"scheme": {"weights": weights}, "targets": ["Linear"], "ignore": ["lm_head"]}}]})
    labels = [(None, False)] + [(i / n_grid, True) for i in range(n_grid)]  # awq.grid_candidates' order
    held_out = eval_windows(tokenizer, max_windows=windows)
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        reference = reference_logits(model, held_out, Path(folder) / "reference", show_progress=False)
        for name, shortcut in {"full grid": None, **shortcuts}.items():
            quantized, picks = copy.deepcopy(model), Picks()
            with picked_by(shortcut, labels, picks):
                ptq.quantize(quantized, recipe, tokenizer=tokenizer, show_progress=False)
            runs.append((name, picks if shortcut else None, evaluate(quantized, held_out, reference=reference,
                                                                    show_progress=False)))
    return runs, evaluate(model, held_out, show_progress=False)


def quality_table(runs, plain) -> list[str]:
    """quality_runs' results, a line each."""
    lines = [f"{'search':20s} {'changed':>9s} {'worst regret':>13s} {'perplexity':>10s} {'KL':>8s} {'top-1':>7s}"]
    for name, picks, result in runs:
        changed = f"{picks.changed:>4d} of {picks.pairs:<3d}" if picks else f"{'-':>9s}"
        worst = f"{100 * max(picks.regrets):12.3f}%" if picks and picks.regrets else f"{'-':>13s}"
        lines.append(f"{name:20s} {changed} {worst} {result.perplexity:10.3f} {result.kl:8.5f} "
                     f"{100 * result.top1:6.2f}%")
    lines.append(f"(the model before quantization: perplexity {plain.perplexity:.3f} on {plain.tokens:,} held-out "
                 f"tokens, windows of {plain.seq_len})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder or Hub name (default: the bundled model)")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--n-grid", type=int, default=20)
    parser.add_argument("--quality", action="store_true",
                        help="also quantize (AWQ + RTN) with each shortcut's picks and measure perplexity and KL")
    args = parser.parse_args()
    start = time.perf_counter()
    try:
        if min(args.samples, args.seq_len, args.group_size, args.n_grid) < 1:
            raise PtqError("--samples, --seq-len, --group-size and --n-grid take positive numbers")
        scheme = QuantArgs(num_bits=4, symmetric=True, strategy="group", group_size=args.group_size)
        model, tokenizer = ptq.load_model(args.model)
        batches = calibration_batches(tokenizer, "builtin", samples=args.samples, seq_len=args.seq_len, seed=0)
        pairs = measure(model, batches, scheme, n_grid=args.n_grid)
    except PtqError as e:  # one line, exit code 2, as ptq's CLI
        print(f"awq_grid_shortcuts: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    agree = sum(p.best == p.searched for p in pairs)
    print(f"AWQ W4 g{args.group_size} (grid {args.n_grid}, duo scaling, loss: linear) on "
          f"{args.model or 'the bundled model'}, {args.samples} x {args.seq_len} tokens: {len(pairs)} pairs; "
          f"the float64 losses' best is ptq's choice on {agree} of them ({time.perf_counter() - start:.0f} s)")
    print(landscape(pairs))
    for line in table(pairs):
        print(line)
    if args.quality:
        start = time.perf_counter()
        runs, plain = quality_runs(model, tokenizer, scheme, SHORTCUTS, samples=args.samples, seq_len=args.seq_len,
                                   n_grid=args.n_grid)
        print(f"\nAWQ + RTN through ptq's pipeline with each search's picks ({time.perf_counter() - start:.0f} s):")
        for line in quality_table(runs, plain):
            print(line)


if __name__ == "__main__":
    main()
