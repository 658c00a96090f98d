"""Mixture-of-experts knowledge as data: where each family keeps its experts and routers,
and the names its checkpoints give them.

transformers 5 holds a block's routed experts fused, in a module that is no nn.Linear:
`experts.gate_up_proj` [experts, 2 * inter, hidden] (each expert's gate rows, then its up
rows) and `experts.down_proj` [experts, hidden, inter]. Checkpoints keep one Linear per
expert and projection, `experts.{e}.gate_proj.weight` (Mixtral: w1 = gate, w3 = up, w2 =
down, under `block_sparse_moe` instead of `mlp`): what is on the Hub, what transformers'
save_pretrained writes and its conversion mapping fuses on load, and what vLLM's FusedMoE
loads expert by expert.

ptq splits each fused module into `UnfusedExperts` (ptq.modules): per expert, three
nn.Linear under the checkpoint's names, with the fused module's routed forward. From there
the experts are ordinary Linears: targeted by `Linear`, calibrated on the tokens routed to
them, quantized into QuantLinears and saved as `experts.{e}.w1.weight_packed` and so on,
the compressed-tensors MoE layout (transformers dequantizes each expert with
compressed-tensors, then fuses them; vLLM packs them into its fused kernels' layout).

Routers (the top-k gate, Qwen2-MoE's one-row `shared_expert_gate`) choose the experts;
ptq leaves them in 16 bits and lists them in the checkpoint's `ignore`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Container, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from ptq.errors import PtqError
from ptq.modules import Expert, UnfusedExperts


@dataclass(frozen=True)
class MoEFamily:
    """How one family's fused experts module maps to checkpoint names."""

    module: str  # the transformers module that defines the fused experts class
    projections: tuple[str, str, str]  # checkpoint names of an expert's gate, up and down Linears
    routers: tuple[str, ...]  # modules beside the experts (in the MoE block) that route tokens
    renames: tuple[tuple[str, str], ...] = ()  # (module name in transformers 5, name in checkpoints)


_GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")

# fused experts class name -> family; matched by class (isinstance), looked up in `module`
FAMILIES: dict[str, MoEFamily] = {
    "MixtralExperts": MoEFamily(
        "transformers.models.mixtral.modeling_mixtral", ("w1", "w3", "w2"), ("gate",), (("mlp", "block_sparse_moe"),)
    ),
    "Qwen2MoeExperts": MoEFamily(
        "transformers.models.qwen2_moe.modeling_qwen2_moe", _GATE_UP_DOWN, ("gate", "shared_expert_gate")
    ),
    "Qwen3MoeExperts": MoEFamily("transformers.models.qwen3_moe.modeling_qwen3_moe", _GATE_UP_DOWN, ("gate",)),
    "DeepseekV2Experts": MoEFamily("transformers.models.deepseek_v2.modeling_deepseek_v2", _GATE_UP_DOWN, ("gate",)),
    "DeepseekV3Experts": MoEFamily("transformers.models.deepseek_v3.modeling_deepseek_v3", _GATE_UP_DOWN, ("gate",)),
}


def _experts_class(name: str) -> type | None:
    """The class, if its module is loaded (a model of the family imported it); else None."""
    return getattr(sys.modules.get(FAMILIES[name].module), name, None)


def family_of(module: nn.Module) -> MoEFamily | None:
    """The family of a fused experts module, or of an UnfusedExperts made from one."""
    if isinstance(module, UnfusedExperts):
        return FAMILIES[module.source]
    for name in FAMILIES:
        cls = _experts_class(name)
        if cls is not None and isinstance(module, cls):
            return FAMILIES[name]
    return None


def experts_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, MoEFamily]]:
    """(name, module, family) of each experts container, fused or unfused."""
    for name, module in model.named_modules():
        family = family_of(module)
        if family is not None:
            yield name, module, family


def is_fused(module: nn.Module) -> bool:
    return not isinstance(module, UnfusedExperts) and family_of(module) is not None


# ---------------------------------------------------------------------------------------
# Fused -> one Linear per expert and projection


def unfuse_experts_(model: nn.Module, keep: Container[str] = ()) -> list[str]:
    """Replace each fused experts module (but those named in keep) with UnfusedExperts
    computing the same; return their names. Works on the meta device too (empty models)."""
    done = []
    for name, module, family in list(experts_modules(model)):
        if is_fused(module) and name not in keep:
            model.set_submodule(name, _unfused(name, module, family))
            done.append(name)
    return done


def _unfused(name: str, fused: nn.Module, family: MoEFamily) -> UnfusedExperts:
    layout = {
        "has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
        "has_post_expert_norm": False,
    }
    differing = [flag for flag, want in layout.items() if getattr(fused, flag, want) != want]
    if differing:
        raise PtqError(
            f"cannot split the experts of '{name}' ({type(fused).__name__}): ptq reads fused "
            f"[gate; up] and down weights without bias, and this module has {', '.join(differing)} set differently"
        )
    gate_up, down = fused.gate_up_proj, fused.down_proj  # [experts, 2 * inter, hidden], [experts, hidden, inter]
    inter = gate_up.shape[1] // 2
    experts = [
        Expert(family.projections, (_linear(gate_up[e, :inter]), _linear(gate_up[e, inter:]), _linear(down[e])),
               fused.act_fn)
        for e in range(gate_up.shape[0])
    ]
    return UnfusedExperts(experts, type(fused).__name__)


def _linear(weight) -> nn.Linear:
    """A bias-free Linear holding a copy of weight [out, in] (its own storage: checkpoints
    refuse tensors that share memory)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    return linear


# ---------------------------------------------------------------------------------------
# Routers, calibration, block structure


def router_names(model: nn.Module) -> list[str]:
    """The routers of every MoE block (its top-k gate, a shared expert's gate), by name."""
    names = []
    for name, _, family in experts_modules(model):
        block = name.rpartition(".")[0]
        for router in family.routers:
            full = f"{block}.{router}" if block else router
            if _has(model, full):
                names.append(full)
    return names


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def has_experts(block: nn.Module) -> bool:
    return any(isinstance(module, UnfusedExperts) for module in block.modules())


@contextmanager
def all_experts(block: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, every token goes through every expert (for statistics and for
    finding the order of the Linears); the outputs stay the routed ones."""
    experts = [m for m in block.modules() if isinstance(m, UnfusedExperts)] if enabled else []
    for module in experts:
        module.all_tokens = True
    try:
        yield
    finally:
        for module in experts:
            module.all_tokens = False


def expert_of(block: nn.Module, name: str) -> str | None:
    """The block-relative name of the routed expert holding Linear `name`, or None."""
    parent, _, _ = name.rpartition(".")
    container, _, _ = parent.rpartition(".")
    if container and isinstance(block.get_submodule(container), UnfusedExperts):
        return parent
    return None


def sequential_groups(block: nn.Module, stages: list[list[str]]) -> list[list[str]]:
    """The stages merged into groups calibrated by one pass each (true-sequential): a
    routed expert's stages join the same stage of the block's other experts (all gate/up,
    then all down), since experts read what the router gives them, not each other's
    outputs; other stages stay groups of their own."""
    groups: list[list[str]] = []
    merged: dict[tuple[str, int], list[str]] = {}  # (experts container, stage within an expert)
    depth: dict[str, int] = {}  # expert -> stages of it seen so far
    for stage in stages:
        expert = expert_of(block, stage[0])
        if expert is None:
            groups.append(list(stage))
            continue
        key = (expert.rpartition(".")[0], depth.get(expert, 0))
        depth[expert] = key[1] + 1
        if key not in merged:
            merged[key] = []
            groups.append(merged[key])
        merged[key].extend(stage)
    return groups


def router_reads(block: nn.Module, smooth: str, balance: Sequence[str]) -> str | None:
    """The MoE module (block-relative) whose routers would read the output of `smooth` if
    it were rescaled for `balance`, or None. That is so when smooth sits outside the MoE
    module and a balance Linear inside it: the Linear reads the module's input, which its
    routers read too. (Inside it, e.g. an expert's up -> down, the routers see nothing.)"""
    for name, module in block.named_modules():
        if not isinstance(module, UnfusedExperts):
            continue
        owner = name.rpartition(".")[0]

        def inside(other: str, owner: str = owner) -> bool:
            return not owner or other.startswith(owner + ".")

        if not inside(smooth) and any(inside(linear) for linear in balance):
            return owner
    return None


# ---------------------------------------------------------------------------------------
# Names in checkpoints


def _renames(model: nn.Module) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    for _, _, family in experts_modules(model):
        found += [pair for pair in family.renames if pair not in found]
    return found


def renamer(model: nn.Module, *, to_checkpoint: bool) -> Callable[[str], str]:
    """Module or tensor name (or 're:' pattern) in the model -> in its checkpoints, or back.

    A rename replaces a whole name segment (Mixtral: mlp <-> block_sparse_moe), also where
    it is written inside a regex ('[.]mlp[.]', '\\.mlp\\.')."""
    pairs = [(old, new) if to_checkpoint else (new, old) for old, new in _renames(model)]
    patterns = [(re.compile(rf"(?<![A-Za-z0-9_]){re.escape(old)}(?![A-Za-z0-9_])"), new) for old, new in pairs]

    def rename(name: str) -> str:
        for pattern, new in patterns:
            name = pattern.sub(new, name)
        return name

    return rename


def checkpoint_tensors(model: nn.Module, tensors: dict) -> dict:
    """The tensors to store under their checkpoint names."""
    rename = renamer(model, to_checkpoint=True)
    return {rename(name): tensor for name, tensor in tensors.items()}


def checkpoint_quantization_config(model: nn.Module, qconfig: dict) -> dict:
    """quantization_config with the routers in `ignore` and every name as checkpoints spell it."""
    rename = renamer(model, to_checkpoint=True)
    ignore = list(qconfig.get("ignore") or [])
    ignore += [name for name in router_names(model) if name not in ignore]
    groups = {
        key: {**group, "targets": [rename(target) for target in group["targets"]]}
        for key, group in qconfig["config_groups"].items()
    }
    return {**qconfig, "ignore": [rename(name) for name in ignore], "config_groups": groups}
