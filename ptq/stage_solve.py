"""A stage's quantization: the Linears that read one input (q/k/v, gate/up), solved together
from that input's statistics (GPTQ's Hessian, the activations' range) or rounded (RTN), then
installed as QuantLinears in the model. Solving and installing are apart so that, with
several processes (ptq.distributed), one rank solves a stage and every rank installs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from ptq.algorithms.gptq import gptq
from ptq.algorithms.rtn import rtn
from ptq.modules import QuantLinear
from ptq.primitives import QuantizedWeight, qparams_from_minmax
from ptq.recipe import GPTQStep, WeightStep


def replace_linear(
    model: nn.Module, name: str, linear: nn.Linear, qw: QuantizedWeight, step: WeightStep, input_scale=None
) -> QuantLinear:
    """Put a QuantLinear holding qw in the Linear's place and free the Linear's weight."""
    module = QuantLinear.from_quantized(linear, qw, step.scheme, input_scale)
    model.set_submodule(name, module)
    linear.to("meta")  # the replaced Linear's full-precision weight is no longer needed: free it
    return module


def _input_scale(absmax: torch.Tensor, step: WeightStep, dtype: torch.dtype) -> torch.Tensor | None:
    """Static per-tensor activation scale from the calibrated max |x|."""
    acts = step.scheme.input_activations
    if acts is None or acts.dynamic:
        return None
    peak = absmax.max().reshape(1, 1)
    return qparams_from_minmax(-peak, peak, acts, dtype)[0].reshape(1)


@dataclass
class Solved:
    """A stage's quantized weights, before they replace its Linears (a rank solves them
    and sends them to the others)."""

    parts: list[QuantizedWeight]  # one per Linear, in the stage's order
    how: str  # what report.layers records: "gptq", "rtn", "rtn (fallback)"
    note: str | None  # GPTQ's fallback, for the report
    input_scale: torch.Tensor | None  # static activation scale, shared by the stage
    seconds: float  # in the GPTQ solve


def rows_split(step: WeightStep) -> bool:
    """Whether several processes can each solve a slice of a stage's rows: GPTQ's rows are
    independent given the Hessian, unless one scale spans them all (per tensor)."""
    return isinstance(step, GPTQStep) and step.scheme.weights.strategy != "tensor"


def solve_shared_input(linears: dict[str, nn.Linear], stats: dict, step: WeightStep, report,
                       part: tuple[int, int] | None = None) -> Solved:
    """Quantize Linears that read one input (q/k/v, gate/up) from its statistics. GPTQ
    solves them as one weight stacked along the outputs: its rows are independent given
    the shared Hessian, so one factorisation and one column loop serve them all.
    part=(k, n): GPTQ solves only the k-th of n slices of those rows (rows_split), and the
    result holds that slice alone (gather_rows joins the slices)."""
    args = step.scheme.weights
    weights = [linear.weight.detach() for linear in linears.values()]
    note, seconds = None, 0.0
    if isinstance(step, GPTQStep):
        W = torch.cat(weights)  # [out_total, in]
        if part is not None:
            k, n = part
            W = W[W.shape[0] * k // n: W.shape[0] * (k + 1) // n]
        start = time.perf_counter()
        result = gptq(
            W, stats["hessian"], args, scale_dtype=report.checkpoint_dtype,
            block_size=step.block_size, damp=step.damp, actorder=step.actorder, scales=step.scales,
            observer=step.observer,
        )
        seconds = time.perf_counter() - start
        parts = [result.weight] if part is not None else split_rows(result.weight, [w.shape[0] for w in weights])
        how = "gptq" if result.fallback is None else "rtn (fallback)"
        if result.fallback:
            note = f"{', '.join(linears)}: GPTQ fell back to RTN: {result.fallback}"
    else:
        parts = [rtn(w, args, report.checkpoint_dtype, step.observer) for w in weights]
        how = "rtn"
    scale = _input_scale(stats["absmax"], step, report.checkpoint_dtype) if "absmax" in stats else None
    return Solved(parts, how, note, scale, seconds)


def install(model, linears: dict[str, nn.Linear], solved: Solved, step: WeightStep, report) -> dict[str, nn.Module]:
    """Replace the Linears with QuantLinears holding the solved weights; report it."""
    if isinstance(step, GPTQStep):
        report.add_time("GPTQ solves", solved.seconds)
    if solved.note:
        report.notes.append(solved.note)
    modules = {}
    for (name, linear), qw in zip(linears.items(), solved.parts):
        report.layers[name] = solved.how
        modules[name] = replace_linear(model, name, linear, qw, step, solved.input_scale)
    return modules


def gather_rows(slices: list[Solved], rows: list[int]) -> Solved:
    """The Solved of a whole stage from its row slices, in order (each solved by one process
    with part=(k, n)); rows: each Linear's output rows."""
    first = slices[0]

    def joined(field: str) -> torch.Tensor | None:
        tensors = [getattr(s.parts[0], field) for s in slices]
        return None if tensors[0] is None else torch.cat(tensors)

    whole = first.parts[0].with_(q=joined("q"), scale=joined("scale"), zero=joined("zero"))
    return Solved(split_rows(whole, rows), first.how, first.note, first.input_scale, max(s.seconds for s in slices))


def split_rows(qw: QuantizedWeight, rows: list[int]) -> list[QuantizedWeight]:
    """The QuantizedWeights of stacked Linears, cut back along the output rows."""
    if len(rows) == 1:
        return [qw]

    def cut(t: torch.Tensor | None) -> list:
        return [None] * len(rows) if t is None else list(t.split(rows))

    # one scale per tensor: the stacked Linears were quantized with the same one
    scales = [qw.scale] * len(rows) if qw.args.strategy == "tensor" else cut(qw.scale)
    return [qw.with_(q=q, scale=s, zero=z) for q, s, z in zip(cut(qw.q), scales, cut(qw.zero))]
