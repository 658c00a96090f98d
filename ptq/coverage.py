"""What share of a model a recipe quantizes, and which large weights it leaves as they are.

Never silent: the report states the share of parameters quantized and names every large
weight left untouched with the reason, and a recipe that would leave more than half of
the parameters untouched without the user listing them in `ignore` is refused before any
work (e.g. MoE experts held as 3-D tensors, or targets that match only a few Linears).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from ptq.errors import PtqError
from ptq.targets import matches

LARGE_SHARE = 0.01  # an untouched weight with at least this share of the parameters is named
MISSED = ("not a Linear: no scheme step quantizes it", "not matched by the recipe's targets")  # [is a Linear]


@dataclass(frozen=True)
class Untouched:
    pattern: str  # the weights' names, block indices replaced by '*'
    params: int
    reason: str


@dataclass(frozen=True)
class Coverage:
    total: int  # parameters of the model (tied weights once)
    quantized: int
    untouched: list[Untouched] = field(default_factory=list)  # the large ones, largest first

    @property
    def share(self) -> float:
        return self.quantized / self.total if self.total else 0.0

    def notes(self) -> list[str]:
        return [f"left in 16 bits: {u.pattern} ({u.params / self.total:.1%} of the parameters): {u.reason}"
                for u in self.untouched]


def _owner(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rpartition(".")[0]) if "." in name else model


def _reason(model: nn.Module, name: str, ignore: list[str]) -> str | None:
    """Why an untouched parameter is untouched, or None when the recipe simply misses it."""
    owner_name = name.rpartition(".")[0]
    owner = _owner(model, name)
    if isinstance(owner, nn.Embedding):
        return "an embedding table (weight schemes quantize Linears)"
    if matches(owner_name, owner, ignore):
        return "listed in the recipe's ignore"
    return None


def name_pattern(name: str) -> str:
    """The name with block and expert indices as '*', to name a weight of every block at once."""
    return re.sub(r"(?<=\.)\d+(?=\.)", "*", name)  # model.layers.3.mlp -> model.layers.*.mlp


def coverage(model: nn.Module, quantized: set[str], ignore: list[str]) -> Coverage:
    """The coverage of quantizing the parameters named in `quantized` (e.g. 'x.q_proj.weight').

    Untouched parameters of at least LARGE_SHARE of the model (grouped by name pattern
    across blocks) are listed with their reason; raises PtqError when those the recipe
    neither quantizes nor ignores hold more than half of the parameters.
    """
    params = dict(model.named_parameters())  # tied weights appear once
    total = sum(p.numel() for p in params.values())
    done = sum(params[n].numel() for n in quantized if n in params)
    groups: dict[tuple[str, str], int] = {}
    missed = 0
    for name, param in params.items():
        if name in quantized or param.dim() < 2:
            continue
        reason = _reason(model, name, ignore)
        if reason is None:
            missed += param.numel()
            reason = MISSED[isinstance(_owner(model, name), nn.Linear)]
        key = (name_pattern(name), reason)
        groups[key] = groups.get(key, 0) + param.numel()
    untouched = sorted((Untouched(p, n, r) for (p, r), n in groups.items() if n >= LARGE_SHARE * total),
                       key=lambda u: -u.params)
    result = Coverage(total, done, untouched)
    if total and missed > total / 2:
        unasked = [f"{u.pattern} ({u.params / total:.0%})" for u in untouched if u.reason in MISSED]
        named = ", ".join(unasked[:4]) + (f" and {len(unasked) - 4} more" if len(unasked) > 4 else "")
        raise PtqError(
            f"the recipe would leave {missed / total:.0%} of the parameters untouched ({named}); "
            "quantize them, or list them in the step's ignore if that is what you want"
        )
    return result
