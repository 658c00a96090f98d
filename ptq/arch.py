"""Architecture knowledge as data: one table entry per model family, matched by class.

An entry says where the stack of decoder blocks is. Models of families not in the table
still work for weight quantization: their blocks are found as the model's largest
ModuleList of same-class modules. (Linears that read the same input are detected at run
time by the calibration runner, so they need no entry.)
"""

from __future__ import annotations

from dataclasses import dataclass

import transformers
from torch import nn

from ptq.errors import PtqError


@dataclass(frozen=True)
class Architecture:
    blocks: str  # dotted path of the ModuleList of decoder blocks


_LLAMA_LIKE = Architecture(blocks="model.layers")
_OPT = Architecture(blocks="model.decoder.layers")

# transformers class name -> architecture. The classes are imported from transformers and
# matched with isinstance, so subclasses inherit their parent's entry.
FAMILIES: dict[str, Architecture] = {
    "LlamaForCausalLM": _LLAMA_LIKE,
    "MistralForCausalLM": _LLAMA_LIKE,
    "Qwen2ForCausalLM": _LLAMA_LIKE,
    "Qwen3ForCausalLM": _LLAMA_LIKE,
    "OPTForCausalLM": _OPT,
}


def _family_class(name: str) -> type | None:
    try:
        return getattr(transformers, name)
    except (AttributeError, ImportError):  # a class this transformers version lacks
        return None


def _largest_block_list(model: nn.Module) -> str:
    best, best_len = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > best_len:
            if len({type(child) for child in module}) == 1:
                best, best_len = name, len(module)
    if best is None:
        raise PtqError(
            f"cannot find the decoder blocks of {type(model).__name__}: ptq expects them in an "
            "nn.ModuleList of identical modules (as in transformers' causal LMs)"
        )
    return best


def architecture_of(model: nn.Module) -> Architecture:
    """The table entry of the model's family, or one discovered from its module tree."""
    for name, architecture in FAMILIES.items():
        cls = _family_class(name)
        if cls is not None and isinstance(model, cls):
            return architecture
    return Architecture(blocks=_largest_block_list(model))


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The dotted path and the ModuleList of the model's decoder blocks."""
    path = architecture_of(model).blocks
    blocks = model.get_submodule(path)
    assert isinstance(blocks, nn.ModuleList), f"{path} is not a ModuleList"
    return path, blocks
