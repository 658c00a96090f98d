"""How a recipe meets MoE blocks: the routers stay in 16 bits and are named, smoothing
mappings that would rescale what a router reads are skipped and named, and expert weights
in a form their readers lose (zero points, activation-order groups) are refused."""

from __future__ import annotations

from torch import nn

from ptq import moe
from ptq.arch import mappings_from_patterns
from ptq.coverage import name_pattern
from ptq.errors import PtqError
from ptq.recipe import GPTQStep, TransformStep, WeightStep


def natural_key(name: str) -> list:
    """Sort key: numbers in names compare as numbers (experts.10 after experts.9)."""
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def router_safe(block: nn.Module, transform: TransformStep, report) -> TransformStep | None:
    """The smoothing step without the recipe mappings that would rescale what an MoE
    block's routers read (ptq.moe.router_reads: they stay in 16 bits, unscaled, so the
    routing would change), each named in the notes; None when no mapping is left."""
    if not transform.mappings or not moe.has_experts(block):
        return transform
    kept = []
    for pattern in transform.mappings:
        resolved = mappings_from_patterns(block, [pattern], what=transform.step_name)
        unsafe = [(m, owner) for m in resolved if (owner := moe.router_reads(block, m.smooth, m.balance))]
        for mapping, owner in unsafe:
            note = (f"{transform.step_name} mapping {mapping.describe()} skipped: the routers of {owner} read "
                    f"{mapping.smooth}'s output too, and they are not rescaled")
            if note not in report.notes:
                report.notes.append(note)
        if not unsafe:
            kept.append(pattern)
    return transform.model_copy(update={"mappings": kept}) if kept else None


def router_notes(model: nn.Module) -> list[str]:
    """What the report says about MoE blocks: the routers kept in 16 bits."""
    routers = moe.router_names(model)
    if not routers:
        return []
    patterns = list(dict.fromkeys(name_pattern(name) for name in routers))
    return [f"MoE routers kept in 16 bits (they choose the experts; {len(routers)} modules): {', '.join(patterns)}"]


def check_experts_scheme(model: nn.Module, linears: dict[str, nn.Linear], step: WeightStep) -> None:
    """Refuse expert weights in a form their readers lose: transformers 5.24 drops zero
    points and weight_g_idx when it fuses the experts on load, and vLLM's MoE kernels take
    symmetric weights without activation-order groups."""
    asymmetric = not step.scheme.weights.symmetric
    grouped = isinstance(step, GPTQStep) and step.actorder == "group"
    if not (asymmetric or grouped):
        return
    experts = [name for name in linears if moe.expert_of(model, name)]
    if experts:
        what = "zero points (asymmetric weights)" if asymmetric else "activation-order groups (actorder: group)"
        raise PtqError(
            f"MoE experts ({experts[0]}, ...) with {what} do not load in transformers or vLLM; use a "
            "symmetric scheme without actorder group, or add the experts to ignore"
        )
