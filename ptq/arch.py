"""Architecture knowledge as data: one table entry per model family, matched by class.

An entry says where the stack of decoder blocks is, and which (previous op -> Linears)
pairs inside a block can be smoothed (SmoothQuant, AWQ); a family whose layout depends on
its config (Falcon) has one entry per layout, chosen by config values. Models of families
not in the table still work for weight quantization: their blocks are found as the
model's largest ModuleList of same-class modules. (Linears that read the same input are
detected at run time by the calibration runner, so they need no entry.) Smoothing an
unknown family needs mappings from the recipe (`mappings_from_patterns`; `check_mappings`
checks them up front).

One generic engine (`resolve_mappings`) turns a table's block-relative names into the
modules of a concrete block, says how the scales fold into the previous op (a norm
computing x̂·w or x̂·(1 + w), as Gemma's; a Linear, or one part of a fused Linear's outputs,
as Phi-3's qkv_proj), and says in words why a mapping cannot be used there (a shape
mismatch under grouped-query attention, a post-norm block, a norm without weight).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D

from ptq.errors import PtqError
from ptq.targets import matches, pattern_problem


@dataclass(frozen=True)
class SmoothingMapping:
    """One smoothable pair, in module names relative to a decoder block.

    smooth:   the op whose output channels are divided by s (a norm, or a Linear);
    balance:  the Linears that read that output, whose input columns are multiplied by s;
    inspect:  the module whose output measures AWQ's loss: the smallest module containing
              the balance Linears that can be called on its own ("self_attn", "mlp", or the
              single balance Linear itself);
    requires: (attribute of the block, value) pairs that must hold for the pair to be
              adjacent in the block's forward (e.g. OPT's pre-norm flag);
    part:     (i, n) when smooth is a fused Linear whose outputs are n equal parts of which
              the balance Linears read part i (Phi-3: v in qkv_proj is part 2 of 3).
    """

    smooth: str
    balance: tuple[str, ...]
    inspect: str
    requires: tuple[tuple[str, object], ...] = ()
    part: tuple[int, int] | None = None

    def describe(self) -> str:
        part = "" if self.part is None else f" (part {self.part[0] + 1} of {self.part[1]})"
        return f"{self.smooth}{part} -> {', '.join(self.balance)}"


@dataclass(frozen=True)
class Architecture:
    blocks: str  # dotted path of the ModuleList of decoder blocks
    smoothing: tuple[SmoothingMapping, ...] = ()  # block-relative smoothable pairs
    when: tuple[tuple[str, object], ...] = ()  # (model.config attribute, value) pairs of this layout


_LLAMA_SMOOTHING = (
    SmoothingMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    # valid only without grouped-query attention (v_proj's outputs == o_proj's inputs)
    SmoothingMapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    SmoothingMapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    SmoothingMapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)

_OPT_PRE_NORM = (("do_layer_norm_before", True),)  # opt-350m normalizes after, not before
_OPT_SMOOTHING = (
    SmoothingMapping(
        "self_attn_layer_norm",
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "self_attn",
        requires=_OPT_PRE_NORM,
    ),
    SmoothingMapping("self_attn.v_proj", ("self_attn.out_proj",), "self_attn.out_proj"),
    # OPT's MLP is no submodule: fc1 and fc2 sit in the block, with a ReLU between them,
    # so fc1 -> fc2 cannot be smoothed
    SmoothingMapping("final_layer_norm", ("fc1",), "fc1", requires=_OPT_PRE_NORM),
)

# Gemma 2 and 3 normalize each sublayer's output too (post_attention_layernorm acts on
# o_proj's output): the MLP reads pre_feedforward_layernorm. Their norms compute x̂·(1 + w).
_GEMMA2_SMOOTHING = (
    _LLAMA_SMOOTHING[0],
    _LLAMA_SMOOTHING[1],
    SmoothingMapping("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    _LLAMA_SMOOTHING[3],
)

# Phi-3: q, k, v in one qkv_proj (v last) and gate, up in one gate_up_proj (up last). Only
# with as many key/value heads as query heads (Phi-3-mini) is v a third of qkv_proj's rows.
_PHI3_SMOOTHING = (
    SmoothingMapping("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
    SmoothingMapping("self_attn.qkv_proj", ("self_attn.o_proj",), "self_attn.o_proj", part=(2, 3)),
    SmoothingMapping("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
    SmoothingMapping("mlp.gate_up_proj", ("mlp.down_proj",), "mlp.down_proj", part=(1, 2)),
)

# Falcon's fused query_key_value (multi-query or grouped) and GELU MLP leave only the norms.
_FALCON_QKV, _FALCON_UP = "self_attention.query_key_value", "mlp.dense_h_to_4h"
_FALCON = (
    # Falcon-40B/180B: one norm before attention, one before the MLP, both on the block input
    Architecture("transformer.h", (
        SmoothingMapping("ln_attn", (_FALCON_QKV,), "self_attention"),
        SmoothingMapping("ln_mlp", (_FALCON_UP,), "mlp"),
    ), when=(("new_decoder_architecture", True), ("num_ln_in_parallel_attn", 2))),
    # falcon-rw: attention, then the MLP, each after its own norm
    Architecture("transformer.h", (
        SmoothingMapping("input_layernorm", (_FALCON_QKV,), "self_attention"),
        SmoothingMapping("post_attention_layernorm", (_FALCON_UP,), "mlp"),
    ), when=(("parallel_attn", False),)),
    # Falcon-7B (and Falcon2-11B): one norm feeds attention and the MLP, which run in
    # parallel; the smallest module holding both is the block itself ("")
    Architecture("transformer.h", (SmoothingMapping("input_layernorm", (_FALCON_QKV, _FALCON_UP), ""),)),
)

# Qwen3's and Gemma 3's q_norm/k_norm sit after q_proj/k_proj inside attention: no pair
_LLAMA_LIKE = (Architecture(blocks="model.layers", smoothing=_LLAMA_SMOOTHING),)

# transformers class name -> its layouts, the first whose `when` holds for the model's
# config (MoE families: ptq.arch_moe). The classes are imported from transformers and
# matched with isinstance, so subclasses inherit their parent's entry.
FAMILIES: dict[str, tuple[Architecture, ...]] = {
    "LlamaForCausalLM": _LLAMA_LIKE,
    "MistralForCausalLM": _LLAMA_LIKE,
    "Qwen2ForCausalLM": _LLAMA_LIKE,
    "Qwen3ForCausalLM": _LLAMA_LIKE,
    "GemmaForCausalLM": _LLAMA_LIKE,  # Gemma 1: Llama's layout with x̂·(1 + w) norms
    "Gemma2ForCausalLM": (Architecture("model.layers", _GEMMA2_SMOOTHING),),
    "Gemma3ForCausalLM": (Architecture("model.layers", _GEMMA2_SMOOTHING),),
    "Phi3ForCausalLM": (Architecture("model.layers", _PHI3_SMOOTHING),),
    "OPTForCausalLM": (Architecture("model.decoder.layers", _OPT_SMOOTHING),),
    "FalconForCausalLM": _FALCON,
    # GPT-2's Linears are transformers Conv1D modules: refused by check_linear_layers
    "GPT2LMHeadModel": (Architecture("transformer.h"),),
}

MAPPINGS_EXAMPLE = (
    'mappings: [{smooth: "re:.*input_layernorm$", balance: ["re:.*q_proj$", "re:.*k_proj$", '
    '"re:.*v_proj$"], inspect: self_attn}]'
)


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
    """The table entry of the model's family and layout, or one discovered from its module tree."""
    from ptq.arch_moe import MOE_FAMILIES  # built from this module's classes: imported here
    config = getattr(model, "config", None)
    for name, layouts in {**FAMILIES, **MOE_FAMILIES}.items():
        cls = _family_class(name)
        if cls is not None and isinstance(model, cls):
            for layout in layouts:
                if all(getattr(config, key, None) == value for key, value in layout.when):
                    return layout
    return Architecture(blocks=_largest_block_list(model))


def check_linear_layers(model: nn.Module, targets: Sequence[str], ignore: Sequence[str]) -> None:
    """PtqError if the step targets linear layers that are not nn.Linear: transformers' Conv1D
    (GPT-2: weight [in, out]), when `targets` names Linear or matches them. compressed-tensors
    quantizes nn.Linear only: transformers loads a quantized Conv1D with random weights (a warning)."""
    hits = [
        name for name, module in model.named_modules()
        if isinstance(module, Conv1D) and ("Linear" in targets or matches(name, module, targets))
        and not matches(name, module, ignore)
    ]
    if hits:
        raise PtqError(
            f"{type(model).__name__} computes with transformers Conv1D layers ({hits[0]} and "
            f"{len(hits) - 1} more), not nn.Linear; compressed-tensors quantizes nn.Linear only, so "
            "transformers could not load the checkpoint (it would come back with random weights): "
            "ptq cannot quantize this model"
        )


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The dotted path and the ModuleList of the model's decoder blocks."""
    path = architecture_of(model).blocks
    blocks = model.get_submodule(path)
    assert isinstance(blocks, nn.ModuleList), f"{path} is not a ModuleList"
    return path, blocks


# ---------------------------------------------------------------------------------------
# Smoothing mappings: from the table or the recipe, resolved against a concrete block


@dataclass(frozen=True)
class ResolvedMapping:
    """A SmoothingMapping whose names were found in one block, with the modules, and how the
    scales fold into smooth (the arguments of ptq.algorithms.smoothquant.apply_smoothing_)."""

    mapping: SmoothingMapping
    smooth: nn.Module
    balance: tuple[nn.Linear, ...]
    inspect: nn.Module
    rows: slice | None = None  # the output rows of a fused smooth Linear that are divided
    weight_offset: float = 0.0  # 1.0 for norms computing x̂·(1 + w) (Gemma)

    @property
    def channels(self) -> int:
        return self.balance[0].in_features


def smoothing_mappings(model: nn.Module) -> tuple[SmoothingMapping, ...]:
    """The smoothable pairs of the model's family; PtqError if the table has none."""
    mappings = architecture_of(model).smoothing
    if not mappings:
        raise PtqError(
            f"{type(model).__name__} has no smoothing mappings in ptq's architecture table; "
            "give them in the smoothquant/awq step of the recipe, with block-relative module "
            f"names or 're:' regexes, e.g. {MAPPINGS_EXAMPLE}"
        )
    return mappings


def block_mappings(
    model: nn.Module,
    block: nn.Module,
    patterns: Sequence[Mapping] | None = None,
    *,
    strict: bool = False,
    what: str = "smoothing",
) -> tuple[list[ResolvedMapping], list[str]]:
    """The usable mappings of one block and the reasons others were skipped.

    With patterns (from a recipe) those are used (strict: each must name modules of this
    block, see mappings_from_patterns); otherwise the family's table.
    """
    mappings = (mappings_from_patterns(block, patterns, strict=strict, what=what) if patterns
                else smoothing_mappings(model))
    return resolve_mappings(block, mappings)


def check_mappings(model: nn.Module, patterns: Sequence[Mapping] | None, what: str = "smoothing") -> None:
    """PtqError unless a smoothing step (`what`: its name) can find its pairs in every block.

    patterns: the step's `mappings` from the recipe, each of which must name modules of
    every decoder block; None: the family's table, which must exist. Meant to be called
    before any work starts; it reads module names only.
    """
    if not patterns:
        smoothing_mappings(model)
        return
    _, blocks = find_blocks(model)
    for block in blocks:
        mappings_from_patterns(block, patterns, strict=True, what=what)


def resolve_mappings(
    block: nn.Module, mappings: Sequence[SmoothingMapping]
) -> tuple[list[ResolvedMapping], list[str]]:
    """(usable mappings, human-readable reasons for each skipped one) for a concrete block."""
    from ptq.arch_moe import expand_each  # a `*` segment: each child of the module before it
    usable: list[ResolvedMapping] = []
    skipped: list[str] = []
    for mapping in expand_each(block, mappings):
        resolved = _resolve(block, mapping)
        if isinstance(resolved, str):
            skipped.append(f"{mapping.describe()} skipped: {resolved}")
        else:
            usable.append(resolved)
    return usable, skipped


def _resolve(block: nn.Module, mapping: SmoothingMapping) -> ResolvedMapping | str:
    """The resolved mapping, or why it cannot be used in this block."""
    for attribute, wanted in mapping.requires:
        value = getattr(block, attribute, None)
        if value != wanted:
            return (
                f"{type(block).__name__}.{attribute} is {value!r}, the mapping needs {wanted!r} "
                f"(otherwise {mapping.smooth} does not feed the balance Linears directly)"
            )
    names = (mapping.smooth, *mapping.balance, mapping.inspect)
    missing = [name for name in names if _get(block, name) is None]
    if missing:
        return f"{type(block).__name__} has no module {', '.join(missing)}"
    smooth, inspect = _get(block, mapping.smooth), _get(block, mapping.inspect)
    balance = tuple(_get(block, name) for name in mapping.balance)
    not_linear = [n for n, m in zip(mapping.balance, balance) if not isinstance(m, nn.Linear)]
    if not_linear:
        return f"balance module(s) {', '.join(not_linear)} are not nn.Linear"
    widths = {m.in_features for m in balance}
    if len(widths) != 1:
        return f"the balance Linears read different widths {sorted(widths)}"
    (width,) = widths
    fold = smooth_fold(smooth, width, mapping.part)
    if isinstance(fold, str):
        return f"{mapping.smooth}: {fold}"
    return ResolvedMapping(mapping, smooth, balance, inspect, *fold)  # type: ignore[arg-type]


def _get(block: nn.Module, name: str) -> nn.Module | None:
    try:
        return block.get_submodule(name)
    except AttributeError:
        return None


def smooth_problem(smooth: nn.Module, channels: int, part: tuple[int, int] | None = None) -> str | None:
    """Why dividing smooth's `channels` output channels (of `part`) by s would not be exact, or None."""
    fold = smooth_fold(smooth, channels, part)
    return fold if isinstance(fold, str) else None


def smooth_fold(
    smooth: nn.Module, channels: int, part: tuple[int, int] | None = None
) -> tuple[slice | None, float] | str:
    """How dividing smooth's `channels` output channels by s folds into it: (rows of a
    Linear, weight offset of a norm), or why it cannot be done exactly.

    A Linear divides its rows (and bias): all of them, or those of part (i, n) when its
    outputs are n equal parts (a fused Linear). Any other module must be a norm-like op
    whose output is proportional to a 1-D `weight` (LayerNorm, the RMSNorms of Llama, Qwen,
    Mistral: offset 0) or to 1 + weight (Gemma: offset 1), plus a `bias`; this is checked by
    running a float32 copy on a probe input, so other ops are refused rather than broken.
    """
    if isinstance(smooth, nn.Linear):
        count = 1 if part is None else part[1]
        if smooth.out_features != count * channels:
            if part is None:
                return (
                    f"it has {smooth.out_features} output channels but the balance Linears read "
                    f"{channels} (e.g. grouped-query attention: fewer key/value heads than query heads)"
                )
            return (
                f"its {smooth.out_features} output channels are not {count} parts of the {channels} "
                "the balance Linears read (e.g. grouped-query attention: fewer key/value heads than query heads)"
            )
        return (None if part is None else slice(part[0] * channels, (part[0] + 1) * channels)), 0.0
    if part is not None:
        return f"{type(smooth).__name__} is not a Linear, so it has no output parts"
    weight = getattr(smooth, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return f"{type(smooth).__name__} has no 1-D weight to fold the scales into"
    if weight.numel() != channels:
        return f"its weight has {weight.numel()} channels but the balance Linears read {channels}"
    for offset in (0.0, 1.0):
        if _output_scales_with_weight(smooth, channels, offset):
            return None, offset
    return (
        f"{type(smooth).__name__}'s output is not proportional to its weight nor to 1 + weight "
        "on a probe input, so scales cannot be folded into it"
    )


@torch.no_grad()
def _output_scales_with_weight(norm: nn.Module, channels: int, offset: float) -> bool:
    """Whether norm's output scales by f when (offset + weight) and bias do, on a probe."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, channels, generator=g)  # [batch, seq, channels]
    factor = torch.rand(channels, generator=g) + 0.5  # [channels]
    try:
        probe = copy.deepcopy(norm).to(device="cpu", dtype=torch.float32)
        probe.weight.copy_(torch.rand(channels, generator=g) + 0.5)  # whatever the model holds
        before = probe(x)
        probe.weight.copy_((probe.weight + offset) * factor - offset)
        if getattr(probe, "bias", None) is not None:
            probe.bias.mul_(factor)
        after = probe(x)
    except Exception:  # noqa: BLE001 - any failure means the op is not a plain norm
        return False
    if isinstance(before, tuple) or not isinstance(before, torch.Tensor):
        return False
    return torch.allclose(after, before * factor, rtol=1e-4, atol=1e-5)


_PATTERN_KEYS = ("smooth", "balance", "inspect")


def mappings_from_patterns(
    block: nn.Module, patterns: Sequence[Mapping], *, strict: bool = False, what: str = "smoothing"
) -> tuple[SmoothingMapping, ...]:
    """Mappings of one block from recipe patterns, in compressed-tensors target syntax.

    Each pattern is {smooth: P, balance: [P, ...], inspect: P (optional)} where P is a
    block-relative module name, a class name or 're:<regex>' (re.match on the names).
    smooth must match one module; each balance pattern adds the Linears it matches; inspect
    defaults to the single balance Linear, or the balance Linears' lowest common parent
    ("" for the block itself).
    A pattern whose smooth op is not in this block yields no mapping (it may match others);
    strict (the recipe's own mappings): PtqError instead. `what` names the step in messages.
    """
    named = [(name, module) for name, module in block.named_modules() if name]
    found: list[SmoothingMapping] = []
    for i, pattern in enumerate(patterns):
        _check_pattern(i, pattern, what)
        where = f"{what} mapping {i} ({_cut(pattern['smooth'])} -> {_cut(', '.join(pattern['balance']))})"
        smooth = [name for name, module in named if matches(name, module, [pattern["smooth"]])]
        if not smooth and strict:
            wanted = pattern["smooth"]
            module = f"module matching '{_cut(wanted)}'" if wanted.startswith("re:") else f"module {_cut(wanted)}"
            raise PtqError(
                f"{where}: {type(block).__name__} has no {module}; check the names (print(model) shows them)"
            )
        if not smooth:
            continue
        if len(smooth) > 1:
            raise PtqError(
                f"{where}: smooth pattern {_cut(pattern['smooth'])!r} matches "
                f"{len(smooth)} modules in a block ({', '.join(smooth[:4])}); make it match one"
            )
        balance = _balance_names(where, block, pattern["balance"], named)
        inspect = _inspect_name(where, pattern.get("inspect"), balance, named)
        found.append(SmoothingMapping(smooth[0], balance, inspect))
    return tuple(found)


def _cut(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_pattern(i: int, pattern: Mapping, what: str) -> None:
    if not isinstance(pattern, Mapping):
        raise PtqError(f"{what} mapping {i} must be a mapping like {MAPPINGS_EXAMPLE}")
    unknown = [key for key in pattern if key not in _PATTERN_KEYS]
    if unknown:
        raise PtqError(
            f"{what} mapping {i}: unknown key '{_cut(str(unknown[0]))}'; allowed keys: {', '.join(_PATTERN_KEYS)}"
        )
    if "smooth" not in pattern or "balance" not in pattern:
        raise PtqError(f"{what} mapping {i} needs 'smooth' and 'balance', e.g. {MAPPINGS_EXAMPLE}")
    balance = pattern["balance"]
    if isinstance(balance, str) or not isinstance(balance, Sequence) or not balance:
        raise PtqError(f"{what} mapping {i}: 'balance' must be a list of patterns, at least one")
    texts = [pattern["smooth"], *balance, pattern.get("inspect") or ""]
    if not all(isinstance(text, str) for text in texts):
        raise PtqError(f"{what} mapping {i}: smooth, balance and inspect are module names or 're:' patterns (text)")
    problems = [problem for problem in map(pattern_problem, texts) if problem]
    if problems:
        raise PtqError(f"{what} mapping {i}: {problems[0]}")


Named = list[tuple[str, nn.Module]]


def _balance_names(where: str, block: nn.Module, patterns: Sequence[str], named: Named) -> tuple[str, ...]:
    chosen: list[str] = []
    for pattern in patterns:
        hits = [n for n, m in named if isinstance(m, nn.Linear) and matches(n, m, [pattern])]
        if not hits:
            raise PtqError(
                f"{where}: balance pattern {_cut(pattern)!r} matches no Linear in {type(block).__name__}; "
                "check the names (print(model) shows them)"
            )
        chosen += [name for name in hits if name not in chosen]
    return tuple(chosen)


def _inspect_name(where: str, pattern: str | None, balance: tuple[str, ...], named: Named) -> str:
    if pattern is None:
        if len(balance) == 1:
            return balance[0]
        parts = [name.split(".") for name in balance]
        common: list[str] = []
        for pieces in zip(*parts):
            if len(set(pieces)) != 1:
                break
            common.append(pieces[0])
        modules = dict(named)
        while common and isinstance(modules.get(".".join(common)), nn.ModuleList):
            common.pop()  # a ModuleList is never called: inspect its parent
        return ".".join(common)  # "" is the block itself
    hits = [name for name, module in named if matches(name, module, [pattern])]
    if len(hits) != 1:
        raise PtqError(
            f"{where}: inspect pattern {_cut(pattern)!r} must match one module in a block, "
            f"matched {len(hits)}"
        )
    return hits[0]
