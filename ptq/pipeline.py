"""quantize(model, recipe, ...): the library's main entry point.

It quantizes the model IN PLACE: every targeted nn.Linear is replaced by a QuantLinear,
and the model is moved to the compute dtype (float32 on a CPU, which has no fast bf16
matmul; the model's own dtype on CUDA). It returns the same model, with
`model.ptq_report` describing what was done. Nothing here prints (progress bars aside).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ptq.algorithms.gptq import gptq
from ptq.algorithms.rtn import rtn
from ptq.arch import find_blocks
from ptq.calibration.data import calibration_batches
from ptq.calibration.observers import HessianObserver
from ptq.calibration.runner import BlockRun, run_blocks
from ptq.errors import PtqError
from ptq.modules import QuantLinear
from ptq.primitives import QuantizedWeight
from ptq.targets import matches
from ptq.recipe import GPTQStep, Recipe, RTNStep, WeightStep, load_recipe


@dataclass
class QuantizationReport:
    recipe: Recipe
    checkpoint_dtype: torch.dtype  # dtype of the source weights: scales and kept tensors use it
    compute_dtype: torch.dtype
    layers: dict[str, str] = field(default_factory=dict)  # Linear name -> how it was quantized
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def compute_dtype_for(device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """float32 on a CPU (no fast bf16/fp16 matmul there); the model's dtype on an accelerator."""
    return torch.float32 if device.type == "cpu" else model_dtype


def select_linears(model: nn.Module, step: WeightStep) -> dict[str, nn.Linear]:
    """The nn.Linear modules the step targets and does not ignore, checked against its scheme."""
    chosen = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and matches(name, module, step.targets)
        and not matches(name, module, step.ignore)
    }
    if not chosen:
        raise PtqError(f"no Linear matches targets {step.targets} (minus ignore {step.ignore})")
    group = step.scheme.weights.group_size
    for name, module in chosen.items():
        if group and module.in_features % group:
            raise PtqError(
                f"group_size {group} does not divide in_features {module.in_features} of layer "
                f"'{name}'; choose a divisor of it, or add '{name}' to ignore"
            )
    return chosen


def check_finite(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        if param.is_floating_point() and not torch.isfinite(param).all():
            raise PtqError(f"model weight '{name}' contains NaN or Inf; the source model is broken")


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def quantize(
    model: nn.Module,
    recipe: Recipe | str,
    *,
    tokenizer=None,
    data=None,
    device: torch.device | str | None = None,
    show_progress: bool = True,
) -> nn.Module:
    """Quantize `model` in place with `recipe` (a Recipe, a YAML path or a preset name).

    data: calibration data for steps that need it (GPTQ): None for the recipe's own
    calibration source (the bundled text by default), a list of strings, a
    datasets.Dataset, or token-id tensors. tokenizer is needed unless data is token ids.
    """
    recipe = load_recipe(recipe)
    step = recipe.weight_step
    start = time.perf_counter()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    check_finite(model)
    checkpoint_dtype = _model_dtype(model)
    compute_dtype = compute_dtype_for(device, checkpoint_dtype)
    linears = select_linears(model, step)
    model.to(compute_dtype)
    model.eval()
    report = QuantizationReport(recipe, checkpoint_dtype, compute_dtype)

    if isinstance(step, RTNStep):
        _quantize_rtn(model, linears, step, report)
    else:
        cal = recipe.calibration
        batches = calibration_batches(
            tokenizer, cal.dataset if data is None else data,
            samples=cal.samples, seq_len=cal.seq_len, seed=cal.seed, text_column=cal.text_column,
        )
        _quantize_with_calibration(model, linears, step, batches, device, report, show_progress)
    report.seconds = time.perf_counter() - start
    model.ptq_report = report
    return model


def _replace(model: nn.Module, name: str, linear: nn.Linear, qw: QuantizedWeight, step: WeightStep) -> None:
    model.set_submodule(name, QuantLinear.from_quantized(linear, qw, step.scheme))


def _quantize_rtn(model: nn.Module, linears: dict[str, nn.Linear], step: WeightStep, report) -> None:
    for name, linear in linears.items():
        qw = rtn(linear.weight.detach(), step.scheme.weights, report.checkpoint_dtype)
        _replace(model, name, linear, qw, step)
        report.layers[name] = "rtn"


def _quantize_with_calibration(model, linears, step: GPTQStep, batches, device, report, show_progress) -> None:
    blocks_path, blocks = find_blocks(model)
    inside = {n: m for n, m in linears.items() if n.startswith(blocks_path + ".")}
    outside = {n: m for n, m in linears.items() if n not in inside}
    if outside:  # no calibration inputs are captured outside the blocks (e.g. lm_head)
        _quantize_rtn(model, outside, step, report)
        report.notes.append(f"RTN for Linears outside the decoder blocks: {', '.join(outside)}")

    def process(run: BlockRun) -> None:
        prefix = run.name + "."
        mine = {n[len(prefix):]: m for n, m in inside.items() if n.startswith(prefix)}
        stages = linear_stages(run, mine) if step.true_sequential else [list(mine)]
        for i, stage in enumerate(stages):
            # each pass stops where the next stage starts: nothing after it is needed yet
            stop_at = mine[stages[i + 1][0]] if i + 1 < len(stages) else None
            observers = run.collect({n: mine[n] for n in stage}, HessianObserver, stop_at=stop_at)
            for rel in stage:
                _gptq_one(model, prefix + rel, mine[rel], observers[rel].value, step, report)

    run_blocks(model, blocks_path, batches, process, device=device, propagate=step.propagate,
               show_progress=show_progress)


@torch.no_grad()
def linear_stages(run: BlockRun, linears: dict[str, nn.Linear]) -> list[list[str]]:
    """The Linears in execution order, grouped when they read the same input (q/k/v, gate/up)."""
    calls: list[tuple[str, torch.Tensor]] = []
    handles = [
        m.register_forward_pre_hook(lambda _m, args, name=n: calls.append((name, args[0])))
        for n, m in linears.items()
    ]
    try:
        args, kwargs = run.inputs[0]
        run.block(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    stages: list[list[str]] = []
    previous = None
    for name, x in calls:
        if any(name in stage for stage in stages):
            continue  # a Linear called twice in one pass keeps its first place
        if stages and x is previous:
            stages[-1].append(name)
        else:
            stages.append([name])
        previous = x
    missing = [n for n in linears if not any(n in stage for stage in stages)]
    return stages + ([missing] if missing else [])


def _gptq_one(model, name, linear, hessian, step: GPTQStep, report) -> None:
    result = gptq(
        linear.weight.detach(), hessian, step.scheme.weights,
        scale_dtype=report.checkpoint_dtype, block_size=step.block_size, damp=step.damp,
        actorder=step.actorder, scales=step.scales,
    )
    _replace(model, name, linear, result.weight, step)
    report.layers[name] = "gptq" if result.fallback is None else "rtn (fallback)"
    if result.fallback:
        report.notes.append(f"{name}: GPTQ fell back to RTN: {result.fallback}")
